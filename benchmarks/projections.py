"""A model's dense quantized projections in the shapes a decoding batch hands them.

    python -m benchmarks.projections                      # every projection, batch 1 to 64
    python -m benchmarks.projections --dtypes bfloat16,float16 --bits 4,8 --json rule.json
    python -m benchmarks.projections --gemms qwen3-30b-a3b/router --batches 32 --tilings default
    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \\
        --csv --log-file gemm.csv python -m benchmarks.projections --ncu
    python -m benchmarks.projections --summarize gemm.csv
    python -m benchmarks.projections --prefill --batches 512,2048,8192 --tilings default

A decoding step of B sequences hands each projection (attention, a block's
router and shared experts, the lm_head) `[B, 1, D]`, which MLX's
`quantized_matmul` computes as B GEMMs of one row ("batched", as mlx-lm
calls it). The same rows are also timed as one matrix `[1, B, D]` ("matrix")
and `[B, D]` ("rows"), and through the package's projection call, which takes
one of these by the measured rule (`rules.dense_as_rows`, "patched", as
`patch_model(dense=False)` computes them); on a CUDA GPU also as
`patch_model` computes them by default ("dense": the grouped kernel where
`rules.dense_decoding_expert` says so). There the
package's grouped kernel (kernels/grouped_qmm.h) can be timed
too, as a plan of one expert holding every row, in each of `--tilings`
(`launch.GroupedQmmTiling`'s fields; a tiling this package does not have is
skipped). Outputs are checked against "batched" first. Weights are random,
quantized with group 64, enough sets that a call reads its weights from
memory as a model's layer does.

Default: each call's input is the previous call's output plus the tokens (a
broadcast add), so the calls run one after another as a model's layers do,
and the time of a chain is reported a call (`benchmarks.timing`, each side
twice in turns), beside "none", the chain's add alone: for a decoding
batch, building the graph and evaluating it, as a step of generation pays
both (`--eval-only`: the evaluation alone, the GPU's share); for a prefill,
the evaluation. The last table
gives, for each projection and batch, the fastest side and the rule's, and
a line for each case where the rule's took longer than the fastest by more
than `--slack`. With `--ncu`: for each side, three calls each evaluated
alone, after a marker kernel named `gemm_mark_<projection>_<B>_<side
index>_<side>` (each character that is not a letter, digit or "_" an "_")
and between cuProfilerStart and cuProfilerStop, for Nsight Compute's kernel
durations, which `--summarize` reads back: each side's kernels, us a call.

With `--prefill`, `--batches` are a prefill's T rows: each projection takes
`[1, T, D]` as mlx-lm hands it ("matrix", the reference: a prefill is one
matrix already), against the grouped kernel in each of `--tilings` (block
tiles, kernels/grouped_qmm_tiles.h, from 32 rows), one expert holding every
row; the last table gives each projection's fastest grouped side against
"matrix", and TFLOP/s (2 T N D a call).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import mlx.core as mx
import mlx.nn as nn

from .grouped_qmm import CACHE_BYTES, check_sides, column_bytes, parse_tilings, tiling_name
from .timing import NCU_CALLS, marked_kernels, marker_name, profile_marked, time_calls

# (out N, in D, bits) of each model's dense projections: attention's, the
# MoE block's router (8 bits, as mlx-lm's quantize predicates set routers)
# and shared experts, the lm_head; the models' configurations as in
# benchmarks.workloads. Projections of equal shape are listed once.
GEMMS = {
    "qwen3-30b-a3b/q": (4096, 2048, 4),
    "qwen3-30b-a3b/kv": (512, 2048, 4),
    "qwen3-30b-a3b/o": (2048, 4096, 4),
    "qwen3-30b-a3b/router": (128, 2048, 8),
    "qwen3-30b-a3b/lm_head": (151936, 2048, 4),
    "gpt-oss-20b/q": (4096, 2880, 4),
    "gpt-oss-20b/kv": (512, 2880, 4),
    "gpt-oss-20b/o": (2880, 4096, 4),
    "gpt-oss-20b/router": (32, 2880, 8),
    "gpt-oss-20b/lm_head": (201088, 2880, 4),
    "qwen3-next/q": (8192, 2048, 4),
    "qwen3-next/qkvz": (12288, 2048, 4),
    "qwen3-next/ba": (64, 2048, 4),
    "qwen3-next/router": (512, 2048, 8),
    "qwen3-next/shared-down": (2048, 512, 4),
    "mixtral/kv": (1024, 4096, 4),
    "mixtral/qo": (4096, 4096, 4),
    "mixtral/router": (8, 4096, 8),
    "mixtral/lm_head": (32000, 4096, 4),
    "deepseek-v3/q-a": (1536, 7168, 4),
    "deepseek-v3/q-b": (24576, 1536, 4),
    "deepseek-v3/kv-a": (576, 7168, 4),
    "deepseek-v3/kv-b": (32768, 512, 4),
    "deepseek-v3/o": (7168, 16384, 4),
    "deepseek-v3/shared-up": (2048, 7168, 4),
    "deepseek-v3/shared-down": (7168, 2048, 4),
    "deepseek-v3/lm_head": (129280, 7168, 4),
}
GROUP_SIZE = 64
MARKER = "gemm_mark_"
SHAPES = ("batched", "matrix", "rows")


def quantized_layer(weights: tuple, out_dims: int, in_dims: int, bits: int,
                    expert: bool = False) -> nn.Module:
    """An `nn.QuantizedLinear` holding `weights` (weight, scales, biases),
    given the package's rows call (`projections.take_rows`; `expert`: as
    `patch_model(dense=True)` gives it)."""
    from mlx_moe_plan import projections

    layer = nn.QuantizedLinear(in_dims, out_dims, bias=False, group_size=GROUP_SIZE, bits=bits)
    layer.weight, layer.scales, layer.biases = weights
    projections.take_rows(layer, expert=expert)
    return layer


def sides_for(out_dims: int, in_dims: int, bits: int, batch: int, weight_sets: list,
              tilings: list[dict], prefill: bool = False) -> dict:
    """side -> `call(i, x)`: the GEMM of `x` `[batch, in_dims]` with weight set i;
    for a `prefill`, "matrix" and the grouped kernel's sides only."""
    def shaped(shape):
        def call(i, x):
            out = mx.quantized_matmul(x.reshape(shape), *weight_sets[i % len(weight_sets)],
                                      transpose=True, group_size=GROUP_SIZE, bits=bits)
            return out.reshape(batch, out_dims)
        return call

    cuda = mx.default_device().type == mx.gpu and mx.cuda.is_available()
    if prefill:
        sides = {"matrix": shaped((1, batch, in_dims))}
    else:
        def patched(expert):
            layers = [quantized_layer(w, out_dims, in_dims, bits, expert) for w in weight_sets]
            return lambda i, x: layers[i % len(layers)](
                x.reshape(batch, 1, in_dims)).reshape(batch, out_dims)

        sides = {"batched": shaped((batch, 1, in_dims)), "matrix": shaped((1, batch, in_dims)),
                 "rows": shaped((batch, in_dims)), "patched": patched(False)}
        if cuda:
            sides["dense"] = patched(True)
    if not tilings or not cuda:
        return sides
    from mlx_moe_plan import _backend, _gpu, projections
    from mlx_moe_plan.kernels import launch

    gpu = _gpu.for_backend(_backend.gpu_backend())
    stream = mx.default_stream(mx.gpu)
    # one expert, every row: the plan patch_model(dense=True) hands the kernel
    # (in device memory: an 8-byte array made here would be managed memory)
    offsets, row_experts = projections._one_expert_plan(batch, stream)

    def grouped(i, x, changes):
        weight, scales, biases = weight_sets[i % len(weight_sets)]
        with launch.grouped_qmm_tiling(**changes):
            return gpu.grouped_qmm(x, weight[None], scales[None], biases[None], offsets,
                                   row_experts, bits=bits, group_size=GROUP_SIZE, stream=stream,
                                   dense=True)

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


def profile_sides(name: str, sides: dict, x: mx.array) -> None:
    """Each side's calls on `x` under Nsight Compute (`timing.profile_marked`),
    after markers naming the projection, batch, side's index and side."""
    profile_marked(f"{MARKER}{name}", {side: lambda i, call=call: call(i, x)
                                       for side, call in sides.items()})


def summarize(path: str, top: int = 3) -> str:
    """Nsight Compute's CSV of an --ncu run: each marked side's kernels, us a
    call (the mean of its NCU_CALLS), and its `top` kernels by time."""
    out = []
    for label, micros, launches in marked_kernels(path, MARKER):
        kernels = ", ".join(f"{name} {us / NCU_CALLS:.1f}"
                            for name, us in micros.most_common(top))
        out.append(f"{label:56s} {sum(micros.values()) / NCU_CALLS:8.1f} us "
                   f"{sum(launches.values()) // NCU_CALLS:3d} kernels  [{kernels}]")
    return "\n".join(out)


def measure(gemm: str, batch: int, dtype: mx.Dtype, bits: int, tilings: list[dict],
            max_calls: int, target_s: float, ncu: bool, prefill: bool = False,
            eval_only: bool = False) -> tuple[dict[str, float], str]:
    """Each side's median microseconds a call of `gemm` at `batch` rows (built
    and evaluated; evaluated only for a `prefill` or with `eval_only`), and
    the shape the package's call takes ("rows" or "batched"; "expert" where
    `patch_model(dense=True)` takes the grouped kernel; "matrix" for a
    `prefill`)."""
    from mlx_moe_plan import projections

    out_dims, in_dims, _ = GEMMS[gemm]
    touched = out_dims * column_bytes(in_dims, bits)  # GROUP_SIZE is column_bytes' 64
    # Enough sets that the graph's weights outgrow the cache twice, and enough
    # calls that a graph of the smallest GEMMs outlasts its launch.
    sets = max(2, math.ceil(2 * CACHE_BYTES / touched))
    calls = min(max_calls, max(sets, 8, math.ceil(8 * CACHE_BYTES / touched)))
    sets = min(sets, calls)
    weight_sets = [mx.quantize((mx.random.normal((out_dims, in_dims)) * 0.02).astype(dtype),
                               GROUP_SIZE, bits) for _ in range(sets)]
    x = (mx.random.normal((batch, in_dims)) * 0.5).astype(dtype)
    mx.eval(weight_sets, x)
    sides = sides_for(out_dims, in_dims, bits, batch, weight_sets, tilings, prefill)
    check_sides({side: lambda i, call=call: call(i, x) for side, call in sides.items()},
                f"{gemm} B={batch}")  # each against the first, "batched" or "matrix"
    if prefill:
        rule = "matrix"
    else:
        layer = quantized_layer(weight_sets[0], out_dims, in_dims, bits, expert=True)
        step = x.reshape(batch, 1, in_dims)
        rule = ("expert" if projections._as_expert(layer, step) and "dense" in sides
                else "rows" if projections._as_rows(layer, step) else "batched")
    if ncu:
        profile_sides(marker_name(f"{gemm}_{batch}"), sides, x)
        return {}, rule
    sides = {"none": lambda i, x: x[:, :out_dims] * 1, **sides}
    samples = {side: [] for side in sides}
    for _ in range(2):  # each side twice, in turns
        for side, call in sides.items():
            timing = time_calls(chained(call, x), calls, target_s=target_s)
            seconds = timing.median_s if prefill or eval_only else timing.wall_median_s
            samples[side].append(seconds * 1e6)
    return {side: statistics.median(values) for side, values in samples.items()}, rule


def rule_rows(results: list[dict], slack: float) -> tuple[list[str], list[str]]:
    """The last table's lines, and the cases where the package's call under
    its rule ("dense" where it takes the grouped kernel, else "patched") took
    longer than the fastest side (a shape, or a tiling of the grouped kernel)
    by more than `slack` (a fraction)."""
    lines = [f"{'projection':24s} {'dtype':8s} bits {'B':>3s}  fastest   x batched  "
             "rule     x batched"]
    slower = []
    for r in results:
        times = r["us"]
        ruled = "dense" if r["rule"] == "expert" else "patched"
        fastest = min((s for s in times if s in SHAPES or s.startswith("grouped:")),
                      key=lambda s: times[s])
        line = (f"{r['gemm']:24s} {r['dtype']:8s} {r['bits']:4d} {r['batch']:3d}  "
                f"{fastest:8s} {times['batched'] / times[fastest]:7.2f}x  "
                f"{r['rule']:8s} {times['batched'] / times[ruled]:7.2f}x")
        lines.append(line)
        if times[ruled] > (1 + slack) * times[fastest]:
            slower.append(line)
    return lines, slower


def prefill_rows(results: list[dict]) -> list[str]:
    """The `--prefill` table's lines: each projection and T, the fastest
    grouped side against "matrix", and both sides' TFLOP/s."""
    lines = [f"{'projection':24s} {'dtype':8s} bits {'T':>5s}  {'matrix us':>9s}  "
             f"{'grouped us':>10s}  speedup  {'TFLOP/s':>7s}  {'matrix':>7s}  fastest grouped"]
    for r in results:
        times = r["us"]
        grouped = [side for side in times if side.startswith("grouped:")]
        if not grouped:
            continue
        fastest = min(grouped, key=lambda side: times[side])
        out_dims, in_dims, _ = GEMMS[r["gemm"]]
        flops = 2 * r["batch"] * out_dims * in_dims
        lines.append(f"{r['gemm']:24s} {r['dtype']:8s} {r['bits']:4d} {r['batch']:5d}  "
                     f"{times['matrix']:9.1f}  {times[fastest]:10.1f}  "
                     f"{times['matrix'] / times[fastest]:6.2f}x  "
                     f"{flops / times[fastest] / 1e6:7.1f}  {flops / times['matrix'] / 1e6:7.1f}"
                     f"  {fastest}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.projections",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--summarize", metavar="CSV",
                        help="summarize an --ncu run's Nsight Compute CSV instead of running "
                             "(default: none)")
    parser.add_argument("--gemms", default=",".join(GEMMS),
                        help="comma list from GEMMS, model/projection (default: all)")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64",
                        help="comma list of B (default: %(default)s)")
    parser.add_argument("--dtypes", default="bfloat16",
                        help="comma list of the rows' dtypes (default: %(default)s)")
    parser.add_argument("--bits", default="",
                        help="comma list of bits a weight, each GEMM in each (default: each "
                             "GEMM's own)")
    parser.add_argument("--tilings", default="none",
                        help='the grouped kernel\'s, "default;tiles=1,steps=4"; "none": none '
                             "(default: %(default)s)")
    parser.add_argument("--max-calls", type=int, default=400,
                        help="calls a graph (default: %(default)s)")
    parser.add_argument("--target-s", type=float, default=0.05,
                        help="seconds of timed graphs a side and turn (default: %(default)s)")
    parser.add_argument("--slack", type=float, default=0.05,
                        help="the rule's call's allowance over the fastest side, listed "
                             "past it (default: %(default)s)")
    parser.add_argument("--ncu", action="store_true", help="marked calls for Nsight Compute")
    parser.add_argument("--eval-only", action="store_true",
                        help="time a decoding batch's evaluation alone, not its graph's "
                             "building too (default: both, as a step of generation)")
    parser.add_argument("--prefill", action="store_true",
                        help="--batches are a prefill's rows: [1, T, D] against the grouped "
                             "kernel's --tilings (default: a decoding batch's shapes)")
    parser.add_argument("--json", metavar="PATH",
                        help="write every median here (default: none)")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    tilings = [] if args.tilings == "none" else parse_tilings(args.tilings)
    results = []
    for gemm in args.gemms.split(","):
        for bits in [int(b) for b in args.bits.split(",") if b] or [GEMMS[gemm][2]]:
            for dtype_name in args.dtypes.split(","):
                for batch in (int(b) for b in args.batches.split(",")):
                    times, rule = measure(gemm, batch, getattr(mx, dtype_name), bits,
                                          tilings, args.max_calls, args.target_s, args.ncu,
                                          args.prefill, args.eval_only)
                    if not times:
                        continue
                    results.append({"gemm": gemm, "dtype": dtype_name, "bits": bits,
                                    "batch": batch, "rule": rule, "us": times})
                    print(f"{gemm:24s} {dtype_name:8s} {bits}b B={batch:3d} " + "  ".join(
                        f"{side} {us:.2f}" for side, us in times.items()) + "  (us a call)",
                        flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "mlx": mx.__version__,
                       "results": results}, f, indent=1)
    if results and args.prefill:
        print("\n".join(prefill_rows(results)))
    elif results:
        lines, slower = rule_rows(results, args.slack)
        print("\n".join(lines))
        print(f"the rule's call slower than the fastest side by over {args.slack:.0%}: "
              f"{len(slower)} of {len(results)}")
        print("\n".join(slower))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
