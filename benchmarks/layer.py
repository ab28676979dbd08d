"""The MoE layer end to end: mlx_moe_plan.nn.SwitchGLU against mlx-lm's.

    python -m benchmarks.layer                        # quick, on the default device
    python -m benchmarks.layer --shapes qwen3-next --tokens 1,8,64,2048
    python -m benchmarks.layer --tile-m auto,0,-1,1,16,64  # each GEMM formulation

Each call is one MoE layer's expert work with 4-bit weights (group 64):
mlx-lm's `SwitchGLU(x, indices)` then the weighted sum the model applies,
`(y * scores[..., None]).sum(-2)`, against ours on the same weights: plan,
gather, the three `gather_qmm` GEMMs over expert-sorted rows, and one
`moe_combine` (`SwitchGLU.weighted_sum`). Outputs are compared first.
Times are medians of graphs of several layers (`benchmarks.timing`), each
side timed twice, in turns. The speedup is of wall time, graph building
included, as a model's step pays it (at decode sizes, mostly host time); the
eval-only speedup is beside it (the throughput of graphs built ahead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from .model import default_by_device
from .timing import time_calls
from .workloads import LAYER_SHAPES as SHAPES
from .workloads import LayerShape


# MLX's CPU gather_qmm runs 4-bit bfloat16 near 0.25 GFLOP/s (20 s a layer at T=64):
# the CPU quick run is one layer of a few tokens.
# Tokens a reference slice takes where mlx-lm's layer fails on the whole batch.
REFERENCE_TOKENS = 2048
QUICK = {"gpu": (["qwen3-next", "qwen3-30b-a3b"], [2048]), "cpu": (["qwen3-30b-a3b"], [8])}
GPU_LAYERS, CPU_LAYERS = 8, 1  # layers (calls) in one timed graph


def make_layers(shape: LayerShape, layers: int):
    """mlx-lm's layers: bfloat16 weights quantized to 4 bits, group 64."""
    from mlx_lm.models.switch_layers import SwitchGLU as MlxLmSwitchGLU

    theirs = []
    for _ in range(layers):
        layer = MlxLmSwitchGLU(shape.hidden, shape.intermediate, shape.experts)
        layer.update(tree_map(lambda p: p.astype(mx.bfloat16), layer.parameters()))
        nn.quantize(layer, group_size=64, bits=4)
        mx.eval(layer.parameters())
        theirs.append(layer)
    return theirs


def routing(tokens: int, shape: LayerShape):
    logits = mx.random.normal((tokens, shape.experts))
    indices = mx.argpartition(-logits, shape.top_k - 1, axis=-1)[:, : shape.top_k]
    scores = mx.softmax(mx.take_along_axis(logits, indices, -1), axis=-1).astype(mx.bfloat16)
    x = (mx.random.normal((tokens, shape.hidden)) * 0.5).astype(mx.bfloat16)
    mx.eval(indices, scores, x)
    return x, indices.astype(mx.int32), scores


def measure(name: str, shape: LayerShape, tokens: int, layers: int, tile_ms: list[int]):
    """One row per formulation in `tile_ms`, each against the same mlx-lm timing."""
    from mlx_moe_plan.nn import SwitchGLU

    theirs = make_layers(shape, layers)
    inputs = [routing(tokens, shape) for _ in range(layers)]
    flops = 2 * 3 * tokens * shape.top_k * shape.hidden * shape.intermediate

    def time_us(layer_call) -> tuple[float, float, float]:
        """(wall, eval, build) in us a layer: medians of graphs of `layers`."""
        timing = time_calls(layer_call, layers, warmup=1, min_repeats=3, max_repeats=200,
                            target_s=0.5)
        return timing.wall_median_s * 1e6, timing.median_s * 1e6, timing.build_median_s * 1e6

    def mlx_lm_call(i):
        x, indices, scores = inputs[i]
        return (theirs[i](x, indices) * scores[..., None]).sum(-2)

    try:
        mlx_lm_samples = [time_us(mlx_lm_call)]
        mlx_lm_error = None
    except RuntimeError as error:  # MLX's CUDA backend: sorted gather_qmm over too many rows
        mlx_lm_samples, mlx_lm_error = [], f"{type(error).__name__}: {error}"
    # The reference output: mlx-lm's, over slices of tokens where it fails whole
    # (each token's output depends on its own row alone).
    x, indices, scores = inputs[0]
    step = tokens if mlx_lm_error is None else REFERENCE_TOKENS
    want = mx.concatenate([
        (theirs[0](x[i : i + step], indices[i : i + step]) * scores[i : i + step, :, None]).sum(-2)
        for i in range(0, tokens, step)]).astype(mx.float32)
    scale = float(mx.abs(want).max())
    ours_samples = {}
    for tile_m in tile_ms:
        ours = [SwitchGLU.from_mlx_lm(layer, tile_m=tile_m) for layer in theirs]

        def our_call(i, ours=ours):
            x, indices, scores = inputs[i]
            return ours[i].weighted_sum(x, indices, scores)

        error = float(mx.abs(our_call(0).astype(mx.float32) - want).max())
        if not error <= 2e-2 * scale:  # bfloat16 rounding of the output, not a wrong row
            raise SystemExit(f"{name} T={tokens} tile_m={tile_m}: ours differs from mlx-lm "
                             f"by {error} (max |y| {scale})")
        ours_samples[tile_m] = ([time_us(our_call)], error, our_call)
    # A second turn in the other order, so that drift hits both sides.
    for tile_m in reversed(tile_ms):
        samples, _, our_call = ours_samples[tile_m]
        samples.append(time_us(our_call))
    if mlx_lm_error is None:
        mlx_lm_samples.append(time_us(mlx_lm_call))

    def median(samples, which):
        return statistics.median(s[which] for s in samples) if samples else None

    mlx_lm_wall, mlx_lm_eval = median(mlx_lm_samples, 0), median(mlx_lm_samples, 1)
    rows = []
    # What the rule picks for the first layer's call here, as the layer asks it.
    ruled = SwitchGLU.from_mlx_lm(theirs[0])._formulation(x, indices).tile_m
    for tile_m in tile_ms:
        samples, error, _ = ours_samples[tile_m]
        ours_wall, ours_eval = median(samples, 0), median(samples, 1)
        used = ruled if tile_m is None else tile_m
        rows.append({"model": name, "tokens": tokens, **shape.__dict__, "tile_m": tile_m,
                     "tile_m_used": used, "max_abs_diff": error, "mlx-lm_error": mlx_lm_error,
                     "mlx-lm_wall_us": mlx_lm_wall, "ours_wall_us": ours_wall,
                     "mlx-lm_us": mlx_lm_eval, "ours_us": ours_eval,
                     "mlx-lm_build_us": median(mlx_lm_samples, 2),
                     "ours_build_us": median(samples, 2),
                     "mlx-lm_gflops": flops / mlx_lm_wall / 1e3 if mlx_lm_wall else None,
                     "ours_gflops": flops / ours_wall / 1e3,
                     "speedup": mlx_lm_wall / ours_wall if mlx_lm_wall else None,
                     "eval_speedup": mlx_lm_eval / ours_eval if mlx_lm_eval else None})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.layer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", help=f"comma list from {', '.join(SHAPES)} "
                        + default_by_device(QUICK["gpu"][0], QUICK["cpu"][0]))
    parser.add_argument("--tokens", help="comma list of token counts T "
                        + default_by_device(QUICK["gpu"][1], QUICK["cpu"][1]))
    parser.add_argument("--layers", type=int, help="layers (calls) in one graph "
                        + default_by_device(GPU_LAYERS, CPU_LAYERS))
    parser.add_argument("--tile-m", default="auto",
                        help="comma list of GEMM formulations: auto = the layer's default "
                             "(nn.default_tile_m), 0 = mlx-lm's own call (no plan), "
                             "-1 = sorted rows through the grouped kernel, "
                             "1 = sorted rows, >1 = tiles of that many rows "
                             "(default: %(default)s)")
    parser.add_argument("--json", metavar="PATH",
                        help="write every result as JSON (default: none)")
    args = parser.parse_args(argv)
    device = "gpu" if mx.default_device().type == mx.gpu else "cpu"
    shapes, tokens = QUICK[device]
    shapes = args.shapes.split(",") if args.shapes else shapes
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else tokens
    layers = args.layers or (GPU_LAYERS if device == "gpu" else CPU_LAYERS)
    mx.random.seed(0)
    results = []
    print(f"{'model':15s} {'D':>5s} {'I':>6s} {'E':>4s} {'K':>3s} {'T':>6s} {'tile':>4s} "
          f"{'mlx-lm us':>10s} {'build':>6s} {'ours us':>9s} {'build':>6s} {'GFLOP/s':>8s} "
          f"{'speedup':>8s} {'eval-only':>9s}")
    tile_ms = [None if v == "auto" else int(v) for v in args.tile_m.split(",")]
    for name in shapes:
        for t in tokens:
            for row in measure(name, SHAPES[name], t, layers, tile_ms):
                results.append(row)
                theirs = "fails" if row["mlx-lm_wall_us"] is None else \
                    f"{row['mlx-lm_wall_us']:.1f}"
                theirs_build = "" if row["mlx-lm_build_us"] is None else \
                    f"{row['mlx-lm_build_us']:.1f}"
                speedup = "" if row["speedup"] is None else f"{row['speedup']:.2f}x"
                eval_speedup = "" if row["eval_speedup"] is None else \
                    f"{row['eval_speedup']:.2f}x"
                tile = "auto" if row["tile_m"] is None else row["tile_m"]
                print(f"{name:15s} {row['hidden']:5d} {row['intermediate']:6d} "
                      f"{row['experts']:4d} {row['top_k']:3d} {t:6d} {tile:>4} "
                      f"{theirs:>10s} {theirs_build:>6s} {row['ours_wall_us']:9.1f} "
                      f"{row['ours_build_us']:6.1f} {row['ours_gflops']:8.1f} "
                      f"{speedup:>8s} {eval_speedup:>9s}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "mlx": mx.__version__,
                       "command": " ".join(["python -m benchmarks.layer",
                                            *(sys.argv[1:] if argv is None else argv)]),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
