// combine: out[n] = sum_m weights[n, m] * src[index[n, m]] for index >= 0,
// in float32 over ascending m, rounded once to OutT. Each output row is read
// from its FAN_IN source rows by one group: no atomics, so the order of the
// sum, and the bits, are fixed. Every product is rounded before it is added
// (MUL_RN / ADD_RN, separate statements), exactly as the reference does in
// NumPy float32; a skipped entry adds nothing, not even 0 * NaN.
//
// With 16-byte rows (VECTORS) a thread owns one 16-byte column of the row
// and reads it from each source row with one vector load (8 float16 or
// bfloat16, or 4 float32 values), unpacked from the raw bits: few, wide
// loads, all independent. Otherwise it reads element by element.
// Inputs: src InT [num_src, H]; index int32 [num_out, FAN_IN]; weights
//   float32 [num_out, FAN_IN] (or [1], unread, without HAS_WEIGHTS); params
//   int32, the fields of launch.py's CombineParams in order (read below).
// Outputs: out OutT [num_out, H].
// Template constants: InT, OutT, IN_KIND (0 float32, 1 float16, 2 bfloat16),
//   FAN_IN, HAS_WEIGHTS, VECTORS.
const int num_src = params[0];
const int hidden = params[1];
const int num_out = params[2];
const int row_vectors = params[3];
const bool vectors = VECTORS && IS_ALIGNED16(src);
const int per_vector = IN_KIND == 0 ? 4 : 8;

for (int n = GROUP_ID; n < num_out; n += NUM_GROUPS) {
  const i64 out_base = (i64)n * hidden;
  if (vectors) {
    GLOBAL const uint4* src_vectors = (GLOBAL const uint4*)src;
    for (int v = LOCAL_ID; v < row_vectors; v += GROUP_SIZE) {
      float acc[8];
      for (int j = 0; j < 8; ++j) {
        acc[j] = 0.0f;
      }
      for (int m = 0; m < FAN_IN; ++m) {
        const int from = index[n * FAN_IN + m];
        if (from < 0 || from >= num_src) { // never read outside src
          continue;
        }
        const float weight = HAS_WEIGHTS ? weights[n * FAN_IN + m] : 1.0f;
        const uint4 raw = src_vectors[(i64)from * row_vectors + v];
        const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
        float value[8];
        for (int w = 0; w < 4; ++w) { // little-endian: element 2w is the low half
          if (IN_KIND == 0) {
            value[w] = BITS_TO_FLOAT(words[w]);
          } else if (IN_KIND == 1) {
            value[2 * w] = HALF_BITS_TO_FLOAT(words[w] & 0xFFFFu);
            value[2 * w + 1] = HALF_BITS_TO_FLOAT(words[w] >> 16);
          } else {
            value[2 * w] = BITS_TO_FLOAT(words[w] << 16);
            value[2 * w + 1] = BITS_TO_FLOAT(words[w] & 0xFFFF0000u);
          }
        }
        for (int j = 0; j < per_vector; ++j) {
          const float product = MUL_RN(weight, value[j]);
          acc[j] = ADD_RN(acc[j], product);
        }
      }
      for (int j = 0; j < per_vector; ++j) {
        STORE_OUT(out, out_base + (i64)v * per_vector + j, acc[j]);
      }
    }
  } else {
    for (int h = LOCAL_ID; h < hidden; h += GROUP_SIZE) {
      float acc = 0.0f;
      for (int m = 0; m < FAN_IN; ++m) {
        const int from = index[n * FAN_IN + m];
        if (from < 0 || from >= num_src) {
          continue;
        }
        const float weight = HAS_WEIGHTS ? weights[n * FAN_IN + m] : 1.0f;
        const float product = MUL_RN(weight, LOAD_IN(src, (i64)from * hidden + h));
        acc = ADD_RN(acc, product);
      }
      STORE_OUT(out, out_base + h, acc);
    }
  }
}
