// grouped_qmm: the expert GEMM over a plan's sorted rows, with affine-quantized
// weights: out[row] = rows[row] @ dequantize(weight[e]).T for every row of
// expert e's span [expert_offsets[e], expert_offsets[e + 1]), zeros on the tail
// rows [expert_offsets[E], capacity). The row counts are read here, on the
// device, and no host ever learns how many rows there are (decoding builds its
// graph before the router has run; an expert-parallel rank computes its own
// rows only, without a sync).
// The work is (expert with rows, block of columns) items, dealt out to a fixed
// number of groups: every group first lists the experts that have rows, in
// expert order (the same list in every group), and takes items GROUP_ID,
// GROUP_ID + NUM_GROUPS, ... of that list's items, then of the tail's. A grid
// of an item a group would be mostly groups of empty experts when decoding,
// and a GPU starts groups at a limited rate (on the H200, 12,384 groups of
// which 768 had rows took about 45 us).
// Meant for few rows an expert (decoding), and meant to be bound by reading
// the weights: an item reads its expert's words once for ROWS rows at a time,
// so the weights come from memory once while the expert has at most ROWS rows
// (again, mostly from cache, for each further ROWS). A team of LANES threads
// computes COLUMNS output columns. Each lane reads WORDS consecutive words of
// each column's packed row, the team LANES * WORDS words of it (coalesced: the
// first load of a step brings the lines the others read, so a lane has WORDS *
// COLUMNS * 4 bytes in flight). It loads a word's values of each row once for
// all its columns (one 16-byte load for a 4-bit word's eight 16-bit values)
// and applies the word's scale and bias to the dot product of its fields and a
// row's values rather than to every field. Each thread keeps a partial sum per
// column and row; the team adds its lanes' partials in lane order through
// shared memory, so every run gives the same bits. Weights dequantize as scale
// * q + bias, q the BITS-bit fields of a uint32 word from its low bits up, as
// MLX's affine quantization packs them; the sums are a GEMM's, within float32
// rounding of the exact ones, not the bits of any other implementation.
// Inputs: rows InT [capacity, in_dims]; weight uint32 [E, out_dims,
//   in_dims / VALUES]; scales, biases InT [E, out_dims, in_dims /
//   QUANT_GROUP]; expert_offsets int32 [E + 1]; params int32, the fields of
//   launch.py's GroupedQmmParams in order (read below; column_blocks: blocks
//   of THREADS / LANES * COLUMNS columns that cover out_dims).
// Outputs: out OutT [capacity, out_dims].
// Template constants: InT, OutT, IN_KIND (0 float32, 1 float16, 2 bfloat16),
//   BITS (4 or 8), VALUES (32 / BITS, values a word packs), QUANT_GROUP
//   (values sharing a scale and bias, a multiple of VALUES), VECTOR_ROWS (a
//   word's values of a row are 16 bytes: 4 bits, 16-bit InT), THREADS (the
//   group size), MAX_EXPERTS (a multiple of THREADS, at least E), LANES
//   (threads a team, at least COLUMNS * ROWS), COLUMNS (columns a team),
//   ROWS (rows a pass), WORDS (consecutive words of each column a lane loads
//   before using any).
const int num_experts = params[0];
const int in_dims = params[1];
const int out_dims = params[2];
const int capacity = params[3];
const int column_blocks = params[4];

const int row_words = in_dims / VALUES;
const int row_groups = in_dims / QUANT_GROUP;
const unsigned mask = (1u << BITS) - 1u;
const int lane = LOCAL_ID % LANES;
const int team = LOCAL_ID / LANES;
const bool vectors = VECTOR_ROWS && IS_ALIGNED16(rows);
SHARED int active_experts[MAX_EXPERTS];
SHARED int active_scan[THREADS];
// Each thread's partial sums, one row of THREADS + 1 per (column, row) of the
// pass: the extra element puts the sums a team's adders read at once in
// different banks.
SHARED float partial[COLUMNS * ROWS * (THREADS + 1)];

// The experts with rows, in order: thread t looks at experts
// [t * MAX_EXPERTS / THREADS, (t + 1) * MAX_EXPERTS / THREADS), a scan of the
// counts places them. Offsets out of [0, capacity] would come from a broken
// plan; clamped here and below, no row outside out is ever touched.
int own_active = 0;
for (int k = 0; k < MAX_EXPERTS / THREADS; ++k) {
  const int expert = LOCAL_ID * (MAX_EXPERTS / THREADS) + k;
  if (expert < num_experts) {
    const int first = min(max(expert_offsets[expert], 0), capacity);
    own_active += min(max(expert_offsets[expert + 1], first), capacity) > first ? 1 : 0;
  }
}
active_scan[LOCAL_ID] = own_active;
BARRIER();
for (int step = 1; step < THREADS; step *= 2) {  // inclusive scan, Hillis-Steele
  const int before = LOCAL_ID >= step ? active_scan[LOCAL_ID - step] : 0;
  BARRIER();
  active_scan[LOCAL_ID] += before;
  BARRIER();
}
int slot = active_scan[LOCAL_ID] - own_active;
for (int k = 0; k < MAX_EXPERTS / THREADS; ++k) {
  const int expert = LOCAL_ID * (MAX_EXPERTS / THREADS) + k;
  if (expert < num_experts) {
    const int first = min(max(expert_offsets[expert], 0), capacity);
    if (min(max(expert_offsets[expert + 1], first), capacity) > first) {
      active_experts[slot] = expert;
      slot += 1;
    }
  }
}
const int num_active = active_scan[THREADS - 1];
BARRIER();

for (int item = GROUP_ID; item < (num_active + 1) * column_blocks; item += NUM_GROUPS) {
  const int expert = item / column_blocks < num_active ? active_experts[item / column_blocks]
                                                       : num_experts;
  const int column0 = ((item % column_blocks) * (THREADS / LANES) + team) * COLUMNS;
  const int first = min(max(expert_offsets[expert], 0), capacity);
  if (expert == num_experts) {  // the tail rows: zeros
    for (int c = 0; c < COLUMNS; ++c) {
      if (column0 + c < out_dims) {
        for (int row = first + lane; row < capacity; row += LANES) {
          STORE_OUT(out, (i64)row * out_dims + column0 + c, 0.0f);
        }
      }
    }
    continue;
  }
  const int last = min(max(expert_offsets[expert + 1], first), capacity);
  for (int row0 = first; row0 < last; row0 += ROWS) {
    const int count = min(ROWS, last - row0);
    float sums[COLUMNS * ROWS];
    for (int i = 0; i < COLUMNS * ROWS; ++i) {
      sums[i] = 0.0f;
    }
    for (int word0 = lane * WORDS; word0 < row_words; word0 += LANES * WORDS) {
      // Every load of the step's weight words first, then their use.
      unsigned packed[WORDS * COLUMNS];
      for (int k = 0; k < WORDS; ++k) {
        for (int c = 0; c < COLUMNS; ++c) {
          const int word = word0 + k;
          const bool inside = word < row_words && column0 + c < out_dims;
          const i64 column_row = (i64)expert * out_dims + column0 + c;
          packed[k * COLUMNS + c] = inside ? weight[column_row * row_words + word] : 0u;
        }
      }
      // Unrolled, so that packed[] is indexed by constants and stays in
      // registers (NVCC left this loop rolled, packed[] in local memory).
#pragma unroll
      for (int k = 0; k < WORDS; ++k) {
        const int word = word0 + k;
        // The word's values of each row of the pass (zeros past count).
        float x[ROWS * VALUES];
        for (int r = 0; r < ROWS; ++r) {
          const bool present = r < count && word < row_words;
          const i64 at = (i64)(row0 + r) * in_dims + (i64)word * VALUES;
          if (vectors) {
            GLOBAL const uint4* row_vectors = (GLOBAL const uint4*)rows;
            const uint4 raw = present ? row_vectors[at / 8] : ZERO_VEC16;
            const unsigned halves[4] = {raw.x, raw.y, raw.z, raw.w};
            for (int w = 0; w < 4; ++w) {  // little-endian: value 2w is the low half
              if (IN_KIND == 1) {
                x[r * VALUES + 2 * w] = HALF_BITS_TO_FLOAT(halves[w] & 0xFFFFu);
                x[r * VALUES + 2 * w + 1] = HALF_BITS_TO_FLOAT(halves[w] >> 16);
              } else {
                x[r * VALUES + 2 * w] = BITS_TO_FLOAT(halves[w] << 16);
                x[r * VALUES + 2 * w + 1] = BITS_TO_FLOAT(halves[w] & 0xFFFF0000u);
              }
            }
          } else {
            for (int v = 0; v < VALUES; ++v) {
              x[r * VALUES + v] = present ? LOAD_IN(rows, at + v) : 0.0f;
            }
          }
        }
        // sum_v (scale * q_v + bias) * x_v = scale * sum_v q_v * x_v + bias * sum_v x_v:
        // the scale and bias once a word and row, sum_v x_v once for all columns.
        float x_sums[ROWS];
        for (int r = 0; r < ROWS; ++r) {
          x_sums[r] = 0.0f;
          if (r < count) {  // read below only for these
            for (int v = 0; v < VALUES; ++v) {
              x_sums[r] += x[r * VALUES + v];
            }
          }
        }
        const int quant_group = word * VALUES / QUANT_GROUP;
        for (int c = 0; c < COLUMNS; ++c) {
          const bool inside = word < row_words && column0 + c < out_dims;
          const i64 at = ((i64)expert * out_dims + column0 + c) * row_groups + quant_group;
          const float scale = inside ? LOAD_IN(scales, at) : 0.0f;
          const float bias = inside ? LOAD_IN(biases, at) : 0.0f;
          // The fields as floats without an integer conversion (a quarter of
          // the multiply-add rate on NVIDIA GPUs): a field q below 2^23 as the
          // low mantissa bits of 2^23 is the float 2^23 + q, exactly.
          float fields[VALUES];
          for (int v = 0; v < VALUES; ++v) {
            const unsigned field = (packed[k * COLUMNS + c] >> (v * BITS)) & mask;
            fields[v] = BITS_TO_FLOAT(0x4B000000u | field) - 8388608.0f;
          }
          for (int r = 0; r < ROWS; ++r) {
            if (r < count) {  // the same for the whole team: no divergence
              float dot = 0.0f;
              for (int v = 0; v < VALUES; ++v) {
                dot += fields[v] * x[r * VALUES + v];
              }
              sums[c * ROWS + r] += scale * dot + bias * x_sums[r];
            }
          }
        }
      }
    }
    for (int i = 0; i < COLUMNS * ROWS; ++i) {
      partial[i * (THREADS + 1) + LOCAL_ID] = sums[i];
    }
    BARRIER();
    // Lane i of a team adds the team's partials of column i / ROWS, row
    // i % ROWS, in lane order.
    if (lane < COLUMNS * ROWS && column0 + lane / ROWS < out_dims && lane % ROWS < count) {
      float sum = 0.0f;
      for (int l = 0; l < LANES; ++l) {
        sum += partial[lane * (THREADS + 1) + team * LANES + l];
      }
      STORE_OUT(out, (i64)(row0 + lane % ROWS) * out_dims + column0 + lane / ROWS, sum);
    }
    BARRIER(); // before the next pass overwrites the partials
  }
}
