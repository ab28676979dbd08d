// combine: out[n] = sum_m weights[n, m] * src[index[n, m]] for index >= 0,
// in float32 over ascending m, rounded once to OutT. Each output row is read
// from its FAN_IN source rows by one group: no atomics, so the order of the
// sum, and the bits, are fixed. Every product is rounded before it is added
// (MUL_RN / ADD_RN), exactly as the reference does in NumPy float32.
// The FAN_IN indices and weights are read once into registers, and each
// thread keeps FAN_IN * UNROLL loads in flight: the loads are predicated
// rather than skipped, so nothing serializes them behind a branch.
// Inputs: src InT [num_src, H]; index int32 [num_out, FAN_IN]; weights
//   float32 [num_out, FAN_IN] (or [1], unread, without HAS_WEIGHTS); params
//   int32 {num_src, H, num_out}.
// Outputs: out OutT [num_out, H].
// Template constants: InT, OutT, FAN_IN, HAS_WEIGHTS, UNROLL (elements per
//   thread per pass, strided by the group size so accesses stay coalesced).
const int num_src = params[0];
const int hidden = params[1];
const int num_out = params[2];

for (int n = GROUP_ID; n < num_out; n += NUM_GROUPS) {
  i64 src_base[FAN_IN];
  bool present[FAN_IN];
  float weight[FAN_IN];
  for (int m = 0; m < FAN_IN; ++m) {
    const int from = index[n * FAN_IN + m];
    present[m] = from >= 0 && from < num_src; // never read outside src
    src_base[m] = (i64)(present[m] ? from : 0) * hidden;
    weight[m] = HAS_WEIGHTS ? weights[n * FAN_IN + m] : 1.0f;
  }
  const i64 out_base = (i64)n * hidden;
  for (int h0 = LOCAL_ID; h0 < hidden; h0 += GROUP_SIZE * UNROLL) {
    float acc[UNROLL];
    for (int u = 0; u < UNROLL; ++u) {
      acc[u] = 0.0f;
    }
    for (int m = 0; m < FAN_IN; ++m) {
      for (int u = 0; u < UNROLL; ++u) {
        const int h = h0 + u * GROUP_SIZE;
        const float value = present[m] && h < hidden ? LOAD_IN(src, src_base[m] + h) : 0.0f;
        if (present[m]) { // a skipped entry adds nothing, not even 0 * NaN
          acc[u] = ADD_RN(acc[u], MUL_RN(weight[m], value));
        }
      }
    }
    for (int u = 0; u < UNROLL; ++u) {
      const int h = h0 + u * GROUP_SIZE;
      if (h < hidden) {
        STORE_OUT(out, out_base + h, acc[u]);
      }
    }
  }
}
