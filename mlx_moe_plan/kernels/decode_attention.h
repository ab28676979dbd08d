// decode_attention: the first of a decoding step's attention's two launches
// (decode_attention_merge.h is the second). Each sequence has one query a
// head; the G query heads that share a key-value head attend to the same
// keys, so one group takes them together and reads each key and value once,
// where MLX's CUDA vector kernel reads them once a query head. A group takes
// one sequence, key-value head and split of the keys (work item b, kv_head,
// split), and leaves for each of its G query heads the split's softmax in
// three parts: its largest score, the sum of its weights relative to that
// score, and the weighted sum of the values; the merge weighs the splits.
// Splitting the keys gives a step of few sequences enough groups to keep the
// memory busy.
// Products on the tensor cores (MMA_16x8x16, inputs of the rows' 16-bit
// format, float sums): a warp takes 16 keys at a time. The scores are the
// query heads (A's rows g and g + 8 of lane 4 g + t; rows past G zero) by
// the keys (B's columns); the weighted values are the same rows by 8 of the
// values' dimensions a tile. A product's order along its inner dimension is
// free as long as both operands take the same, so each lane loads 16 bytes of
// a row at once, where PTX's fragments would take 4 at a time, and its
// registers take them in that order: for the scores, lane 4 g + t holds
// dimensions 32 j + 8 t to + 7 of query row g (+ 8) and of key g (+ 8) of
// the step, halves for chunks 2 j and 2 j + 1; for the values, dimensions
// 64 h + 8 g to + 7 of keys 2 t, 2 t + 1, 2 t + 8, 2 t + 9, which make output
// tile 8 h + j's column g dimension 64 h + 8 g + j. The scores' sums come
// out as the weights' A fragment needs them (rows g, g + 8 at keys 2 t,
// 2 t + 1, then 2 t + 8, 2 t + 9), rounded to the 16-bit format (as
// FlashAttention rounds them) before they multiply the values.
// Online softmax in base 2: scores times scale * log2(e), each row's
// largest so far kept alike in its four lanes (WARP_XOR over t), the sums
// and values rescaled as it grows. Largest scores start at -1e30, not
// -infinity: a warp or split with no key then merges with weight 0, not NaN.
// The work items' loop and every loop inside run alike in the whole group
// (the emulated warp operations of OpenCL meet barriers): a warp past its
// split's last key reads that key again and weighs it 0.
// The keys and values are read where they lie (a slice of a cache's longer
// buffer): their shapes and strides come with them (MLX's `keys_shape`,
// `keys_strides`, ...), so one kernel serves every context. Rows whose values
// are contiguous and 16-byte aligned, as a cache's are, are loaded 16 bytes
// at a time. Any other view (an inner stride other than 1, an unaligned
// start) takes a plain path instead, a thread a head's dimension reading
// value by value, its weights unrounded: slow, but it never reads past a row
// (on CUDA; Metal cannot test a pointer's alignment, so the glue offers no
// launch there). A path of its own, not a second kind of load in the fast
// one, whose registers (168 a thread at D = 128 on sm_90a) it would raise to
// 237.
// With HAS_MASK a boolean mask takes keys out, as mlx-lm's batch cache's
// does (its sequences' left padding): mask[b, head, 0, key], its sequence and
// head dimensions of 1 or full (broadcast), false where the key is not
// attended. A head none of whose keys is attended (and no sink) gets 0 / 0.
// Inputs: queries InT [batch, heads, 1, D], keys InT [batch, kv_heads, keys,
//   D], values InT (the keys' shape), each with its strides; mask bool
//   [batch or 1, heads or 1, 1, keys] with its shape and strides (not read
//   without HAS_MASK); params int32, the fields of launch.py's
//   DecodeAttentionParams in order (read below).
// Outputs: part_out float [batch * heads * splits, D], part_max float
//   [batch * heads * splits], part_sum float (row (b * heads + head) * splits
//   + split).
// Template constants: InT, IN_KIND (1 float16, 2 bfloat16), D (64 or 128),
//   G (query heads a key-value head; G * D <= 1024, G <= 16), WARPS, HAS_MASK.
const int batch = params[0];
const int heads = params[1];
const int kv_heads = params[2];
const int splits = params[3];
const int scale_bits = params[4];

const float scale_log2 = BITS_TO_FLOAT(scale_bits) * 1.4426950408889634f;
const int keys_count = keys_shape[2];
const int warp = LOCAL_ID / 32, lane = LOCAL_ID % 32;
const int g = lane / 4, t = lane % 4;
const int STEP = WARPS * 16;  // keys a group's step
SHARED unsigned mma_exchange[WARPS * 32 * 6];  // the emulated warp operations' (OpenCL)
SHARED_SPACE unsigned* exchange = mma_exchange + warp * 32 * 6;
SHARED float warp_max[WARPS * 16];
SHARED float warp_sum[WARPS * 16];
SHARED float warp_out[WARPS * G * D];
const i64 q_inner = queries_strides[3], k_inner = keys_strides[3], v_inner = values_strides[3];
const bool rows16 = q_inner == 1 && k_inner == 1 && v_inner == 1
    && IS_ALIGNED16(queries) && IS_ALIGNED16(keys) && IS_ALIGNED16(values)
    && queries_strides[0] % 8 == 0 && queries_strides[1] % 8 == 0
    && keys_strides[0] % 8 == 0 && keys_strides[1] % 8 == 0 && keys_strides[2] % 8 == 0
    && values_strides[0] % 8 == 0 && values_strides[1] % 8 == 0 && values_strides[2] % 8 == 0;
// The mask's strides, 0 along a dimension it broadcasts.
const i64 mask_batch_stride = HAS_MASK ? (mask_shape[0] > 1 ? mask_strides[0] : 0) : 0;
const i64 mask_head_stride = HAS_MASK ? (mask_shape[1] > 1 ? mask_strides[1] : 0) : 0;
const i64 mask_key_stride = HAS_MASK ? mask_strides[3] : 0;
const int steps = (keys_count + STEP - 1) / STEP;
const int split_keys = (steps + splits - 1) / splits * STEP;
const int items = batch * kv_heads * splits;
for (int item = GROUP_ID; item < items; item += NUM_GROUPS) {
  const int split = item % splits;
  const int kv_head = item / splits % kv_heads;
  const int b = item / (splits * kv_heads);
  const int start = min(split * split_keys, keys_count);
  const int stop = min(start + split_keys, keys_count);
  const i64 mask_at = b * mask_batch_stride + kv_head * G * mask_head_stride;
  if (!rows16) {
    for (int i = LOCAL_ID; i < G * D; i += WARPS * 32) {
      const int head = i / D, d = i % D;
      const i64 query_at = b * queries_strides[0] + (kv_head * G + head) * queries_strides[1];
      const i64 keys_at = b * keys_strides[0] + kv_head * keys_strides[1];
      const i64 values_at = b * values_strides[0] + kv_head * values_strides[1];
      float top = -1e30f, sum = 0.0f, total = 0.0f;
      for (int key = start; key < stop; ++key) {
        if (HAS_MASK) {
          if (!mask[mask_at + head * mask_head_stride + key * mask_key_stride]) continue;
        }
        float dot = 0.0f;
        for (int e = 0; e < D; ++e)
          dot += LOAD_IN(queries, query_at + e * q_inner)
                 * LOAD_IN(keys, keys_at + key * keys_strides[2] + e * k_inner);
        const float score = dot * scale_log2;
        const float grown = max(top, score);
        const float rescale = exp2(top - grown), weight = exp2(score - grown);
        top = grown;
        sum = sum * rescale + weight;
        total = total * rescale
                + weight * LOAD_IN(values, values_at + key * values_strides[2] + d * v_inner);
      }
      const i64 part = ((i64)(b * heads + kv_head * G + head)) * splits + split;
      part_out[part * D + d] = total;
      if (d == 0) {
        part_max[part] = top;
        part_sum[part] = sum;
      }
    }
    continue;
  }
  GLOBAL const unsigned short* key_rows =
      (GLOBAL const unsigned short*)keys + b * keys_strides[0] + kv_head * keys_strides[1];
  GLOBAL const unsigned short* value_rows =
      (GLOBAL const unsigned short*)values + b * values_strides[0] + kv_head * values_strides[1];
  // The queries' A fragments: chunk 2 j the first half of the lane's 8 values
  // at 32 j + 8 t of rows g and g + 8, chunk 2 j + 1 the second.
  unsigned query[D / 16][4];
  UNROLL
  for (int j = 0; j < D / 32; ++j) {
    unsigned row_words[2][4];
    UNROLL
    for (int r = 0; r < 2; ++r) {
      const int head = g + 8 * r;
      const uint4 words = *(GLOBAL const uint4*)((GLOBAL const unsigned short*)queries
          + b * queries_strides[0] + (kv_head * G + min(head, G - 1)) * queries_strides[1]
          + 32 * j + 8 * t);
      const bool real = head < G;
      row_words[r][0] = real ? words.x : 0u;
      row_words[r][1] = real ? words.y : 0u;
      row_words[r][2] = real ? words.z : 0u;
      row_words[r][3] = real ? words.w : 0u;
    }
    query[2 * j][0] = row_words[0][0];
    query[2 * j][1] = row_words[1][0];
    query[2 * j][2] = row_words[0][1];
    query[2 * j][3] = row_words[1][1];
    query[2 * j + 1][0] = row_words[0][2];
    query[2 * j + 1][1] = row_words[1][2];
    query[2 * j + 1][2] = row_words[0][3];
    query[2 * j + 1][3] = row_words[1][3];
  }
  float out[D / 8][4];
  UNROLL
  for (int i = 0; i < D / 8; ++i) out[i][0] = out[i][1] = out[i][2] = out[i][3] = 0.0f;
  float row_max[2] = {-1e30f, -1e30f}, row_sum[2] = {0.0f, 0.0f};
  for (int first = start; first < stop; first += STEP) {
    const int warp_first = first + warp * 16;
    // Keys g and g + 8 of the warp's 16 for the scores; keys 2 t, 2 t + 1,
    // 2 t + 8, 2 t + 9 for the values. Loaded before any product needs them.
    unsigned key_words[2][D / 32][4], value_words[4][D / 64][4];
    UNROLL
    for (int u = 0; u < 2; ++u) {
      GLOBAL const unsigned short* row =
          key_rows + (i64)min(warp_first + 8 * u + g, stop - 1) * keys_strides[2];
      UNROLL
      for (int j = 0; j < D / 32; ++j) {
        const uint4 words = *(GLOBAL const uint4*)(row + 32 * j + 8 * t);
        key_words[u][j][0] = words.x;
        key_words[u][j][1] = words.y;
        key_words[u][j][2] = words.z;
        key_words[u][j][3] = words.w;
      }
    }
    UNROLL
    for (int r = 0; r < 4; ++r) {
      GLOBAL const unsigned short* row = value_rows
          + (i64)min(warp_first + 2 * t + (r & 1) + 8 * (r >> 1), stop - 1) * values_strides[2];
      UNROLL
      for (int h = 0; h < D / 64; ++h) {
        const uint4 words = *(GLOBAL const uint4*)(row + 64 * h + 8 * g);
        value_words[r][h][0] = words.x;
        value_words[r][h][1] = words.y;
        value_words[r][h][2] = words.z;
        value_words[r][h][3] = words.w;
      }
    }
    // Scores of rows g, g + 8 at keys 2 t, 2 t + 1 of each 8 (u).
    float score[2][4];
    UNROLL
    for (int u = 0; u < 2; ++u) {
      score[u][0] = score[u][1] = score[u][2] = score[u][3] = 0.0f;
      UNROLL
      for (int j = 0; j < D / 32; ++j) {
        const unsigned low[2] = {key_words[u][j][0], key_words[u][j][1]};
        const unsigned high[2] = {key_words[u][j][2], key_words[u][j][3]};
        MMA_16x8x16(score[u], query[2 * j], low, exchange, lane);
        MMA_16x8x16(score[u], query[2 * j + 1], high, exchange, lane);
      }
      UNROLL
      for (int c = 0; c < 4; ++c) {
        const int key = warp_first + 8 * u + 2 * t + (c & 1);
        const int row = min(g + 8 * (c / 2), G - 1);
        bool valid = key < stop;
        if (HAS_MASK)
          valid = valid && mask[mask_at + row * mask_head_stride + key * mask_key_stride];
        score[u][c] = valid ? score[u][c] * scale_log2 : -INFINITY;
      }
    }
    float rescale[2];
    UNROLL
    for (int r = 0; r < 2; ++r) {
      float top = max(max(score[0][2 * r], score[0][2 * r + 1]),
                      max(score[1][2 * r], score[1][2 * r + 1]));
      top = max(top, WARP_XOR(top, 1, exchange, lane));
      top = max(top, WARP_XOR(top, 2, exchange, lane));
      top = max(top, row_max[r]);
      rescale[r] = exp2(row_max[r] - top);
      row_max[r] = top;
      row_sum[r] *= rescale[r];
    }
    unsigned weights[4];
    UNROLL
    for (int u = 0; u < 2; ++u) {
      float p[4];
      UNROLL
      for (int c = 0; c < 4; ++c) p[c] = exp2(score[u][c] - row_max[c / 2]);
      row_sum[0] += p[0] + p[1];
      row_sum[1] += p[2] + p[3];
      weights[2 * u] = PAIR_ROUND(p[0], p[1]);
      weights[2 * u + 1] = PAIR_ROUND(p[2], p[3]);
    }
    UNROLL
    for (int h = 0; h < D / 64; ++h) {
      UNROLL
      for (int j = 0; j < 8; ++j) {
        // Dimension 64 h + 8 g + j of keys 2 t and 2 t + 1 (then + 8, + 9).
        const unsigned low_keys = j % 2 ? HIGH_HALVES(value_words[0][h][j / 2],
                                                      value_words[1][h][j / 2])
                                         : LOW_HALVES(value_words[0][h][j / 2],
                                                      value_words[1][h][j / 2]);
        const unsigned high_keys = j % 2 ? HIGH_HALVES(value_words[2][h][j / 2],
                                                       value_words[3][h][j / 2])
                                          : LOW_HALVES(value_words[2][h][j / 2],
                                                       value_words[3][h][j / 2]);
        const unsigned column[2] = {low_keys, high_keys};
        out[8 * h + j][0] *= rescale[0];
        out[8 * h + j][1] *= rescale[0];
        out[8 * h + j][2] *= rescale[1];
        out[8 * h + j][3] *= rescale[1];
        MMA_16x8x16(out[8 * h + j], weights, column, exchange, lane);
      }
    }
  }
  // The warp's rows: their sums over the four lanes t, then to group memory.
  UNROLL
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += WARP_XOR(row_sum[r], 1, exchange, lane);
    row_sum[r] += WARP_XOR(row_sum[r], 2, exchange, lane);
    if (t == 0) {
      warp_max[warp * 16 + g + 8 * r] = row_max[r];
      warp_sum[warp * 16 + g + 8 * r] = row_sum[r];
    }
  }
  UNROLL
  for (int h = 0; h < D / 64; ++h) {
    UNROLL
    for (int j = 0; j < 8; ++j) {
      UNROLL
      for (int c = 0; c < 4; ++c) {
        const int head = g + 8 * (c / 2);
        if (head < G)
          warp_out[(warp * G + head) * D + 64 * h + 8 * (2 * t + c % 2) + j] = out[8 * h + j][c];
      }
    }
  }
  BARRIER();
  // The group's warps merged: one row a query head of the split.
  for (int i = LOCAL_ID; i < G * D; i += WARPS * 32) {
    const int head = i / D, d = i % D;
    float top = -1e30f;
    UNROLL
    for (int w = 0; w < WARPS; ++w) top = max(top, warp_max[w * 16 + head]);
    float sum = 0.0f, total = 0.0f;
    UNROLL
    for (int w = 0; w < WARPS; ++w) {
      const float f = exp2(warp_max[w * 16 + head] - top);
      sum += warp_sum[w * 16 + head] * f;
      total += warp_out[(w * G + head) * D + d] * f;
    }
    const i64 part = ((i64)(b * heads + kv_head * G + head)) * splits + split;
    part_out[part * D + d] = total;
    if (d == 0) {
      part_max[part] = top;
      part_sum[part] = sum;
    }
  }
  BARRIER();  // the next item's warps write group memory again
}
