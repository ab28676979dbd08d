"""A decoding step's attention on MLX's two fused paths: cuDNN's, and its vector kernel.

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

On CUDA a third side, `kernel`, is a sketch of the attention a decoding step
could have instead, CUDA text of its own here (not the package's kernel
scheme): one group of 4 warps a sequence, key-value head and split of the
keys, the query heads that share the key-value head together, so each key and
value is read once; then one group a query head merges the splits. "kernel
diff" is its largest difference from cuDNN's output on the same keys.
"""

from __future__ import annotations

import argparse
import statistics
from functools import cache

import mlx.core as mx

from mlx_moe_plan import _backend

from .timing import time_calls
from .workloads import MODELS

CACHE_STEP = 256  # mlx-lm's KVCache.step

# The sketch's first launch: grid (SPLITS groups, KV_HEADS, batch), 4 warps a
# group, each warp every 4th key of the group's split; a lane holds D / 32
# values of each of the G query heads and of a key's row. Online softmax in
# base 2; the warps' partial sums merged through shared memory, unnormalized,
# with their maximum and sum, one row a query head and split.
_SPLIT_SOURCE = """
constexpr int WARPS = 4;
constexpr int V = D / 32;
const int split = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
const float scale_log2 = rsqrtf(float(D)) * 1.4426950408889634f;
float qf[G][V], m[G], l[G], o[G][V];
for (int h = 0; h < G; ++h) {
  const int head = kv_head * G + h;
  for (int v = 0; v < V; ++v) {
    qf[h][v] = float(queries[(batch * HEADS + head) * D + lane * V + v]) * scale_log2;
    o[h][v] = 0.0f;
  }
  m[h] = -1e30f;
  l[h] = 0.0f;
}
const int start = split * CHUNK;
const int stop = min(start + CHUNK, KEYS);
const size_t base = (size_t(batch) * KV_HEADS + kv_head) * LENGTH * D + lane * V;
for (int key = start + warp; key < stop; key += WARPS) {
  float kf[V], vf[V];
  for (int v = 0; v < V; v += 2) {
    float2 kk = __bfloat1622float2(
        *reinterpret_cast<const __nv_bfloat162*>(keys + base + size_t(key) * D + v));
    float2 vv = __bfloat1622float2(
        *reinterpret_cast<const __nv_bfloat162*>(values + base + size_t(key) * D + v));
    kf[v] = kk.x; kf[v + 1] = kk.y; vf[v] = vv.x; vf[v + 1] = vv.y;
  }
  for (int h = 0; h < G; ++h) {
    float score = 0.0f;
    for (int v = 0; v < V; ++v) score += qf[h][v] * kf[v];
    for (int offset = 16; offset > 0; offset /= 2)
      score += __shfl_xor_sync(0xffffffff, score, offset);
    const float top = fmaxf(m[h], score);
    const float rescale = exp2f(m[h] - top), weight = exp2f(score - top);
    l[h] = l[h] * rescale + weight;
    for (int v = 0; v < V; ++v) o[h][v] = o[h][v] * rescale + weight * vf[v];
    m[h] = top;
  }
}
__shared__ float warp_m[WARPS][G], warp_l[WARPS][G], warp_o[WARPS][G][D];
for (int h = 0; h < G; ++h) {
  if (lane == 0) { warp_m[warp][h] = m[h]; warp_l[warp][h] = l[h]; }
  for (int v = 0; v < V; ++v) warp_o[warp][h][lane * V + v] = o[h][v];
}
__syncthreads();
for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {
  const int h = i / D, d = i % D;
  float top = -1e30f;
  for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_m[w][h]);
  float sum = 0.0f, out = 0.0f;
  for (int w = 0; w < WARPS; ++w) {
    const float f = exp2f(warp_m[w][h] - top);
    sum += warp_l[w][h] * f;
    out += warp_o[w][h][d] * f;
  }
  const size_t row = (size_t(batch) * HEADS + kv_head * G + h) * SPLITS + split;
  part_o[row * D + d] = out;
  if (d == 0) { part_m[row] = top; part_l[row] = sum; }
}
"""

# The second: one group of D threads a sequence's query head, its splits
# merged (and gpt-oss's sink, a logit of no value, in the sum).
_MERGE_SOURCE = """
const size_t row = blockIdx.x;
const int d = threadIdx.x;
float top = -1e30f;
for (int s = 0; s < SPLITS; ++s) top = fmaxf(top, part_m[row * SPLITS + s]);
float sink = -1e30f;
if (HAS_SINKS) {
  sink = float(sinks[row % HEADS]) * 1.4426950408889634f;
  top = fmaxf(top, sink);
}
float sum = HAS_SINKS ? exp2f(sink - top) : 0.0f, out = 0.0f;
for (int s = 0; s < SPLITS; ++s) {
  const float f = exp2f(part_m[row * SPLITS + s] - top);
  sum += part_l[row * SPLITS + s] * f;
  out += part_o[(row * SPLITS + s) * D + d] * f;
}
output[row * D + d] = __float2bfloat16(out / sum);
"""

@cache
def _sketch_kernels():
    """The sketch's two launches as MLX kernels, made once."""
    return (mx.fast.cuda_kernel(name="decode_attention_split",
                                input_names=["queries", "keys", "values"],
                                output_names=["part_o", "part_m", "part_l"],
                                source=_SPLIT_SOURCE),
            mx.fast.cuda_kernel(name="decode_attention_merge",
                                input_names=["part_o", "part_m", "part_l", "sinks"],
                                output_names=["output"], source=_MERGE_SOURCE))


def sketch_splits(batch: int, kv_heads: int, keys_count: int) -> int:
    """Splits of the keys: groups enough for two an SM of an H100 or H200
    (132 SMs), each split at least 64 keys (16 a warp)."""
    return max(1, min(-(-264 // (batch * kv_heads)), keys_count // 64))


def sketch_attention(queries: mx.array, keys: mx.array, values: mx.array, keys_count: int,
                     sinks: mx.array | None) -> mx.array:
    """The sketch on `keys_count` keys of the buffers `keys`, `values`
    (`[batch, kv_heads, length, head_dim]`, bfloat16, contiguous): `[batch,
    heads, 1, head_dim]`, as the fused attention gives it."""
    batch, heads, _, head_dim = queries.shape
    _, kv_heads, length, _ = keys.shape
    splits = sketch_splits(batch, kv_heads, keys_count)
    rows = batch * heads * splits
    # Sizes as template constants, the keys' count among them: a kernel a
    # context, which a benchmark can afford and a decoding step could not.
    split_kernel, merge_kernel = _sketch_kernels()
    part_o, part_m, part_l = split_kernel(
        inputs=[queries, keys, values],
        template=[("D", head_dim), ("G", heads // kv_heads), ("HEADS", heads),
                  ("KV_HEADS", kv_heads), ("LENGTH", length), ("KEYS", keys_count),
                  ("SPLITS", splits), ("CHUNK", -(-keys_count // splits))],
        grid=(splits * 128, kv_heads, batch), threadgroup=(128, 1, 1),
        output_shapes=[(rows, head_dim), (rows,), (rows,)],
        output_dtypes=[mx.float32] * 3)
    merged, = merge_kernel(
        inputs=[part_o, part_m, part_l, part_m if sinks is None else sinks],
        template=[("D", head_dim), ("HEADS", heads), ("SPLITS", splits),
                  ("HAS_SINKS", sinks is not None)],
        grid=(batch * heads * head_dim, 1, 1), threadgroup=(head_dim, 1, 1),
        output_shapes=[(batch, heads, 1, head_dim)], output_dtypes=[mx.bfloat16])
    return merged


def attention_shape(model: str) -> tuple[int, int, int, bool]:
    """(query heads, key-value heads, head size, sinks) of `model`'s attention."""
    config = MODELS[model]
    return (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["model_type"] == "gpt_oss")


def _buffers(batch: int, kv_heads: int, head_dim: int, length: int, count: int) -> list:
    shape = (batch, kv_heads, length, head_dim)
    return [(mx.random.normal(shape).astype(mx.bfloat16),
             mx.random.normal(shape).astype(mx.bfloat16)) for _ in range(count)]


def measure(model: str, context: int, batch: int, layers: int) -> dict:
    """Microseconds a call on each side, and each other side's largest
    difference from the `cudnn` side's output on the same keys."""
    heads, kv_heads, head_dim, has_sinks = attention_shape(model)
    keys_count = context + 1
    cache_length = -(-keys_count // CACHE_STEP) * CACHE_STEP
    lengths = {"cudnn": cache_length, "vector": cache_length + 1}
    if _backend.gpu_backend() == "cuda":
        lengths["kernel"] = cache_length
    queries = [mx.random.normal((batch, heads, 1, head_dim)).astype(mx.bfloat16)
               for _ in range(layers)]
    sinks = mx.random.normal((heads,)).astype(mx.bfloat16) if has_sinks else None
    mx.eval(queries, sinks)

    def attend(side, query, keys, values):
        if side == "kernel":
            return sketch_attention(query, keys, values, keys_count, sinks)
        return mx.fast.scaled_dot_product_attention(
            query, keys[:, :, :keys_count], values[:, :, :keys_count], scale=head_dim ** -0.5,
            sinks=sinks)

    micros = {side: [] for side in lengths}
    for side in [*lengths, *reversed(lengths)]:
        buffers = _buffers(batch, kv_heads, head_dim, lengths[side], layers)
        mx.eval(buffers)
        timing = time_calls(lambda i, side=side, buffers=buffers:
                            attend(side, queries[i], *buffers[i]), layers, warmup=2)
        micros[side].append(timing.median_s * 1e6)
        del buffers
    (keys, values), = _buffers(batch, kv_heads, head_dim, lengths["vector"], 1)
    cached_keys = mx.zeros((batch, kv_heads, cache_length, head_dim), mx.bfloat16)
    cached_values = mx.zeros_like(cached_keys)
    cached_keys[:, :, :keys_count] = keys[:, :, :keys_count]
    cached_values[:, :, :keys_count] = values[:, :, :keys_count]
    mx.eval(cached_keys, cached_values)
    reference = attend("cudnn", queries[0], cached_keys, cached_values).astype(mx.float32)
    diffs = {"vector": attend("vector", queries[0], keys, values)}
    if "kernel" in lengths:
        diffs["kernel"] = attend("kernel", queries[0], cached_keys, cached_values)
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
    args = parser.parse_args(argv)
    print(f"{'model':15s} {'context':>7s} {'batch':>5s} {'cudnn us':>9s} {'vector us':>9s} "
          f"{'cudnn/vector':>12s} {'diff':>9s} {'kernel us':>9s} {'cudnn/kernel':>12s} "
          f"{'kernel diff':>11s}", flush=True)
    for model in args.models.split(","):
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                got = measure(model, context, batch, args.layers)
                kernel = (f"{got['kernel']:9.1f} {got['cudnn'] / got['kernel']:11.2f}x "
                          f"{got['kernel diff']:11.3g}" if "kernel" in got else
                          f"{'-':>9s} {'-':>12s} {'-':>11s}")
                print(f"{model:15s} {context:7d} {batch:5d} {got['cudnn']:9.1f} "
                      f"{got['vector']:9.1f} {got['cudnn'] / got['vector']:11.2f}x "
                      f"{got['vector diff']:9.3g} {kernel}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
