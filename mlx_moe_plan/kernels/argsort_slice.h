// argsort_slice: indices[r, p - start] = the index of the element at position p of
// row r's stable ascending sort, for p in [start, start + count): what
// mx.argsort(values)[r, start:start + count] gives. On a GPU, MLX's
// argpartition is that sort (MLX 0.32.4's Metal and CUDA backends sort each
// row whole, a stable merge sort, NaN after every number), so a router's top
// k, argpartition(scores, kth=-k)[..., -k:], is positions [E - k, E) here,
// index for index, in one launch instead of a sort of the row and a slice.
// An element's position is its rank: the elements of the row that sort
// before it, the smaller ones and the equal ones of lower index. The ranks
// are the positions, each once, so every output is written exactly once.
// Rows are short (a router's experts): each thread ranks its elements
// against the whole row, one compare an element, from a copy in shared
// memory of each element's key.
// The keys are the values' bits made unsigned integers of the same order,
// so no float compare (which fast math may take liberties with) is made:
// a positive value's bits with the sign bit set, a negative value's bits
// inverted (a larger magnitude, a smaller key), both zeros the key of +0 (they
// compare equal), and every NaN the largest key (NaNs equal one another).
// Beside each index, its value, as take_along_axis(values, indices) gives it
// (its bits: a router weights its experts with them, and a second launch
// would gather them again). With NORMALIZE, each value divided by the sum of
// the slice's, what `picked / picked.sum(-1, keepdims=True)` computes for a
// router that renormalizes its top k (two launches fewer): the sum in float32
// over ascending positions, rounded once to the values' type, then each value
// over it, rounded once. A router's 16-bit scores lie within a few octaves of
// one another, so that float32 sum is their exact sum. MLX's CUDA sum adds
// 16-bit values in their own type (a few a thread, then a tree), a rounding
// an addition, so its quotients may differ from these in their last bits.
// The quotient is IEEE division's on CUDA (MLX compiles without fast math)
// and OpenCL; Metal's fast math may round it otherwise.
// The body casts values to raw types, so values must be a `device` buffer on
// Metal: the host pads it to at least 8 elements, below which MLX passes
// `constant`.
// Inputs: values InT [num_rows, row_size]; params int32, the fields of
//   launch.py's ArgsortSliceParams in order (read below).
// Outputs: indices uint32 [num_rows, count]; slice_values InT [num_rows,
//   count], the value at each index (with NORMALIZE, over their sum).
// Template constants: InT, OutT (InT: the normalized values' type), BitsT (an
//   unsigned integer type of InT's width), IN_KIND (0 float32, 1 float16, 2
//   bfloat16), MAX_ROW (the longest row), NORMALIZE.
const int num_rows = params[0];
const int row_size = params[1];
const int start = params[2];
const int count = params[3];

// The sign bit, the bits of a value, and the largest finite magnitude's
// exponent field: magnitudes above it (with a mantissa) are NaN.
const unsigned SIGN = IN_KIND == 0 ? 0x80000000u : 0x8000u;
const unsigned ALL_BITS = IN_KIND == 0 ? 0xFFFFFFFFu : 0xFFFFu;
const unsigned INFINITY_BITS = IN_KIND == 0 ? 0x7F800000u : (IN_KIND == 1 ? 0x7C00u : 0x7F80u);
SHARED unsigned row_keys[MAX_ROW];
// NORMALIZE's copy of the slice's values, by position (one float without it).
SHARED float picked[NORMALIZE * (MAX_ROW - 1) + 1];
GLOBAL const BitsT* value_bits = (GLOBAL const BitsT*)values;
GLOBAL BitsT* slice_value_bits = (GLOBAL BitsT*)slice_values;

for (int row = GROUP_ID; row < num_rows; row += NUM_GROUPS) {
  for (int i = LOCAL_ID; i < row_size; i += GROUP_SIZE) {
    const unsigned bits = (unsigned)value_bits[(i64)row * row_size + i];
    const unsigned magnitude = bits & (ALL_BITS ^ SIGN);
    unsigned key = (bits & SIGN) != 0u ? (bits ^ ALL_BITS) : (bits | SIGN);
    key = magnitude == 0u ? SIGN : key;
    row_keys[i] = magnitude > INFINITY_BITS ? ALL_BITS : key;
  }
  BARRIER();
  for (int i = LOCAL_ID; i < row_size; i += GROUP_SIZE) {
    const unsigned key = row_keys[i];
    int rank = 0;
    for (int j = 0; j < row_size; ++j) {
      const unsigned other = row_keys[j];
      rank += (other < key || (other == key && j < i)) ? 1 : 0;
    }
    if (rank >= start && rank < start + count) {
      indices[(i64)row * count + rank - start] = (unsigned)i;
      if (NORMALIZE) {
        picked[rank - start] = LOAD_IN(values, (i64)row * row_size + i);
      } else {
        slice_value_bits[(i64)row * count + rank - start] = value_bits[(i64)row * row_size + i];
      }
    }
  }
  BARRIER();  // the next row's keys overwrite these (and picked is whole)
  if (NORMALIZE) {
    // Every thread sums alike; those of a position write it.
    float total = 0.0f;
    for (int p = 0; p < count; ++p) {
      total = ADD_RN(total, picked[p]);
    }
    const float sum = ROUND_OUT(total);
    for (int p = LOCAL_ID; p < count; p += GROUP_SIZE) {
      STORE_OUT(slice_values, (i64)row * count + p, picked[p] / sum);
    }
    BARRIER();  // the next row's picked overwrite these
  }
}
