// qmm_store: a text the bodies include, not a body. grouped_qmm.h and
// grouped_qmm_tiles.h store a warp's sums the same way, and say
// `// include: qmm_store` where kernels.compact puts this text.
// It reads `sums` in the multiply-add's accumulator layout (sums[(t *
// ROW_TILES + n) * 4 + e]: tile t's column fragment_row + 8 * (e / 2), row
// n * 8 + 2 * fragment_slot + e % 2 of the warp's), `warp_row0` and
// `warp_column0` (the warp's first row and column) and `last` (the end of
// the expert's rows), and stores the sums of rows before `last` and columns
// before out_dims; when GATED, the second half of sums is up's, and it
// stores silu(gate) * up, rounded once.
UNROLL
for (int i = 0; i < COLUMN_TILES * ROW_TILES * 4; ++i) {
  const int column = warp_column0 + 16 * (i / (4 * ROW_TILES)) + fragment_row + 8 * (i % 4 / 2);
  const int row = warp_row0 + 8 * (i / 4 % ROW_TILES) + 2 * fragment_slot + i % 2;
  float value = sums[i];
  if (GATED) {
    value = value / (1.0f + exp(-value)) * sums[i + COLUMN_TILES * ROW_TILES * 4];
  }
  if (column < out_dims && row < last) {
    STORE_OUT(out, (i64)row * out_dims + column, value);
  }
}
