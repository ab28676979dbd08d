// head_norm_rope: the queries and keys of a Qwen3 attention, as its forward
// makes them from its projections' outputs: each head RMS-normalized with
// its own weight (q_norm's for the queries, k_norm's for the keys), then
// rotated at its row's position (non-traditional RoPE over the whole head),
// and written where the attention reads them, [batch, heads, length,
// head_dim]. mlx-lm makes them with mx.fast.rms_norm and mx.fast.rope, a
// launch each for the queries and the keys, and a copy before each norm where
// the projections' outputs are parts of one GEMM's (projections.Siblings):
// four to six launches a layer, one here.
// A group makes one head of one row. Its thread i < half_dim owns the pair
// (i, i + half_dim) that the rotation mixes; the pair's two squares, summed, go
// to group memory, and every thread adds the head's half_dim sums alike in
// ascending order (fixed order, fixed bits; MLX's rms_norm sums as a tree,
// so the two normalizers may differ in their last bit).
// Rounding as MLX's CUDA kernels round (rms_norm.cu, rope.cu): each value
// times the normalizer, rounded to the rows' type, times the weight, rounded
// again; then the rotation in float32, rounded once. A row's position is
// offsets[b * offset_stride] + l (b its sequence, l its place in it), times
// scale; the angle of pair i is position * 2^(-(i / half_dim) * log2_base).
// Inputs: queries_in InT [rows, q_row] (row b * length + l; its query heads
//   one after another from column q_at), keys_in InT [rows, k_row] (its key
//   heads from column k_at; the same array as queries_in where one GEMM made
//   both), q_weight InT [HEAD_DIM], k_weight InT [HEAD_DIM], offsets int32
//   [batch] or [1] (offset_stride 1 or 0), params int32, the fields of
//   launch.py's HeadNormRopeParams in order (read below; the floats as their
//   bits).
// Outputs: queries OutT [batch, q_heads, length, HEAD_DIM], keys OutT [batch,
//   k_heads, length, HEAD_DIM].
// Template constants: InT, OutT (InT), HEAD_DIM (even).
const int rows = params[0];
const int length = params[1];
const int q_heads = params[2];
const int k_heads = params[3];
const int q_row = params[4];
const int q_at = params[5];
const int k_row = params[6];
const int k_at = params[7];
const int offset_stride = params[8];
const int eps_bits = params[9];
const int log2_base_bits = params[10];
const int scale_bits = params[11];

const float eps = BITS_TO_FLOAT(eps_bits);
const float log2_base = BITS_TO_FLOAT(log2_base_bits);
const float scale = BITS_TO_FLOAT(scale_bits);
const int half_dim = HEAD_DIM / 2;
SHARED float pair_squares[HEAD_DIM / 2];
const int heads = q_heads + k_heads;
const int pair = LOCAL_ID;
// The pair's angle factor, the same for every head and row.
const float inv_freq = exp2(-((float)pair / (float)half_dim) * log2_base);

for (int item = GROUP_ID; item < rows * heads; item += NUM_GROUPS) {
  const int row = item / heads;
  const int head = item - row * heads;
  const bool query = head < q_heads;
  const int h = query ? head : head - q_heads;
  const i64 at = query ? (i64)row * q_row + q_at + (i64)h * HEAD_DIM
                       : (i64)row * k_row + k_at + (i64)h * HEAD_DIM;
  float x1 = 0.0f;
  float x2 = 0.0f;
  if (pair < half_dim) {
    x1 = query ? LOAD_IN(queries_in, at + pair) : LOAD_IN(keys_in, at + pair);
    x2 = query ? LOAD_IN(queries_in, at + pair + half_dim) : LOAD_IN(keys_in, at + pair + half_dim);
    pair_squares[pair] = ADD_RN(MUL_RN(x1, x1), MUL_RN(x2, x2));
  }
  BARRIER();
  float sum = 0.0f;
  for (int j = 0; j < half_dim; ++j) {
    sum = ADD_RN(sum, pair_squares[j]);
  }
  BARRIER();  // the next item's squares overwrite these
  if (pair < half_dim) {
    const float normalizer = rsqrt(ADD_RN(sum / (float)HEAD_DIM, eps));
    const float w1 = query ? LOAD_IN(q_weight, pair) : LOAD_IN(k_weight, pair);
    const float w2 = query ? LOAD_IN(q_weight, pair + half_dim) : LOAD_IN(k_weight, pair + half_dim);
    const float n1 = ROUND_OUT(MUL_RN(w1, ROUND_OUT(MUL_RN(x1, normalizer))));
    const float n2 = ROUND_OUT(MUL_RN(w2, ROUND_OUT(MUL_RN(x2, normalizer))));
    const int b = row / length;
    const int l = row - b * length;
    const float position = MUL_RN(scale, (float)(offsets[b * offset_stride] + l));
    const float theta = MUL_RN(position, inv_freq);
    const float cos_theta = cos(theta);
    const float sin_theta = sin(theta);
    const float r1 = ADD_RN(MUL_RN(n1, cos_theta), -MUL_RN(n2, sin_theta));
    const float r2 = ADD_RN(MUL_RN(n1, sin_theta), MUL_RN(n2, cos_theta));
    const i64 out_at = (((i64)b * (query ? q_heads : k_heads) + h) * length + l) * HEAD_DIM;
    if (query) {
      STORE_OUT(queries, out_at + pair, r1);
      STORE_OUT(queries, out_at + pair + half_dim, r2);
    } else {
      STORE_OUT(keys, out_at + pair, r1);
      STORE_OUT(keys, out_at + pair + half_dim, r2);
    }
  }
}
