// qmm_fields: a text the bodies include, not a body. grouped_qmm.h and
// grouped_qmm_tiles.h (through tiles_products.h) make a packed word's fields
// into a warp multiply-add's 16-bit inputs the same way, and say
// `// include: qmm_fields` where kernels.compact puts this text.
// It reads `fields`, a uint32 holding two fields of BITS bits (as MLX's affine
// quantization packs them) at the low bits of its two 16-bit halves, the
// rest of each half anything (which two fields, and how they got there, is
// the body's choice), and declares `field_pair`: the two as a pair of 16-bit
// floats in the rows' format, exact: the pair MAGIC + q minus MAGIC (1024 + q
// in float16 for q < 256, 128 + q in bfloat16 for q < 16). 8-bit fields in
// bfloat16 go as two 4-bit halves: 256 + 16 * high is exact in bfloat16 (step
// 2 above 256), so is the sum q.
const unsigned MAGIC = IN_KIND == 1 ? 0x64006400u : 0x43004300u;
const bool SPLIT_BYTES = BITS == 8 ? IN_KIND == 2 : false;
const unsigned FIELD_MASK = SPLIT_BYTES ? 0x000F000Fu : (BITS == 4 ? 0x000F000Fu : 0x00FF00FFu);
const unsigned low_bits = AND_OR(fields, FIELD_MASK, MAGIC);
unsigned field_pair = PAIR_SUB(low_bits, MAGIC);
if (SPLIT_BYTES) {
  const unsigned high_bits = (((fields >> 4) & 0x000F000Fu) << 3) | 0x43804380u;
  const unsigned sixteen_high = PAIR_SUB(high_bits, 0x43804380u);
  field_pair = PAIR_SUB(field_pair, sixteen_high ^ 0x80008000u);
}
