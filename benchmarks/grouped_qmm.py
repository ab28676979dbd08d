"""The grouped GEMM (kernels/grouped_qmm.h) against MLX's `gather_qmm` on the same rows.

    python -m benchmarks.grouped_qmm                       # Qwen3-30B-A3B, T = 1 to 64
    python -m benchmarks.grouped_qmm --shapes mixtral --tokens 1,8
    python -m benchmarks.grouped_qmm --tilings "default;tiles=1;steps=4,tiles=1"

One expert projection of a layer shape (`benchmarks/workloads.py`), 4-bit
weights (group 64), bfloat16 rows as a decode step's plan sorts them (random
top-K routing, `tile_m=1`): the package's kernel (`GpuBackend.grouped_qmm`)
against MLX's sorted `gather_qmm` over the same rows, `[rows, 1, D]` against
`row_experts`, the sorted-rows formulation's GEMM. Both outputs are compared
first. The calls of a graph cycle through enough sets of weights that each
reads its weights from memory (`weight_sets_for`). Times are eval medians of
graphs of `--calls` calls (`benchmarks.timing`), each side twice, in turns;
"floor" is the time to read the touched experts' packed weights, scales and
biases once at `--bandwidth` GB/s. `--tilings` times the kernel in other
tilings too (`launch.GroupedQmmTiling`'s fields). The "gate+up" lines time the
layer's first half as it runs: the fused launch in each tiling (rows read from
the tokens, silu(gate) * up stored; `gated_tiles` are each projection's) and the
unfused kernels (gathered rows, two launches, MLX's activation), against MLX's
(gathered rows, two `gather_qmm`, the activation). GPU only.
"""

from __future__ import annotations

import argparse
import math
import statistics

import mlx.core as mx
import numpy as np

from .timing import time_calls
from .workloads import LAYER_SHAPES


def projections(shape) -> dict[str, tuple[int, int]]:
    """(out, in) of the layer's two kinds of projection: gate/up, and down."""
    return {"gate": (shape.intermediate, shape.hidden), "down": (shape.hidden, shape.intermediate)}


def parse_tilings(text: str) -> list[dict[str, int]]:
    """`"default;tiles=1;steps=4,tiles=1"` -> `[{}, {"tiles": 1}, {...}]`."""
    tilings = []
    for item in text.split(";"):
        pairs = [] if item.strip() == "default" else item.split(",")
        tilings.append({key.strip(): int(value) for key, value in
                        (pair.split("=") for pair in pairs)})
    return tilings


def tiling_name(changes: dict[str, int]) -> str:
    return ",".join(f"{key}={value}" for key, value in changes.items()) or "default"


# A graph's calls cycle through sets of weights whose touched bytes together
# are twice this (an H200's L2), so that a call reads its weights from memory,
# as a model's layers do, not from an earlier call's cache.
CACHE_BYTES = 50e6


def weight_sets_for(touched_bytes: float, calls: int) -> int:
    """Weight sets to cycle through: touched bytes of all of them >= 2 * CACHE_BYTES."""
    return min(calls, max(2, math.ceil(2 * CACHE_BYTES / touched_bytes)))


def column_bytes(in_dims: int, bits: int = 4) -> int:
    """A column's bytes: `bits` a weight, a bfloat16 scale and bias every 64."""
    return in_dims * bits // 8 + in_dims // 64 * 2 * 2


def quantized_experts(experts: int, out_dims: int, in_dims: int) -> tuple:
    """One projection's random experts, 4-bit (group 64) of bfloat16, evaluated."""
    weight = (mx.random.normal((experts, out_dims, in_dims)) * 0.02).astype(mx.bfloat16)
    matrices = mx.quantize(weight, 64, 4)
    mx.eval(matrices)
    return matrices


def check_sides(sides: dict, what: str) -> None:
    """Each side's output, `sides[side](0)`, against the first side's: within
    bfloat16's rounding of the outputs, or SystemExit naming the side."""
    reference, *others = sides
    want = sides[reference](0).astype(mx.float32)
    scale = float(mx.abs(want).max())
    for side in others:
        got = sides[side](0).astype(mx.float32).reshape(want.shape)
        error = float(mx.abs(got - want).max())
        if not error <= 2e-2 * scale:  # bfloat16 rounding of the outputs, not a wrong row
            raise SystemExit(f"{what} {side}: differs from {reference} by {error} "
                             f"(max |y| {scale})")


def checked_medians(sides: dict, calls: int, what: str) -> dict[str, float]:
    """Each side's output checked against the first side's (MLX's), then every
    side timed twice, in turns: side -> median us of a call."""
    check_sides(sides, what)
    samples = {side: [] for side in sides}
    for _ in range(2):  # each side twice, in turns
        for side, call in sides.items():
            samples[side].append(time_calls(call, calls).median_s * 1e6)
    return {side: statistics.median(values) for side, values in samples.items()}


def result_rows(name: str, tokens: int, projection: str, out_dims: int, in_dims: int, shape,
                active: int, medians: dict[str, float], floor_us: float) -> list[dict]:
    """One line a side of `checked_medians` but its first (MLX's), which each
    line carries as `gather_qmm_us`."""
    reference, *ours = medians
    return [{"shape": name, "tokens": tokens, "projection": projection, "out": out_dims,
             "in": in_dims, "experts": shape.experts, "active_experts": active, "tiling": side,
             "ours_us": medians[side], "gather_qmm_us": medians[reference], "floor_us": floor_us}
            for side in ours]


def measure(name: str, tokens: int, calls: int, bandwidth: float,
            tilings: list[dict[str, int]]) -> list[dict]:
    from mlx_moe_plan import _backend, _gpu, moe_plan
    from mlx_moe_plan.kernels import launch

    shape = LAYER_SHAPES[name]
    stream = mx.default_stream(mx.gpu)
    gpu = _gpu.for_backend(_backend.gpu_backend())
    rng = np.random.default_rng(tokens)
    routed = np.stack([rng.choice(shape.experts, shape.top_k, replace=False)
                       for _ in range(tokens)]).astype(np.int32)
    plan = moe_plan(mx.array(routed), shape.experts, tile_m=1)
    active = int((np.bincount(routed.reshape(-1), minlength=shape.experts) > 0).sum())
    rows_out = []
    for projection, (out_dims, in_dims) in projections(shape).items():
        touched = active * out_dims * column_bytes(in_dims)
        weight_sets = [quantized_experts(shape.experts, out_dims, in_dims)
                       for _ in range(weight_sets_for(touched, calls))]
        rows = (mx.random.normal((plan.capacity, in_dims)) * 0.5).astype(mx.bfloat16)
        mx.eval(rows, plan.outputs)

        def ours(i, changes=None):
            packed, scales, biases = weight_sets[i % len(weight_sets)]
            with launch.grouped_qmm_tiling(**(changes or {})):
                return gpu.grouped_qmm(rows, packed, scales, biases, plan.expert_offsets,
                                       plan.row_experts, bits=4, group_size=64, stream=stream)

        def theirs(i):
            packed, scales, biases = weight_sets[i % len(weight_sets)]
            return mx.gather_qmm(rows.reshape(-1, 1, in_dims), packed, scales, biases,
                                 rhs_indices=plan.row_experts, transpose=True, group_size=64,
                                 bits=4, sorted_indices=True)

        sides = {"gather_qmm": theirs}
        for changes in tilings:
            sides[tiling_name(changes)] = lambda i, changes=changes: ours(i, changes)
        medians = checked_medians(sides, calls, f"{name} T={tokens} {projection}")
        rows_out += result_rows(name, tokens, projection, out_dims, in_dims, shape, active,
                                medians, touched / (bandwidth * 1e3))
    rows_out.extend(measure_gate_up(shape, name, tokens, plan, active, calls, bandwidth,
                                    tilings))
    return rows_out


def measure_gate_up(shape, name: str, tokens: int, plan, active: int, calls: int,
                    bandwidth: float, tilings: list[dict[str, int]]) -> list[dict]:
    """The layer's gate, up and activation from the tokens: the fused launch in
    each tiling (lines "fused" for the default, "fused,gated_tiles=1" ...) and the
    unfused kernels ("unfused", default tiling), against MLX's `gather_qmm`."""
    from mlx_moe_plan import _backend, _gpu, moe_gather
    from mlx_moe_plan.kernels import launch

    stream = mx.default_stream(mx.gpu)
    gpu = _gpu.for_backend(_backend.gpu_backend())
    out_dims, in_dims = shape.intermediate, shape.hidden
    touched = 2 * active * out_dims * column_bytes(in_dims)
    pairs = [[quantized_experts(shape.experts, out_dims, in_dims) for _ in range(2)]
             for _ in range(weight_sets_for(touched, calls))]
    x = (mx.random.normal((tokens, in_dims)) * 0.5).astype(mx.bfloat16)
    mx.eval(x)

    def fused(i, changes=None):
        gate, up = pairs[i % len(pairs)]
        with launch.grouped_qmm_tiling(**(changes or {})):
            return gpu.grouped_qmm(x, *gate, plan.expert_offsets, plan.row_experts, bits=4,
                                   group_size=64, stream=stream, row_tokens=plan.row_tokens,
                                   up=up)

    def unfused(i):
        rows = moe_gather(x, plan)
        gate, up = (gpu.grouped_qmm(rows, *matrices, plan.expert_offsets, plan.row_experts,
                                    bits=4, group_size=64, stream=stream)
                    for matrices in pairs[i % len(pairs)])
        return gate * mx.sigmoid(gate) * up

    def theirs(i):
        rows = moe_gather(x, plan).reshape(-1, 1, in_dims)
        gate, up = (mx.gather_qmm(rows, *matrices, rhs_indices=plan.row_experts,
                                  transpose=True, group_size=64, bits=4, sorted_indices=True)
                    for matrices in pairs[i % len(pairs)])
        return (gate * mx.sigmoid(gate) * up).reshape(plan.capacity, out_dims)

    sides = {"gather_qmm": theirs, "unfused": unfused}
    for changes in tilings:
        side = "fused" if not changes else f"fused,{tiling_name(changes)}"
        sides[side] = lambda i, changes=changes: fused(i, changes)
    medians = checked_medians(sides, calls, f"{name} T={tokens} gate+up")
    return result_rows(name, tokens, "gate+up", out_dims, in_dims, shape, active, medians,
                       touched / (bandwidth * 1e3))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grouped_qmm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b",
                        help=f"comma list from {', '.join(LAYER_SHAPES)} "
                             "(default: %(default)s)")
    parser.add_argument("--tokens", default="1,8,32,64",
                        help="comma list of T (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=48,
                        help="calls in one graph (default: %(default)s)")
    parser.add_argument("--bandwidth", type=float, default=4800.0,
                        help="memory bandwidth for the floor, GB/s (default: %(default)s, "
                             "the H200's)")
    parser.add_argument("--tilings", default="default",
                        help="semicolon list of kernel tilings: default, or comma lists of "
                             "GroupedQmmTiling fields (tiles=1,steps=4) (default: %(default)s)")
    args = parser.parse_args(argv)
    tilings = parse_tilings(args.tilings)
    if mx.default_device().type != mx.gpu:
        raise SystemExit("benchmarks.grouped_qmm times a GPU kernel: this MLX has no GPU device")
    print(f"{'shape':15s} {'T':>4s} {'proj':7s} {'tiling':18s} {'experts':>7s} "
          f"{'ours us':>8s} {'gather_qmm':>10s} {'floor':>6s} {'vs gather':>9s} {'vs floor':>8s}")
    for name in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            for row in measure(name, tokens, args.calls, args.bandwidth, tilings):
                print(f"{name:15s} {tokens:4d} {row['projection']:7s} {row['tiling']:18s} "
                      f"{row['active_experts']:7d} {row['ours_us']:8.1f} "
                      f"{row['gather_qmm_us']:10.1f} {row['floor_us']:6.1f} "
                      f"{row['gather_qmm_us'] / row['ours_us']:8.2f}x "
                      f"{row['ours_us'] / row['floor_us']:7.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
