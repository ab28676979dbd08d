// gather: out[r] = src[index[r]], zeros where index[r] < 0 (padding rows, and
// skipped entries when unsort gathers by positions). A group copies ROWS rows
// at a time, each thread loading its part of all ROWS rows before storing
// any, so that several loads are in flight per thread.
// A same-dtype gather moves bits: raw 16-byte vectors when rows are 16-byte
// multiples and aligned, else raw elements (a trip through float32 would
// change NaN payloads). A dtype change converts each element through
// float32, rounding to nearest even.
// The body casts src to raw types, so src must be a `device` buffer on Metal:
// the host pads it to at least 8 elements, below which MLX passes `constant`.
// Inputs: src InT [num_src, H]; index int32 [num_rows]; params int32, the
//   fields of launch.py's GatherParams in order (read below; row_vectors:
//   16-byte units in a row).
// Outputs: out OutT [num_rows, H].
// Template constants: InT, OutT, SAME_DTYPE, BitsT (an unsigned integer type
//   of InT's width), VECTORS (SAME_DTYPE and 16-byte rows), ROWS.
const int num_src = params[0];
const int hidden = params[1];
const int num_rows = params[2];
const int row_vectors = params[3];
const bool vectors = VECTORS && IS_ALIGNED16(src) && IS_ALIGNED16(out);

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
        value[k] = present[k] ? src_vectors[src_row[k] * row_vectors + v]
                              : VEC16(0u, 0u, 0u, 0u);
      }
      for (int k = 0; k < ROWS; ++k) {
        if (row0 + k < num_rows) {
          out_vectors[(i64)(row0 + k) * row_vectors + v] = value[k];
        }
      }
    }
  } else if (SAME_DTYPE) {
    GLOBAL const BitsT* src_bits = (GLOBAL const BitsT*)src;
    GLOBAL BitsT* out_bits = (GLOBAL BitsT*)out;
    for (int h = LOCAL_ID; h < hidden; h += GROUP_SIZE) {
      BitsT value[ROWS];
      for (int k = 0; k < ROWS; ++k) {
        value[k] = present[k] ? src_bits[src_row[k] * hidden + h] : (BitsT)0;
      }
      for (int k = 0; k < ROWS; ++k) {
        if (row0 + k < num_rows) {
          out_bits[(i64)(row0 + k) * hidden + h] = value[k];
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
