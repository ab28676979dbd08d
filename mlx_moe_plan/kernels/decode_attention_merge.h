// decode_attention_merge: the second of a decoding step's attention's two
// launches. decode_attention.h left each query head's softmax over each
// split of its keys in three parts (its largest score in base 2, the sum of
// its weights relative to it, the weighted values); here one group a
// sequence's query head weighs its splits by 2^(max - largest) and divides
// the values' sum by the weights'. gpt-oss's sink (HAS_SINKS), a logit of no
// value, takes its part of the weights' sum. A thread a dimension; the
// splits added in order (fixed bits).
// Inputs: part_out float [batch * heads * splits, D], part_max float
//   [batch * heads * splits], part_sum float, sinks InT [heads] (not read
//   without HAS_SINKS), params int32, the fields of launch.py's
//   DecodeAttentionParams in order (read below).
// Outputs: out OutT [batch, heads, 1, D].
// Template constants: InT, OutT (InT), D, HAS_SINKS.
const int batch = params[0];
const int heads = params[1];
const int kv_heads = params[2];
const int splits = params[3];
const int scale_bits = params[4];

const int rows = batch * heads;
const int d = LOCAL_ID;
for (int row = GROUP_ID; row < rows; row += NUM_GROUPS) {
  const i64 first = (i64)row * splits;
  float top = -1e30f;
  for (int s = 0; s < splits; ++s) top = max(top, part_max[first + s]);
  float sink = -1e30f;
  if (HAS_SINKS) {
    sink = LOAD_IN(sinks, row % heads) * 1.4426950408889634f;
    top = max(top, sink);
  }
  float sum = HAS_SINKS ? exp2(sink - top) : 0.0f, total = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float f = exp2(part_max[first + s] - top);
    sum += part_sum[first + s] * f;
    total += part_out[(first + s) * D + d] * f;
  }
  STORE_OUT(out, (i64)row * D + d, total / sum);
}
