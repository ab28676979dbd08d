// gather: out[r] = src[index[r]], zeros where index[r] < 0 (padding rows, and
// skipped entries when unsort gathers by positions). A group copies ROWS rows
// at a time, each thread loading its part of all ROWS rows before storing
// any, so that several loads are in flight per thread. A same-dtype gather
// moves raw 16-byte vectors when rows are 16-byte multiples and aligned;
// anything else converts element by element through float32, rounding to
// nearest even.
// Inputs: src InT [num_src, H]; index int32 [num_rows]; params int32
//   {num_src, H, num_rows, row_vectors} (row_vectors: 16-byte units in a row).
// Outputs: out OutT [num_rows, H].
// Template constants: InT, OutT, COPY_VECTORS (same dtype, 16-byte rows), ROWS.
const int num_src = params[0];
const int hidden = params[1];
const int num_rows = params[2];
const int row_vectors = params[3];
const bool vectors = COPY_VECTORS && IS_ALIGNED16(src) && IS_ALIGNED16(out);

for (int row0 = GROUP_ID * ROWS; row0 < num_rows; row0 += NUM_GROUPS * ROWS) {
  i64 src_row[ROWS];
  bool present[ROWS];
  for (int k = 0; k < ROWS; ++k) {
    const int from = row0 + k < num_rows ? index[row0 + k] : -1;
    present[k] = from >= 0 && from < num_src; // never read outside src
    src_row[k] = present[k] ? from : 0;
  }
  if (vectors) {
    GLOBAL const uint4* src_vectors = (GLOBAL const uint4*)src;
    GLOBAL uint4* out_vectors = (GLOBAL uint4*)out;
    for (int v = LOCAL_ID; v < row_vectors; v += GROUP_SIZE) {
      uint4 value[ROWS];
      for (int k = 0; k < ROWS; ++k) {
        value[k] = present[k] ? src_vectors[src_row[k] * row_vectors + v] : ZERO_VEC16;
      }
      for (int k = 0; k < ROWS; ++k) {
        if (row0 + k < num_rows) {
          out_vectors[(i64)(row0 + k) * row_vectors + v] = value[k];
        }
      }
    }
  } else {
    for (int h = LOCAL_ID; h < hidden; h += GROUP_SIZE) {
      float value[ROWS];
      for (int k = 0; k < ROWS; ++k) {
        value[k] = present[k] ? LOAD_IN(src, src_row[k] * hidden + h) : 0.0f;
      }
      for (int k = 0; k < ROWS; ++k) {
        if (row0 + k < num_rows) {
          STORE_OUT(out, (i64)(row0 + k) * hidden + h, value[k]);
        }
      }
    }
  }
}
