// qmm_store: a text the bodies include, not a body. grouped_qmm.h and
// grouped_qmm_tiles.h store a warp's sums the same way, and say
// `// include: qmm_store` where kernels.compact puts this text.
// It reads `sums` in the multiply-add's accumulator layout (sums[(t *
// ROW_TILES + n) * 4 + e]: tile t's column fragment_row + 8 * (e / 2), row
// n * 8 + 2 * fragment_slot + e % 2 of the warp's), `warp_row0` and
// `warp_column0` (the warp's first row and column), `expert` and `last`
// (the rows' expert and the end of its rows) and `input_split` (the input
// split whose sums these are: grouped_qmm_tiles.h's; 0 for a whole row),
// and stores the sums of rows before `last` and columns before out_dims,
// in out[input_split]. With OUT_BIAS, each projection's bias of the column
// (bias, and up_bias when GATED: [E, out_dims] in the rows' dtype) is added
// to its sums first, in split 0 only. When GATED, the
// second half of sums is up's, and it stores silu(gate) * up (mlx-lm's
// SwiGLU) or, with CLAMPED, gpt-oss's (clip(up, -limit, limit) + 1) * g *
// sigmoid(alpha * g) of g = min(gate, limit), the two floats' bits
// ALPHA_BITS and LIMIT_BITS; rounded once.
UNROLL
for (int i = 0; i < COLUMN_TILES * ROW_TILES * 4; ++i) {
  const int column = warp_column0 + 16 * (i / (4 * ROW_TILES)) + fragment_row + 8 * (i % 4 / 2);
  const int row = warp_row0 + 8 * (i / 4 % ROW_TILES) + 2 * fragment_slot + i % 2;
  if (column < out_dims && row < last) {
    const i64 bias_at = (i64)expert * out_dims + column;
    const bool adds_bias = OUT_BIAS && input_split == 0;
    float value = sums[i] + (adds_bias ? LOAD_IN(bias, bias_at) : 0.0f);
    if (GATED) {
      const float up_value = sums[i + COLUMN_TILES * ROW_TILES * 4]
                             + (adds_bias ? LOAD_IN(up_bias, bias_at) : 0.0f);
      if (CLAMPED) {
        const float limit = BITS_TO_FLOAT(LIMIT_BITS);
        const float gate = min(value, limit);
        value = (min(max(up_value, -limit), limit) + 1.0f) * gate
                / (1.0f + exp(-BITS_TO_FLOAT(ALPHA_BITS) * gate));
      } else {
        value = value / (1.0f + exp(-value)) * up_value;
      }
    }
    STORE_OUT(out, ((i64)input_split * capacity + row) * out_dims + column, value);
  }
}
