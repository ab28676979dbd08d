"""A MoE block's own dense quantized GEMM (its router, its shared experts), the ways to run it.

    python -m benchmarks.router_gemm                          # chained calls, wall time
    python -m benchmarks.router_gemm --routers qwen3-30b-a3b --tokens 32 --ncu
    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \\
        --csv --log-file router.csv python -m benchmarks.router_gemm --ncu

A decoding step hands a block `[B, 1, D]`. MLX's `quantized_matmul` runs
that shape as B GEMMs of one row ("batched", as mlx-lm's block calls it), and
the tokens as rows `[T, D]` as one GEMM ("rows"). On a CUDA GPU the package's
grouped kernel (kernels/grouped_qmm.h) is timed too, as a plan of one expert
holding every row, in each of `--tilings` (`launch.GroupedQmmTiling`'s fields;
a tiling this package does not have is skipped). Outputs are checked against
"rows" first. Weights are random, quantized with group 64, one set a call,
enough sets that a call reads its weights from memory as a model's layer does.

Default: each call's input is the previous call's output plus the tokens (a
broadcast add), so the calls run one after another as a model's layers do,
and the wall time of a chain is reported a call (`benchmarks.timing`, each
side twice in turns), beside "none", the chain's add alone. With `--ncu`: for
each side, three calls each evaluated alone, after a marker kernel named
`router_mark_<router>_<T>_<side index>` and between cuProfilerStart and
cuProfilerStop, for Nsight Compute's kernel durations; the lines printed name
each marker's side.
"""

from __future__ import annotations

import argparse
import math
import statistics

import mlx.core as mx

from .grouped_qmm import CACHE_BYTES, check_sides, column_bytes, parse_tilings, tiling_name
from .timing import profiled, time_calls

# (out N, in D, bits) of the blocks' own projections; routers in 8 bits as
# mlx-lm's quantize predicates set them, shared experts in the model's 4.
GEMMS = {
    "qwen3-30b-a3b": (128, 2048, 8),
    "qwen3-next": (512, 2048, 8),
    "gpt-oss-20b": (32, 2880, 8),
    "mixtral": (8, 4096, 4),
    "next-shared-up": (512, 2048, 4),
    "next-shared-down": (2048, 512, 4),
    "ds-shared-up": (2048, 7168, 4),
    "ds-shared-down": (7168, 2048, 4),
}
GROUP_SIZE = 64
MARKER = "router_mark_"


def sides_for(out_dims: int, in_dims: int, bits: int, tokens: int, weight_sets: list,
              tilings: list[dict]) -> dict:
    """side -> `call(i, x)`: the GEMM of `x` `[tokens, in_dims]` with weight set i."""
    def rows(i, x):
        return mx.quantized_matmul(x, *weight_sets[i], transpose=True, group_size=GROUP_SIZE,
                                   bits=bits)

    def batched(i, x):
        out = mx.quantized_matmul(x.reshape(tokens, 1, in_dims), *weight_sets[i],
                                  transpose=True, group_size=GROUP_SIZE, bits=bits)
        return out.reshape(tokens, out_dims)

    sides = {"rows": rows, "batched": batched}
    if mx.default_device().type != mx.gpu or not mx.cuda.is_available():
        return sides
    from mlx_moe_plan import _backend, _gpu
    from mlx_moe_plan.kernels import launch

    gpu = _gpu.for_backend(_backend.gpu_backend())
    stream = mx.default_stream(mx.gpu)
    offsets = mx.array([0, tokens], dtype=mx.int32)  # one expert, every row
    row_experts = mx.zeros((tokens,), dtype=mx.int32)

    def grouped(i, x, changes):
        weight, scales, biases = weight_sets[i]
        with launch.grouped_qmm_tiling(**changes):
            return gpu.grouped_qmm(x, weight[None], scales[None], biases[None], offsets,
                                   row_experts, bits=bits, group_size=GROUP_SIZE, stream=stream)

    for changes in tilings:
        try:
            with launch.grouped_qmm_tiling(**changes):
                pass
        except (TypeError, ValueError):  # a field or value this package lacks
            continue
        sides[f"grouped:{tiling_name(changes)}"] = (
            lambda i, x, changes=changes: grouped(i, x, changes))
    return sides


def chained(call, x: mx.array):
    """`call(i, x)` as a chain: call i's input is x plus call i-1's first column."""
    state = {}

    def link(i):
        y = call(i, x if i == 0 else state["x"])
        state["x"] = x + y[:, :1]
        return y

    return link


def profile_marked(name: str, sides: dict, x: mx.array) -> None:
    """Each side's three calls, each evaluated alone, after a marker, profiled."""
    for index, (side, call) in enumerate(sides.items()):
        mx.eval([call(i, x) for i in range(3)])  # compiled, warm
        profiled(f"{MARKER}{name}_{index}",
                 lambda: [mx.eval(call(i, x)) for i in range(3, 6)])
        print(f"{MARKER}{name}_{index}: {side}", flush=True)


def measure(router: str, tokens: int, tilings: list[dict], max_calls: int,
            ncu: bool) -> dict[str, float]:
    out_dims, in_dims, bits = GEMMS[router]
    touched = out_dims * column_bytes(in_dims, bits)  # GROUP_SIZE is column_bytes' 64
    calls = min(max_calls, max(48, math.ceil(2 * CACHE_BYTES / touched)))
    weight_sets = [mx.quantize((mx.random.normal((out_dims, in_dims)) * 0.02)
                               .astype(mx.bfloat16), GROUP_SIZE, bits) for _ in range(calls)]
    x = (mx.random.normal((tokens, in_dims)) * 0.5).astype(mx.bfloat16)
    mx.eval(weight_sets, x)
    sides = sides_for(out_dims, in_dims, bits, tokens, weight_sets, tilings)
    check_sides({side: lambda i, call=call: call(i, x) for side, call in sides.items()},
                f"{router} T={tokens}")  # each against "rows"
    if ncu:
        profile_marked(f"{router}_{tokens}", sides, x)
        return {}
    sides = {"none": lambda i, x: x[:, :out_dims] * 1, **sides}
    samples = {side: [] for side in sides}
    for _ in range(2):  # each side twice, in turns
        for side, call in sides.items():
            samples[side].append(time_calls(chained(call, x), calls).median_s * 1e6)
    return {side: statistics.median(values) for side, values in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_gemm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", default="qwen3-30b-a3b,qwen3-next,gpt-oss-20b",
                        help=f"comma list from {', '.join(GEMMS)} (default: %(default)s)")
    parser.add_argument("--tokens", default="8,32,64",
                        help="comma list of T (default: %(default)s)")
    parser.add_argument("--tilings", default="default",
                        help='the grouped kernel\'s, "default;tiles=1,steps=4"; "none": none '
                             "(default: %(default)s)")
    parser.add_argument("--max-calls", type=int, default=400,
                        help="calls (weight sets) a graph (default: %(default)s)")
    parser.add_argument("--ncu", action="store_true", help="marked calls for Nsight Compute")
    args = parser.parse_args(argv)
    tilings = [] if args.tilings == "none" else parse_tilings(args.tilings)
    for router in args.routers.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            medians = measure(router, tokens, tilings, args.max_calls, args.ncu)
            if medians:
                print(f"{router:16s} T={tokens:4d} " + "  ".join(
                    f"{side} {us:.2f}" for side, us in medians.items()) + "  (us a call)",
                    flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
