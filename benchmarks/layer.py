"""The MoE layer end to end: mlx_moe_plan.nn.SwitchGLU against mlx-lm's.

    python -m benchmarks.moe --layer                        # quick, on the default device
    python -m benchmarks.moe --layer --shapes qwen3-next --tokens 512,2048,8192
    python -m benchmarks.moe --layer --tile-m auto,1,16,64  # each GEMM formulation

Each call is one MoE layer's expert work with 4-bit weights (group 64):
mlx-lm's `SwitchGLU(x, indices)` then the weighted sum the model applies,
`(y * scores[..., None]).sum(-2)`, against ours on the same weights: plan,
gather, the three `gather_qmm` GEMMs over expert-sorted rows, and one
`moe_combine` (`SwitchGLU.weighted_sum`). Outputs are compared first.
Times are medians of graphs of several layers (`benchmarks.timing`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from .timing import time_calls


@dataclass(frozen=True)
class LayerShape:
    hidden: int  # D
    intermediate: int  # I
    experts: int  # E
    top_k: int  # K


SHAPES = {
    "qwen3-next": LayerShape(2048, 512, 512, 10),
    "qwen3-30b-a3b": LayerShape(2048, 768, 128, 8),
    "deepseek-v3": LayerShape(7168, 2048, 256, 8),
    "mixtral": LayerShape(4096, 14336, 8, 2),
}
# MLX's CPU gather_qmm runs 4-bit bfloat16 near 0.25 GFLOP/s (20 s a layer at T=64):
# the CPU quick run is one layer of a few tokens.
# Tokens a reference slice takes where mlx-lm's layer fails on the whole batch.
REFERENCE_TOKENS = 2048
QUICK = {"gpu": (["qwen3-next", "qwen3-30b-a3b"], [2048]), "cpu": (["qwen3-30b-a3b"], [8])}


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
    from mlx_moe_plan.nn import SwitchGLU, default_tile_m

    theirs = make_layers(shape, layers)
    inputs = [routing(tokens, shape) for _ in range(layers)]
    flops = 2 * 3 * tokens * shape.top_k * shape.hidden * shape.intermediate

    def time_us(layer_call):
        timing = time_calls(layer_call, layers, warmup=1, min_repeats=3, max_repeats=200,
                            target_s=1.0)
        return timing.median_s * 1e6

    def mlx_lm_call(i):
        x, indices, scores = inputs[i]
        return (theirs[i](x, indices) * scores[..., None]).sum(-2)

    try:
        mlx_lm_us = time_us(mlx_lm_call)
        mlx_lm_error = None
    except RuntimeError as error:  # MLX's CUDA backend: sorted gather_qmm over too many rows
        mlx_lm_us, mlx_lm_error = None, f"{type(error).__name__}: {error}"
    # The reference output: mlx-lm's, over slices of tokens where it fails whole
    # (each token's output depends on its own row alone).
    x, indices, scores = inputs[0]
    step = tokens if mlx_lm_error is None else REFERENCE_TOKENS
    want = mx.concatenate([
        (theirs[0](x[i : i + step], indices[i : i + step]) * scores[i : i + step, :, None]).sum(-2)
        for i in range(0, tokens, step)]).astype(mx.float32)
    scale = float(mx.abs(want).max())
    rows = []
    for tile_m in tile_ms:
        ours = [SwitchGLU.from_mlx_lm(layer, tile_m=tile_m) for layer in theirs]

        def our_call(i):
            x, indices, scores = inputs[i]
            return ours[i].weighted_sum(x, indices, scores)

        error = float(mx.abs(our_call(0).astype(mx.float32) - want).max())
        if not error <= 2e-2 * scale:  # bfloat16 rounding of the output, not a wrong row
            raise SystemExit(f"{name} T={tokens} tile_m={tile_m}: ours differs from mlx-lm "
                             f"by {error} (max |y| {scale})")
        ours_us = time_us(our_call)
        used = tile_m
        if used is None:
            used = default_tile_m(tokens * shape.top_k, shape.experts)
        rows.append({"model": name, "tokens": tokens, **shape.__dict__, "tile_m": tile_m,
                     "tile_m_used": used,
                     "max_abs_diff": error, "mlx-lm_us": mlx_lm_us, "mlx-lm_error": mlx_lm_error,
                     "ours_us": ours_us,
                     "mlx-lm_gflops": flops / mlx_lm_us / 1e3 if mlx_lm_us else None,
                     "ours_gflops": flops / ours_us / 1e3,
                     "speedup": mlx_lm_us / ours_us if mlx_lm_us else None})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe --layer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", help=f"comma list from {', '.join(SHAPES)}")
    parser.add_argument("--tokens", help="comma list of token counts T")
    parser.add_argument("--layers", type=int, help="layers (calls) in one graph")
    parser.add_argument("--tile-m", default="auto",
                        help="comma list of GEMM formulations: auto = the layer's default "
                             "(nn.default_tile_m), 0 = mlx-lm's unsorted one (no plan), "
                             "1 = sorted rows, >1 = tiles of that many rows")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    device = "gpu" if mx.default_device().type == mx.gpu else "cpu"
    shapes, tokens = QUICK[device]
    shapes = args.shapes.split(",") if args.shapes else shapes
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else tokens
    layers = args.layers or (8 if device == "gpu" else 1)
    mx.random.seed(0)
    results = []
    print(f"{'model':15s} {'D':>5s} {'I':>6s} {'E':>4s} {'K':>3s} {'T':>6s} {'tile':>4s} "
          f"{'mlx-lm us':>11s} {'ours us':>10s} {'GFLOP/s':>9s} {'speedup':>8s}")
    tile_ms = [None if v == "auto" else int(v) for v in args.tile_m.split(",")]
    for name in shapes:
        for t in tokens:
            for row in measure(name, SHAPES[name], t, layers, tile_ms):
                results.append(row)
                theirs = "fails" if row["mlx-lm_us"] is None else f"{row['mlx-lm_us']:.1f}"
                speedup = "" if row["speedup"] is None else f"{row['speedup']:.2f}x"
                tile = "auto" if row["tile_m"] is None else row["tile_m"]
                print(f"{name:15s} {row['hidden']:5d} {row['intermediate']:6d} "
                      f"{row['experts']:4d} {row['top_k']:3d} {t:6d} {tile:>4} "
                      f"{theirs:>11s} {row['ours_us']:10.1f} "
                      f"{row['ours_gflops']:9.1f} {speedup:>8s}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "mlx": mx.__version__,
                       "command": " ".join(["python -m benchmarks.moe --layer",
                                            *(argv or sys.argv[2:])]),
                       "results": results}, f, indent=1)
    return 0
