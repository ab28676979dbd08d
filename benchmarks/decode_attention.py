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
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx

from .timing import time_calls
from .workloads import MODELS

CACHE_STEP = 256  # mlx-lm's KVCache.step


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
    """Microseconds a call on each side, and the sides' largest difference."""
    heads, kv_heads, head_dim, has_sinks = attention_shape(model)
    keys_count = context + 1
    cache_length = -(-keys_count // CACHE_STEP) * CACHE_STEP
    lengths = {"cudnn": cache_length, "vector": cache_length + 1}
    queries = [mx.random.normal((batch, heads, 1, head_dim)).astype(mx.bfloat16)
               for _ in range(layers)]
    sinks = mx.random.normal((heads,)).astype(mx.bfloat16) if has_sinks else None
    mx.eval(queries, sinks)

    def attend(query, keys, values):
        return mx.fast.scaled_dot_product_attention(
            query, keys[:, :, :keys_count], values[:, :, :keys_count], scale=head_dim ** -0.5,
            sinks=sinks)

    micros = {side: [] for side in lengths}
    for side in [*lengths, *reversed(lengths)]:
        buffers = _buffers(batch, kv_heads, head_dim, lengths[side], layers)
        mx.eval(buffers)
        timing = time_calls(lambda i, buffers=buffers: attend(queries[i], *buffers[i]), layers,
                            warmup=2)
        micros[side].append(timing.median_s * 1e6)
        del buffers
    (keys, values), = _buffers(batch, kv_heads, head_dim, lengths["vector"], 1)
    cached_keys = mx.zeros((batch, kv_heads, cache_length, head_dim), mx.bfloat16)
    cached_values = mx.zeros_like(cached_keys)
    cached_keys[:, :, :keys_count] = keys[:, :, :keys_count]
    cached_values[:, :, :keys_count] = values[:, :, :keys_count]
    mx.eval(cached_keys, cached_values)
    diff = mx.abs(attend(queries[0], keys, values).astype(mx.float32)
                  - attend(queries[0], cached_keys, cached_values).astype(mx.float32)).max()
    return {side: statistics.median(times) for side, times in micros.items()} | {
        "diff": diff.item()}


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
          f"{'cudnn/vector':>12s} {'diff':>9s}", flush=True)
    for model in args.models.split(","):
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                got = measure(model, context, batch, args.layers)
                print(f"{model:15s} {context:7d} {batch:5d} {got['cudnn']:9.1f} "
                      f"{got['vector']:9.1f} {got['cudnn'] / got['vector']:11.2f}x "
                      f"{got['diff']:9.3g}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
