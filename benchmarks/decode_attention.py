"""A decoding step's attention: MLX's cuDNN path and vector kernel, and a sketch of our own.

    python -m benchmarks.decode_attention
    python -m benchmarks.decode_attention --models qwen3-30b-a3b --contexts 512 --batches 8

`mx.fast.scaled_dot_product_attention` on one query a sequence, the keys and
values a slice of a longer buffer as mlx-lm's `KVCache` hands them over. On
MLX's CUDA backend a decoding query goes to cuDNN where the buffer's length is
a multiple of 256 (mlx-lm's cache grows by 256), which MLX reads as the keys
being a slice of such a cache, and to MLX's own vector kernel (`sdpav`)
otherwise: the `cudnn` side slices a buffer of mlx-lm's length, the `vector`
side the same keys out of a buffer one longer. The model's attention shape
(query and key-value heads, head size, gpt-oss-20b's sinks) comes from
`workloads.MODELS`; the context is the tokens already in the cache, and the
step attends to one more. Each measurement is a graph of `--layers` calls,
each on its own buffers (`benchmarks.timing`), the sides alternated twice,
the median of the two; "diff" is the largest difference between the two
sides' outputs on the same keys. Elsewhere both sides run the same ops.
`--build` times the host's building of each call's graph instead (the same
graphs: MLX's call, or the kernels' with their glue), which a decoding step
pays before its GPU starts.

On CUDA two more sides are a sketch of the attention a decoding step could
have instead, CUDA text of its own here (not the package's kernel scheme):
one group of 4 warps a sequence, key-value head and split of the keys, the
query heads that share the key-value head together, so each key and value is
read once; then one group a query head merges the splits. `cores` multiplies
on the CUDA cores, `mma` on the tensor cores; "cores diff" and "mma diff" are
their largest differences from cuDNN's output on the same keys.
`sketch_in_models` puts either in mlx-lm's models for a decoding step's
attention, which `benchmarks.step_kernels --variants
"cores:attention=sketch;mma:attention=sketch-mma"` times in whole steps, its
launches' host work included.

And, where the backend has it, the package's own launch of that scheme
(kernels/decode_attention.h, `_backend.DecodeAttention`) through its glue:
`package` with its splits as the package makes them (by the keys' count,
up to enough for `launch.DECODE_ATTENTION_GROUPS` groups), and `package@N`
for each N of `--package-groups`, the splits capped for N groups instead:
where a model's heads let 3 groups run on each of 132 SMs, 528 groups are a
wave and a third, and fewer groups of more keys each may finish sooner. The
caps differ only where the keys fill more than N groups (a long context, or
many sequences): below, every side splits alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager, nullcontext
from functools import cache

import mlx.core as mx

from mlx_moe_plan import _backend

from .timing import time_calls
from .workloads import MODELS

CACHE_STEP = 256  # mlx-lm's KVCache.step

# Both forms of the first launch begin alike: a group's place in the grid
# (split, key-value head, sequence), its 4 warps, its split of the keys, and
# where its sequence's rows of that key-value head start. The keys' count and
# places come at run time (a slice of the cache's buffer, as mlx-lm hands it
# over, read where it lies): one kernel for every context. Every loop of a
# constant count in either is unrolled, so the arrays it indexes stay in
# registers: one nvcc leaves rolled puts them on the stack.
_SPLIT_BEGUN = """
constexpr int WARPS = 4;
const int split = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
const float scale_log2 = rsqrtf(float(D)) * 1.4426950408889634f;
const int keys_count = keys_shape[2], splits = gridDim.x;
const int chunk = (keys_count + splits - 1) / splits;
const int start = split * chunk;
const int stop = min(start + chunk, keys_count);
const __nv_bfloat16* key_rows = keys + batch * keys_strides[0] + kv_head * keys_strides[1];
const __nv_bfloat16* value_rows =
    values + batch * values_strides[0] + kv_head * values_strides[1];
"""

# Both forms of the first launch end alike: the group's warps, each with its
# rows' maximum, sum and unnormalized output in warp_m, warp_l and warp_o
# (shared memory), merged into one row a query head and split, unnormalized,
# with its maximum and sum.
_WARPS_MERGED = """
__syncthreads();
for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {
  const int h = i / D, d = i % D;
  float top = -1e30f;
  #pragma unroll
  for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_m[w][h]);
  float sum = 0.0f, total = 0.0f;
  #pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const float f = exp2f(warp_m[w][h] - top);
    sum += warp_l[w][h] * f;
    total += warp_o[w][h][d] * f;
  }
  const size_t row = (size_t(batch) * HEADS + kv_head * G + h) * splits + split;
  part_o[row * D + d] = total;
  if (d == 0) { part_m[row] = top; part_l[row] = sum; }
}
"""

# The sketch's first launch: grid (splits groups, key-value heads, batch), 4
# warps a group, each warp STEP keys at a time of the group's split. A key's row is
# read by D / 8 lanes, 16 bytes each, so a warp's load takes 32 / (D / 8) whole
# rows at once and each lane issues ROUNDS loads before it needs the first:
# one key at a time, a warp waited a memory round trip a key. A lane holds its
# 8 values of each of the G query heads that share the key-value head, so each
# key and value is read once. Online softmax in base 2, its maximum kept
# alike in every lane of a warp; each lane sums its own keys, and the lanes
# reading the same 8 values of different keys are summed at the end.
_SPLIT_SOURCE = _SPLIT_BEGUN + """
constexpr int LANES = D / 8;            // lanes a key's row, 8 values each
constexpr int PER_LOAD = 32 / LANES;    // keys a warp's load
constexpr int ROUNDS = 4;               // loads a lane issues before using one
constexpr int STEP = PER_LOAD * ROUNDS; // keys a warp's iteration
const int slot = lane / LANES, part = lane % LANES;
// The queries stay bfloat16 (as given), 4 registers a head, not 8: a lane
// holds G of them beside G rows of 8 sums.
__nv_bfloat162 q2[G][4];
float o[G][8], m[G], l[G];
#pragma unroll
for (int h = 0; h < G; ++h) {
  const uint4 word = *reinterpret_cast<const uint4*>(
      queries + batch * queries_strides[0] + (kv_head * G + h) * queries_strides[1]
      + part * 8);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&word);
  #pragma unroll
  for (int i = 0; i < 4; ++i) q2[h][i] = pairs[i];
  #pragma unroll
  for (int i = 0; i < 8; ++i) o[h][i] = 0.0f;
  // -1e30, not -infinity: a warp or split with no key merges as weight 0, not NaN.
  m[h] = -1e30f;
  l[h] = 0.0f;
}
for (int first = start + warp * STEP; first < stop; first += WARPS * STEP) {
  uint4 key_words[ROUNDS], value_words[ROUNDS];
  #pragma unroll
  for (int r = 0; r < ROUNDS; ++r) {
    // Past the split's last key a lane reads that key again and weighs it 0.
    const size_t key = min(first + r * PER_LOAD + slot, stop - 1);
    key_words[r] = *reinterpret_cast<const uint4*>(key_rows + key * keys_strides[2] + part * 8);
    value_words[r] =
        *reinterpret_cast<const uint4*>(value_rows + key * values_strides[2] + part * 8);
  }
  float score[ROUNDS][G];
  #pragma unroll
  for (int r = 0; r < ROUNDS; ++r) {
    const __nv_bfloat162* key_pairs = reinterpret_cast<const __nv_bfloat162*>(&key_words[r]);
    const bool valid = first + r * PER_LOAD + slot < stop;
    #pragma unroll
    for (int h = 0; h < G; ++h) {
      float dot = 0.0f;
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 k = __bfloat1622float2(key_pairs[i]), q = __bfloat1622float2(q2[h][i]);
        dot += q.x * k.x + q.y * k.y;
      }
      #pragma unroll
      for (int offset = LANES / 2; offset > 0; offset /= 2)
        dot += __shfl_xor_sync(0xffffffff, dot, offset);
      score[r][h] = valid ? dot * scale_log2 : -INFINITY;
    }
  }
  #pragma unroll
  for (int h = 0; h < G; ++h) {
    float top = score[0][h];
    #pragma unroll
    for (int r = 1; r < ROUNDS; ++r) top = fmaxf(top, score[r][h]);
    #pragma unroll
    for (int offset = LANES; offset < 32; offset *= 2)
      top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, offset));
    top = fmaxf(top, m[h]);
    const float rescale = exp2f(m[h] - top);
    l[h] *= rescale;
    #pragma unroll
    for (int i = 0; i < 8; ++i) o[h][i] *= rescale;
    m[h] = top;
  }
  #pragma unroll
  for (int r = 0; r < ROUNDS; ++r) {
    const __nv_bfloat162* value_pairs =
        reinterpret_cast<const __nv_bfloat162*>(&value_words[r]);
    float value[8];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __bfloat1622float2(value_pairs[i]);
      value[2 * i] = v.x;
      value[2 * i + 1] = v.y;
    }
    #pragma unroll
    for (int h = 0; h < G; ++h) {
      const float weight = exp2f(score[r][h] - m[h]);
      l[h] += weight;
      #pragma unroll
      for (int i = 0; i < 8; ++i) o[h][i] += weight * value[i];
    }
  }
}
__shared__ float warp_m[WARPS][G], warp_l[WARPS][G], warp_o[WARPS][G][D];
#pragma unroll
for (int h = 0; h < G; ++h) {
  #pragma unroll
  for (int offset = LANES; offset < 32; offset *= 2) {
    l[h] += __shfl_xor_sync(0xffffffff, l[h], offset);
    #pragma unroll
    for (int i = 0; i < 8; ++i) o[h][i] += __shfl_xor_sync(0xffffffff, o[h][i], offset);
  }
  if (lane == 0) { warp_m[warp][h] = m[h]; warp_l[warp][h] = l[h]; }
  if (slot == 0)
    #pragma unroll
    for (int i = 0; i < 8; ++i) warp_o[warp][h][part * 8 + i] = o[h][i];
}
""" + _WARPS_MERGED

# The first launch again on the tensor cores (`mma.sync` m16n8k16, bfloat16
# in, float32 sums), the same grid, groups and outputs: on the CUDA cores the
# products bound heads of 128 values at batch 64 (the keys' bytes took half
# the time). A warp takes 16 keys a step: the scores are the query heads
# (rows, up to 16) by the keys (columns), the output the heads by the values'
# dimensions. A product's order along its inner dimension is free as long as
# both operands share it: so every lane loads 16 bytes of a row (a key's 32
# dimensions for the scores, 8 of a value's for the output) where the
# fragments' own order would take 4, and its registers are laid out in that
# order. The scores' fragments are the output's multiplier's, as they come
# out (rows g and g + 8, columns 2t and 2t + 1 of lane 4g + t).
_MMA_HEADER = """
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4],
                                         unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned bf16_pair(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const unsigned*>(&pair);
}

// The j-th bfloat16 of `words`, beside the j-th of `other`: one register of
// two rows' values at the same column (low: `words`').
__device__ __forceinline__ unsigned column_pair(const uint4& words, const uint4& other, int j) {
  const unsigned w[4] = {words.x, words.y, words.z, words.w};
  const unsigned o[4] = {other.x, other.y, other.z, other.w};
  return __byte_perm(w[j / 2], o[j / 2], j % 2 ? 0x7632 : 0x5410);
}
"""

_MMA_SPLIT_SOURCE = _SPLIT_BEGUN + """
constexpr int CHUNKS = D / 16;  // the scores' products along a key's row
constexpr int TILES = D / 8;    // the output's column tiles
constexpr int HALVES = D / 64;  // a value row's 16-byte loads a lane
const int g = lane / 4, t = lane % 4;
// The queries' fragments: rows g and g + 8 (the heads past G zero), chunk 2j
// the first 4 of the lane's 8 values at 32 j + 8 t, chunk 2j + 1 the last 4.
unsigned query[CHUNKS][4];
#pragma unroll
for (int j = 0; j < D / 32; ++j) {
  const __nv_bfloat16* head_row =
      queries + batch * queries_strides[0] + kv_head * G * queries_strides[1] + 32 * j + 8 * t;
  uint4 low = make_uint4(0, 0, 0, 0), high = low;
  if (g < G)
    low = *reinterpret_cast<const uint4*>(head_row + g * queries_strides[1]);
  if (g + 8 < G)
    high = *reinterpret_cast<const uint4*>(head_row + (g + 8) * queries_strides[1]);
  query[2 * j][0] = low.x; query[2 * j][1] = high.x;
  query[2 * j][2] = low.y; query[2 * j][3] = high.y;
  query[2 * j + 1][0] = low.z; query[2 * j + 1][1] = high.z;
  query[2 * j + 1][2] = low.w; query[2 * j + 1][3] = high.w;
}
// The output's tile 8 h + j, column n: dimension 64 h + 8 n + j.
float out[TILES][4];
#pragma unroll
for (int i = 0; i < TILES; ++i) out[i][0] = out[i][1] = out[i][2] = out[i][3] = 0.0f;
// Rows g and g + 8's maximum and sum; -1e30, not -infinity, as above.
float m[2] = {-1e30f, -1e30f}, l[2] = {0.0f, 0.0f};
for (int first = start + warp * 16; first < stop; first += WARPS * 16) {
  // Past the split's last key a lane reads that key again and weighs it 0.
  uint4 key_words[2][D / 32], value_words[4][HALVES];
  #pragma unroll
  for (int u = 0; u < 2; ++u) {
    const long long key = min(first + 8 * u + g, stop - 1);
    #pragma unroll
    for (int j = 0; j < D / 32; ++j)
      key_words[u][j] = *reinterpret_cast<const uint4*>(
          key_rows + key * keys_strides[2] + 32 * j + 8 * t);
  }
  #pragma unroll
  for (int r = 0; r < 4; ++r) {  // keys 2t, 2t + 1, 2t + 8, 2t + 9 of the step
    const long long key = min(first + 2 * t + (r & 1) + 8 * (r >> 1), stop - 1);
    #pragma unroll
    for (int h = 0; h < HALVES; ++h)
      value_words[r][h] = *reinterpret_cast<const uint4*>(
          value_rows + key * values_strides[2] + 64 * h + 8 * g);
  }
  float score[2][4];
  #pragma unroll
  for (int u = 0; u < 2; ++u) {
    score[u][0] = score[u][1] = score[u][2] = score[u][3] = 0.0f;
    #pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      mma_bf16(score[u], query[2 * j], key_words[u][j].x, key_words[u][j].y);
      mma_bf16(score[u], query[2 * j + 1], key_words[u][j].z, key_words[u][j].w);
    }
    #pragma unroll
    for (int c = 0; c < 4; ++c) {
      const bool valid = first + 8 * u + 2 * t + (c & 1) < stop;
      score[u][c] = valid ? score[u][c] * scale_log2 : -INFINITY;
    }
  }
  float rescale[2];
  #pragma unroll
  for (int row = 0; row < 2; ++row) {
    float top = fmaxf(fmaxf(score[0][2 * row], score[0][2 * row + 1]),
                      fmaxf(score[1][2 * row], score[1][2 * row + 1]));
    top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, 1));
    top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, 2));
    top = fmaxf(top, m[row]);
    rescale[row] = exp2f(m[row] - top);
    m[row] = top;
    l[row] *= rescale[row];
  }
  unsigned weights[4];
  #pragma unroll
  for (int u = 0; u < 2; ++u) {
    float p[4];
    #pragma unroll
    for (int c = 0; c < 4; ++c) p[c] = exp2f(score[u][c] - m[c / 2]);
    l[0] += p[0] + p[1];
    l[1] += p[2] + p[3];
    weights[2 * u] = bf16_pair(p[0], p[1]);
    weights[2 * u + 1] = bf16_pair(p[2], p[3]);
  }
  // The multiplier's fragment: rows g, g + 8 at keys 2t, 2t + 1, then 2t + 8, 2t + 9.
  const unsigned multiplier[4] = {weights[0], weights[1], weights[2], weights[3]};
  #pragma unroll
  for (int h = 0; h < HALVES; ++h) {
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
      float (&tile)[4] = out[8 * h + j];
      tile[0] *= rescale[0]; tile[1] *= rescale[0];
      tile[2] *= rescale[1]; tile[3] *= rescale[1];
      mma_bf16(tile, multiplier, column_pair(value_words[0][h], value_words[1][h], j),
               column_pair(value_words[2][h], value_words[3][h], j));
    }
  }
}
__shared__ float warp_m[WARPS][16], warp_l[WARPS][16], warp_o[WARPS][16][D];
#pragma unroll
for (int row = 0; row < 2; ++row) {
  l[row] += __shfl_xor_sync(0xffffffff, l[row], 1);
  l[row] += __shfl_xor_sync(0xffffffff, l[row], 2);
  if (t == 0) { warp_m[warp][g + 8 * row] = m[row]; warp_l[warp][g + 8 * row] = l[row]; }
}
#pragma unroll
for (int h = 0; h < HALVES; ++h)
  #pragma unroll
  for (int j = 0; j < 8; ++j)
    #pragma unroll
    for (int c = 0; c < 4; ++c)
      warp_o[warp][g + 8 * (c / 2)][64 * h + 8 * (2 * t + c % 2) + j] = out[8 * h + j][c];
""" + _WARPS_MERGED

# The second: one group of D threads a sequence's query head, its splits
# merged (and gpt-oss's sink, a logit of no value, in the sum).
_MERGE_SOURCE = """
const size_t row = blockIdx.x;
const int d = threadIdx.x, splits = part_m_shape[0] / gridDim.x;
float top = -1e30f;
for (int s = 0; s < splits; ++s) top = fmaxf(top, part_m[row * splits + s]);
float sink = -1e30f;
if (HAS_SINKS) {
  sink = float(sinks[row % HEADS]) * 1.4426950408889634f;
  top = fmaxf(top, sink);
}
float sum = HAS_SINKS ? exp2f(sink - top) : 0.0f, out = 0.0f;
for (int s = 0; s < splits; ++s) {
  const float f = exp2f(part_m[row * splits + s] - top);
  sum += part_l[row * splits + s] * f;
  out += part_o[(row * splits + s) * D + d] * f;
}
output[row * D + d] = __float2bfloat16(out / sum);
"""

@cache
def _sketch_kernels() -> dict:
    """The sketch's launches as MLX kernels, made once: its first on the CUDA
    cores ("cores") or the tensor cores ("mma"), then the merge. The first
    reads its inputs where they lie (their strides): a copy of the cache's
    slice would read and write its keys and values once more."""
    inputs, outputs = ["queries", "keys", "values"], ["part_o", "part_m", "part_l"]
    return {"cores": mx.fast.cuda_kernel(name="decode_attention_split", input_names=inputs,
                                         output_names=outputs, source=_SPLIT_SOURCE,
                                         ensure_row_contiguous=False),
            "mma": mx.fast.cuda_kernel(name="decode_attention_split_mma", input_names=inputs,
                                       output_names=outputs, source=_MMA_SPLIT_SOURCE,
                                       header=_MMA_HEADER, ensure_row_contiguous=False),
            "merge": mx.fast.cuda_kernel(name="decode_attention_merge",
                                         input_names=["part_o", "part_m", "part_l", "sinks"],
                                         output_names=["output"], source=_MERGE_SOURCE)}


# The sketch's forms, and the most query heads a key-value head each takes:
# the CUDA cores' form holds 8 heads' sums a lane, the tensor cores' 16 rows.
SKETCH_FORMS = {"cores": 8, "mma": 16}


def sketch_splits(batch: int, kv_heads: int, keys_count: int, head_dim: int,
                  form: str = "cores") -> int:
    """Splits of the keys: groups enough for four an SM of an H100 or H200
    (132 SMs), so that enough loads are in flight to meet the memory's
    latency, each split at least one step of its 4 warps (on the CUDA cores
    STEP keys a warp: 32 / (head_dim / 8) a load, 4 loads; on the tensor
    cores 16)."""
    group_keys = 4 * 4 * 32 * 8 // head_dim if form == "cores" else 4 * 16
    return max(1, min(-(-528 // (batch * kv_heads)), -(-keys_count // group_keys)))


def sketch_attention(queries: mx.array, keys: mx.array, values: mx.array,
                     sinks: mx.array | None, form: str = "cores") -> mx.array:
    """The sketch's attention of `queries` (`[batch, heads, 1, head_dim]`) to
    `keys`, `values` (`[batch, kv_heads, keys, head_dim]`, a slice of a
    longer buffer or not), bfloat16, the scale head_dim ** -0.5, its first
    launch in `form` (one of SKETCH_FORMS): `[batch, heads, 1, head_dim]`, as
    `mx.fast.scaled_dot_product_attention` gives it."""
    batch, heads, _, head_dim = queries.shape
    _, kv_heads, keys_count, _ = keys.shape
    splits = sketch_splits(batch, kv_heads, keys_count, head_dim, form)
    rows = batch * heads * splits
    kernels = _sketch_kernels()
    part_o, part_m, part_l = kernels[form](
        inputs=[queries, keys, values],
        template=[("D", head_dim), ("G", heads // kv_heads), ("HEADS", heads)],
        grid=(splits * 128, kv_heads, batch), threadgroup=(128, 1, 1),
        output_shapes=[(rows, head_dim), (rows,), (rows,)],
        output_dtypes=[mx.float32] * 3)
    merged, = kernels["merge"](
        inputs=[part_o, part_m, part_l, part_m if sinks is None else sinks],
        template=[("D", head_dim), ("HEADS", heads), ("HAS_SINKS", sinks is not None)],
        grid=(batch * heads * head_dim, 1, 1), threadgroup=(head_dim, 1, 1),
        output_shapes=[(batch, heads, 1, head_dim)], output_dtypes=[mx.bfloat16])
    return merged


def sketch_takes(queries: mx.array, keys: mx.array, scale: float, mask,
                 form: str = "cores") -> bool:
    """Whether the sketch's `form` computes this attention: a decoding step's
    (one query a sequence, no mask), bfloat16, heads of 64 or 128 values, at
    most SKETCH_FORMS[form] query heads a key-value head, the scale of its
    text."""
    _, heads, queries_count, head_dim = queries.shape
    return (queries_count == 1 and mask is None and queries.dtype == mx.bfloat16
            and keys.dtype == mx.bfloat16 and head_dim in (64, 128)
            and heads % keys.shape[1] == 0 and heads // keys.shape[1] <= SKETCH_FORMS[form]
            and abs(scale * head_dim ** 0.5 - 1) < 1e-6)


# The package's launches in the sketch's place, each form with one more layer
# of their glue: the two bound calls alone (`_gpu._decode_attention_launched`),
# the step that carries their gradient where a transform traces them
# (`_gpu._decode_attention_step`: outside one, its question and the calls),
# and the backend's method with its checks.
# What a whole step loses to each layer shows apart from the fused attention's
# own forward, which the rule's side adds on top.
PACKAGE_FORMS = ("package-launched", "package-step", "package")


def package_attention(queries: mx.array, keys: mx.array, values: mx.array,
                      sinks: mx.array | None, scale: float, form: str) -> mx.array | None:
    """The package's decoding attention of one query a sequence, called as
    `form` (one of PACKAGE_FORMS) says; None where its launch cannot take it
    (the caller's own attention then runs)."""
    from mlx_moe_plan import _gpu

    batch, heads, queries_count, head_dim = queries.shape
    kv_heads = keys.shape[1]
    dtype = queries.dtype
    stream = _backend.resolve_stream(None)
    backend = _backend.implementation(stream)
    if (queries_count != 1 or not keys.dtype == values.dtype == dtype
            or (sinks is not None and sinks.dtype != dtype)
            or not backend.decode_attention_computes(head_dim=head_dim, heads=heads,
                                                     kv_heads=kv_heads, dtype=dtype)):
        return None
    if form == "package":
        return backend.decode_attention(queries, keys, values, sinks, scale=scale,
                                        stream=stream)
    make = _gpu._decode_attention_step if form == "package-step" else _launched_by_stream()
    call = make("cuda", batch, heads, kv_heads, head_dim, _gpu._name(dtype), sinks is not None,
                False, float(scale), _gpu.POISON, stream)
    return call(queries, keys, values) if sinks is None else call(queries, keys, values, sinks)


@cache
def _launched_by_stream():
    from mlx_moe_plan import _gpu

    return _gpu.cache_by_stream(_gpu._decode_attention_launched, maxsize=256)


@contextmanager
def sketch_in_models(form: str = "cores"):
    """mlx-lm's models attend through the sketch's `form` wherever it takes
    their attention (`sketch_takes`), or through the package's launches
    called as a form of PACKAGE_FORMS says, mlx-lm's own call elsewhere,
    inside the block: what a decoding step would gain, its host's part
    included. CUDA only; the models' modules call
    `scaled_dot_product_attention` by the name they imported, so each loaded
    one is patched, then restored. A patched model's fused attention would
    take its own launches before mlx-lm's call (`rules.decodes_attention`):
    its rule says no inside the block, so the form is what a step takes."""
    from mlx_lm.models import base

    from mlx_moe_plan import rules

    if _backend.gpu_backend() != "cuda":
        raise RuntimeError("the decoding attention sketch is CUDA text: it needs MLX's CUDA "
                           "backend")
    original = base.scaled_dot_product_attention
    rule = rules.DECODE_ATTENTION_FROM_ROWS, rules.DECODE_ATTENTION_MASKED_FROM_ROWS

    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        output = None
        if not hasattr(cache, "bits") and mask is None:
            if form in PACKAGE_FORMS:
                output = package_attention(queries, keys, values, sinks, scale, form)
            elif sketch_takes(queries, keys, scale, mask, form):
                output = sketch_attention(queries, keys, values, sinks, form)
        if output is None:
            return original(queries, keys, values, cache, scale, mask, sinks)
        return output

    modules = [module for name, module in list(sys.modules.items())
               if name.startswith("mlx_lm.models.")
               and getattr(module, "scaled_dot_product_attention", None) is original]
    for module in modules:
        module.scaled_dot_product_attention = attention
    rules.DECODE_ATTENTION_FROM_ROWS = rules.DECODE_ATTENTION_MASKED_FROM_ROWS = 1 << 30
    try:
        yield
    finally:
        for module in modules:
            module.scaled_dot_product_attention = original
        rules.DECODE_ATTENTION_FROM_ROWS, rules.DECODE_ATTENTION_MASKED_FROM_ROWS = rule


def attention_shape(model: str) -> tuple[int, int, int, bool]:
    """(query heads, key-value heads, head size, sinks) of `model`'s attention."""
    config = MODELS[model]
    return (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["model_type"] == "gpt_oss")


def _buffers(batch: int, kv_heads: int, head_dim: int, length: int, count: int) -> list:
    shape = (batch, kv_heads, length, head_dim)
    return [(mx.random.normal(shape).astype(mx.bfloat16),
             mx.random.normal(shape).astype(mx.bfloat16)) for _ in range(count)]


def package_sides(model: str, groups: tuple[int, ...]) -> dict[str, int | None]:
    """The package's launch's sides for `model`'s heads where the backend has
    it: `package` (its own groups, None) and `package@N` for each of
    `groups`."""
    heads, kv_heads, head_dim, _ = attention_shape(model)
    stream = mx.default_stream(mx.default_device())
    backend = _backend.implementation(stream)
    if backend.decode_attention is None or not backend.decode_attention_computes(
            head_dim=head_dim, heads=heads, kv_heads=kv_heads, dtype=mx.bfloat16):
        return {}
    return {"package": None} | {f"package@{n}": n for n in groups}


@contextmanager
def launch_groups(groups: int | None):
    """The package's decoding attention splitting its keys for `groups`
    groups (None: as it does), its launches made anew either way."""
    from mlx_moe_plan import _gpu
    from mlx_moe_plan.kernels import launch

    made = launch.DECODE_ATTENTION_GROUPS
    launch.DECODE_ATTENTION_GROUPS = made if groups is None else groups
    launch.decode_attention_launches.cache_clear()
    _gpu._decode_attention_step.cache_clear()
    try:
        yield
    finally:
        launch.DECODE_ATTENTION_GROUPS = made
        launch.decode_attention_launches.cache_clear()
        _gpu._decode_attention_step.cache_clear()


def measure(model: str, context: int, batch: int, layers: int,
            package_groups: tuple[int, ...] = (), build: bool = False) -> dict:
    """Microseconds a call on each side (the package's launch's among them
    where the backend has it, for its own groups and each of
    `package_groups`): its evaluation's, or with `build` the host's graph
    building of it; and each other side's largest difference from the
    `cudnn` side's output on the same keys."""
    heads, kv_heads, head_dim, has_sinks = attention_shape(model)
    keys_count = context + 1
    cache_length = -(-keys_count // CACHE_STEP) * CACHE_STEP
    lengths = {"cudnn": cache_length, "vector": cache_length + 1}
    if _backend.gpu_backend() == "cuda":
        lengths |= {form: cache_length for form in SKETCH_FORMS
                    if heads // kv_heads <= SKETCH_FORMS[form]}
    packages = package_sides(model, package_groups)
    lengths |= {side: cache_length for side in packages}
    queries = [mx.random.normal((batch, heads, 1, head_dim)).astype(mx.bfloat16)
               for _ in range(layers)]
    sinks = mx.random.normal((heads,)).astype(mx.bfloat16) if has_sinks else None
    mx.eval(queries, sinks)
    stream = mx.default_stream(mx.default_device())

    def attend(side, query, keys, values):
        keys, values = keys[:, :, :keys_count], values[:, :, :keys_count]
        if side in SKETCH_FORMS:
            return sketch_attention(query, keys, values, sinks, side)
        if side in packages:  # inside its `split_as(side)`
            return _backend.implementation(stream).decode_attention(
                query, keys, values, sinks, scale=head_dim ** -0.5, stream=stream)
        return mx.fast.scaled_dot_product_attention(query, keys, values,
                                                    scale=head_dim ** -0.5, sinks=sinks)

    def split_as(side):
        # A package side's splits, made once for all its calls: its glue binds
        # its launches once, as in a model, and a side's groups made anew at
        # every call would time that binding too.
        return launch_groups(packages[side]) if side in packages else nullcontext()

    micros = {side: [] for side in lengths}
    for side in [*lengths, *reversed(lengths)]:
        buffers = _buffers(batch, kv_heads, head_dim, lengths[side], layers)
        mx.eval(buffers)
        with split_as(side):
            timing = time_calls(lambda i, side=side, buffers=buffers:
                                attend(side, queries[i], *buffers[i]), layers, warmup=2)
        micros[side].append((timing.build_median_s if build else timing.median_s) * 1e6)
        del buffers
    (keys, values), = _buffers(batch, kv_heads, head_dim, lengths["vector"], 1)
    cached_keys = mx.zeros((batch, kv_heads, cache_length, head_dim), mx.bfloat16)
    cached_values = mx.zeros_like(cached_keys)
    cached_keys[:, :, :keys_count] = keys[:, :, :keys_count]
    cached_values[:, :, :keys_count] = values[:, :, :keys_count]
    mx.eval(cached_keys, cached_values)
    reference = attend("cudnn", queries[0], cached_keys, cached_values).astype(mx.float32)
    diffs = {"vector": attend("vector", queries[0], keys, values)}
    for side in (SKETCH_FORMS.keys() & lengths.keys()) | packages.keys():
        with split_as(side):
            diffs[side] = attend(side, queries[0], cached_keys, cached_values)
    return {side: statistics.median(times) for side, times in micros.items()} | {
        f"{side} diff": mx.abs(out.astype(mx.float32) - reference).max().item()
        for side, out in diffs.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b",
                        help="models whose attention shape to take (default: %(default)s)")
    parser.add_argument("--contexts", default="512,2048",
                        help="tokens already in the cache (default: %(default)s)")
    parser.add_argument("--batches", default="1,8,32,64",
                        help="sequences a step (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=48,
                        help="calls a graph, each on its own buffers (default: %(default)s)")
    parser.add_argument("--package-groups", default="384,512",
                        help="groups the package's launch also splits the keys for, a side "
                             "each (default: %(default)s)")
    parser.add_argument("--build", action="store_true",
                        help="time the host's graph building of each call, not its evaluation")
    args = parser.parse_args(argv)
    groups = tuple(int(n) for n in args.package_groups.split(",") if n)
    # every side a model may have, in order: a dash where it has none
    optional = [*SKETCH_FORMS, "package", *(f"package@{n}" for n in groups)]
    print(f"{'model':15s} {'context':>7s} {'batch':>5s} {'cudnn us':>9s} {'vector us':>9s} "
          f"{'cudnn/vector':>12s} {'diff':>9s}" + "".join(
              f" {side + ' us':>9s} {'cudnn/' + side:>12s} {side + ' diff':>11s}"
              for side in optional), flush=True)
    for model in args.models.split(","):
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                got = measure(model, context, batch, args.layers, groups, args.build)
                others = "".join(
                    f" {got[side]:9.1f} {got['cudnn'] / got[side]:11.2f}x "
                    f"{got[side + ' diff']:11.3g}" if side in got else
                    f" {'-':>9s} {'-':>12s} {'-':>11s}" for side in optional)
                print(f"{model:15s} {context:7d} {batch:5d} {got['cudnn']:9.1f} "
                      f"{got['vector']:9.1f} {got['cudnn'] / got['vector']:11.2f}x "
                      f"{got['vector diff']:9.3g}{others}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
