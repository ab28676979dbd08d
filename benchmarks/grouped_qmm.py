"""The grouped GEMM (kernels/grouped_qmm.h) against MLX's `gather_qmm` on the same rows.

    python -m benchmarks.grouped_qmm                       # Qwen3-30B-A3B, T = 1 to 64
    python -m benchmarks.grouped_qmm --shapes mixtral --tokens 1,8
    python -m benchmarks.grouped_qmm --tilings "default;tiles=1;steps=4,tiles=1"
    python -m benchmarks.grouped_qmm --shapes qwen3-30b-a3b,gpt-oss-20b \
        --tokens 2048,8192 --mlx-tiles 16,64 --skew 0.5        # prefill sizes
    python -m benchmarks.grouped_qmm --shapes mixtral --tokens 8192 --no-sorted \
        --tilings "default;block_row_tiles=2"                  # the block tiles
    ncu --profile-from-start off --set full -o qmm python -m benchmarks.grouped_qmm \
        --ncu --shapes qwen3-30b-a3b --tokens 2048 --no-sorted --sides kernel

One expert projection of a layer shape (`benchmarks/workloads.py`), weights of
`--bits` in groups of `--group-size` (4 and 64 unless told) and rows in `--dtype`
(bfloat16 unless told), the rows as a decode step's plan sorts them (random
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

Each line's TFLOP/s is of the routed entries' work, 2 * T*K * out * in a
projection (padding is not work), the side's and MLX's sorted gather_qmm's. The
"layer" lines add up a side's gate and up then down, the layer's GEMMs
(`layer_rows`): the fused launch and the down projection for the kernel, the
gate's twice and the down's for a ceiling; "layer default" is the kernel's
side the layer runs (fused, or unfused where the backend's rule leaves the
gate and up apart).
At prefill sizes (T = 512 to 16384) MLX's layer runs tiles: `--mlx-tiles 16,64`
times MLX's tiled `gather_qmm` of `moe_plan(..., tile_m=m)`, rows
`[max_tiles, m, D]` against the tiles' experts, in each projection and gate+up.
The ceilings ("matmul_bf16", "qmm_dense", `--sides ceilings`, on unless told)
are MLX's dense GEMMs of the same work, all T*K rows against one matrix:
`matmul` in the rows' dtype ("matmul_bf16" or "matmul_fp16") and `quantized_matmul`
of the same bits and groups, each checked against float32's matmul of its own
inputs. `--sides kernel` alone leaves them out, `--sides
ceilings` the package's kernel. From `launch.GroupedQmmTiling.tiles_from_rows`
rows an expert the kernel runs its block tiles (kernels/grouped_qmm_tiles.h),
whose fields start with `block_`. MLX's sorted rows take minutes a shape at
prefill sizes and fail to launch from 65,535 rows: `--no-sorted` leaves them
out, and MLX's tiles (64 unless `--mlx-tiles`) are the reference then, as past
that row count. `--skew S` draws experts with probability
proportional to 1 / (rank + 1) ** S (Zipf; 0 is uniform), the "busiest" column
the busiest expert's entries over the average's. Graphs take fewer calls where
their outputs would pass GRAPH_BYTES. `--ncu` times nothing: after the check,
each side's one call runs under Nsight Compute's collection, after a marker
kernel named MARKER, the shape, T, projection, side's place and side.
`--processes N` runs the command in N processes, one after another, the shapes'
order turned by one each (a GPU's speed can drift over a process's first
minutes), and prints each line's medians (`median_rows`); `--json` writes the
lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

import mlx.core as mx
import numpy as np

from .timing import marker_name, profile_marked, time_calls, without_options
from .workloads import LAYER_SHAPES, MODELS, layer_shape


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


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """What a run's weights and rows are: `bits` a weight in quantization
    groups of `group_size`, the rows, scales and biases in `dtype`."""
    bits: int = 4
    group_size: int = 64
    dtype: str = "bfloat16"

    @property
    def matmul_side(self) -> str:
        """The dense 16-bit ceiling's side name: matmul_bf16 or matmul_fp16."""
        return "matmul_bf16" if self.dtype == "bfloat16" else "matmul_fp16"


def column_bytes(in_dims: int, bits: int = 4, group_size: int = 64) -> int:
    """A column's bytes: `bits` a weight, a 16-bit scale and bias a group."""
    return in_dims * bits // 8 + in_dims // group_size * 2 * 2


def quantized_experts(experts: int, out_dims: int, in_dims: int,
                      form: WeightFormat = WeightFormat()) -> tuple:
    """One projection's random experts, quantized as `form` says, evaluated."""
    weight = (mx.random.normal((experts, out_dims, in_dims)) * 0.02).astype(
        getattr(mx, form.dtype))
    matrices = mx.quantize(weight, form.group_size, form.bits)
    mx.eval(matrices)
    return matrices


def check_sides(sides: dict, what: str, views: dict | None = None,
                tolerance: float = 2e-2) -> None:
    """Each side's output, `sides[side](0)`, against the first side's: within
    `tolerance` of its largest magnitude (bfloat16's rounding of the outputs),
    or SystemExit naming the side.
    `views[side]`, where given, maps the side's output to what is compared (its
    rows in entry order where the sides' plans pad differently); None skips a
    side that computes something else (checked on its own)."""
    views = views or {}
    reference, *others = sides

    def output(side):
        return views.get(side, lambda y: y)(sides[side](0)).astype(mx.float32)

    want = output(reference)
    scale = float(mx.abs(want).max())
    for side in others:
        if side in views and views[side] is None:
            continue
        got = output(side).reshape(want.shape)
        error = float(mx.abs(got - want).max())
        if not error <= tolerance * scale:  # rounding, not a wrong row
            raise SystemExit(f"{what} {side}: differs from {reference} by {error} "
                             f"(max |y| {scale})")


def checked_medians(sides: dict, calls: int, what: str, views: dict | None = None,
                    ncu: bool = False) -> dict[str, float] | None:
    """Each side's output checked against the first side's (MLX's), as
    `check_sides` with `views`, then every side timed twice, in turns:
    side -> median us of a call. With `ncu`, each side's one call under
    Nsight Compute instead (`timing.profile_marked`, markers MARKER and
    `what`; one, since the profiler replays each launch it collects), and
    None."""
    check_sides(sides, what, views)
    if ncu:
        profile_marked(MARKER + marker_name(what), sides, calls=1)
        return None
    samples = {side: [] for side in sides}
    for _ in range(2):  # each side twice, in turns
        for side, call in sides.items():
            samples[side].append(time_calls(call, calls).median_s * 1e6)
    return {side: statistics.median(values) for side, values in samples.items()}


# The start of the kernels `--ncu` runs before each side's calls.
MARKER = "qmm_mark_"

# MLX's CUDA gather_qmm of single sorted rows fails from this many rows (a
# launch error): past it, the reference side is MLX's tiled gather_qmm.
MLX_SORTED_ROWS = 65535


def launch_text(experts: int, in_dims: int, out_dims: int, capacity: int,
                changes: dict[str, int], *, num_rows: int | None = None,
                gated: bool = False, form: WeightFormat = WeightFormat()) -> str:
    """What a tiling launches at these sizes in `form`: the decode body, or
    the block tiles and their block and stages as they fit the shared memory,
    so that a tiling the launch falls back from shows; "the default's launch"
    where `changes` launch exactly what the default does (a field this launch
    does not take), whose two lines then differ only by the run's noise."""
    from mlx_moe_plan import _backend, _gpu
    from mlx_moe_plan.kernels import launch

    def launched(tiling_changes: dict[str, int]):
        with launch.grouped_qmm_tiling(**tiling_changes):
            return launch.grouped_qmm_launch(experts, in_dims, out_dims, capacity, form.bits,
                                             form.group_size, form.dtype,
                                             backend=_backend.gpu_backend(), num_rows=num_rows,
                                             gated=gated, warpgroup=_gpu.warpgroup_mma())

    run = launched(changes)
    default = ", the default's launch" if changes and run == launched({}) else ""
    template = dict(run.template)
    if run.body in ("grouped_qmm_tiles", "grouped_qmm_roles"):
        multiply_adds = (", weights made in shared memory" if template["SHARED_WEIGHTS"]
                         else ", wgmma" if template["WARPGROUP"] else "")
        runs = f", each of {run.groups} groups' items one run" if template["ACROSS_ITEMS"] else ""
        return (f"tiles {template['BLOCK_ROWS']}x{template['BLOCK_COLUMNS']}, "
                f"{template['STAGE_GROUPS'] * form.group_size} values x "
                f"{template['STAGES']} stages{multiply_adds}{runs}{default}")
    ahead = ", loads ahead" if template["LOADS_AHEAD"] else ""
    ring = f", words in a ring of {template['WORD_STAGES']}" if template["WORD_STAGES"] else ""
    return (f"decode body, {template['STEPS']} steps{ahead}{ring}, {template['K_SPLITS']} "
            f"sets{default}")


def result_rows(name: str, tokens: int, projection: str, out_dims: int, in_dims: int, shape,
                active: int, medians: dict[str, float], floor_us: float,
                busiest: float = 1.0, launches: dict[str, str] | None = None,
                form: WeightFormat = WeightFormat()) -> list[dict]:
    """One line a side of `checked_medians` but its first (MLX's sorted
    gather_qmm, or past MLX_SORTED_ROWS its tiled one: `reference`), which each
    line carries as `gather_qmm_us`; TFLOP/s of the routed entries' work
    (padding is not work), `tflops` the side's, `gather_qmm_tflops` MLX's;
    `launch`, the kernel's launch of the side (`launches`), else empty; the
    weights' `bits`, `group_size` and the rows' `dtype` (`form`)."""
    launches = launches or {}
    reference, *ours = medians
    projections = 2 if projection == "gate+up" else 1
    flops = 2 * tokens * shape.top_k * projections * out_dims * in_dims
    return [{"shape": name, "tokens": tokens, "projection": projection, "out": out_dims,
             "in": in_dims, "experts": shape.experts, "active_experts": active, "tiling": side,
             "ours_us": medians[side], "gather_qmm_us": medians[reference], "floor_us": floor_us,
             "tflops": flops / medians[side] / 1e6,
             "gather_qmm_tflops": flops / medians[reference] / 1e6, "busiest": busiest,
             "reference": reference, "launch": launches.get(side, ""),
             **dataclasses.asdict(form)}
            for side in ours]


# The outputs of a graph's calls stay alive until its eval ends: at prefill
# sizes (DeepSeek-V3's down projection at T = 16384 writes 2 GB a call) a
# graph takes fewer calls, its outputs within this.
GRAPH_BYTES = 16e9


def calls_within(call_bytes: float, calls: int) -> int:
    """Calls of a graph whose outputs, `call_bytes` each, fit in GRAPH_BYTES (one at least)."""
    return max(1, min(calls, int(GRAPH_BYTES // call_bytes)))


def routed_experts(experts: int, top_k: int, tokens: int, skew: float, rng) -> np.ndarray:
    """`[tokens, top_k]` distinct experts a token. `skew` 0: uniform (as
    before, the same draws); else experts drawn with probability proportional
    to 1 / (rank + 1) ** skew (Zipf, ranks a random order of the experts), as
    trained routers favour some experts: top-K by Gumbel keys, which draws K
    without replacement with those probabilities."""
    if skew == 0:
        return np.stack([rng.choice(experts, top_k, replace=False)
                         for _ in range(tokens)]).astype(np.int32)
    popularity = np.log(1.0 / (np.arange(experts) + 1.0) ** skew)[rng.permutation(experts)]
    keys = popularity + rng.gumbel(size=(tokens, experts))
    return np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k].astype(np.int32)


def busiest_share(routed: np.ndarray, experts: int) -> float:
    """The busiest expert's entries over the average expert's."""
    return float(np.bincount(routed.reshape(-1), minlength=experts).max() * experts
                 / routed.size)


def in_entry_order(plan):
    """A side's output `[..., out]` over `plan`'s rows -> its rows in entry
    order, the same for every plan's padding."""
    positions = plan.positions.reshape(-1)
    return lambda y: y.reshape(-1, y.shape[-1])[positions]


def tile_plans(routed: mx.array, experts: int, mlx_tiles) -> dict[int, tuple]:
    """tile_m -> (its plan, its tiles' experts with -1 past num_tiles the last
    expert, as `nn.SwitchGLU._expert_rows_used` gives MLX's tiled gather_qmm:
    sorted, as `sorted_indices` promises)."""
    from mlx_moe_plan import moe_plan

    plans = {}
    for tile_m in mlx_tiles:
        plan = moe_plan(routed, experts, tile_m=tile_m)
        tile_experts = mx.where(plan.tile_experts < 0, experts - 1, plan.tile_experts)
        mx.eval(plan.outputs, tile_experts)
        plans[tile_m] = (plan, tile_experts)
    return plans


def ceiling_sides(rows: mx.array, out_dims: int, in_dims: int, calls: int,
                  what: str, form: WeightFormat = WeightFormat()) -> dict:
    """MLX's dense GEMMs of the same work, one matrix for all of `rows`
    (`[T*K, in]`): `matmul` in the rows' dtype (`form.matmul_side`) and
    `quantized_matmul` of `form`'s bits and groups ("qmm_dense"), each checked
    against float32's `matmul` of its own inputs, cycling through weight sets
    as the expert sides do."""
    dense = [(mx.random.normal((in_dims, out_dims)) * 0.02).astype(rows.dtype)
             for _ in range(weight_sets_for(out_dims * in_dims * 2, calls))]
    quantized = [tuple(array[0] for array in quantized_experts(1, out_dims, in_dims, form))
                 for _ in range(weight_sets_for(
                     out_dims * column_bytes(in_dims, form.bits, form.group_size), calls))]
    mx.eval(dense, quantized)

    def matmul_16bit(i):
        return mx.matmul(rows, dense[i % len(dense)])

    def qmm_dense(i):
        return mx.quantized_matmul(rows, *quantized[i % len(quantized)], transpose=True,
                                   group_size=form.group_size, bits=form.bits)

    wide = rows.astype(mx.float32)
    check_sides({"float32": lambda i: mx.matmul(wide, dense[0].astype(mx.float32)),
                 form.matmul_side: matmul_16bit}, what)
    # MLX's CPU quantized_matmul sums bfloat16 rows in bfloat16: a sum of n
    # terms rounds to about 2**-8 * sqrt(n) of its magnitude (13% at n = 2048),
    # still far from an unwritten output's 100%.
    check_sides({"float32": lambda i: mx.matmul(wide, mx.dequantize(
                     *quantized[0], group_size=form.group_size, bits=form.bits).astype(
                         mx.float32).T),
                 "qmm_dense": qmm_dense}, what, tolerance=max(2e-2, 2**-8 * in_dims**0.5))
    return {form.matmul_side: matmul_16bit, "qmm_dense": qmm_dense}


def shape_of(name: str):
    """The layer shape of `name`, a shape of LAYER_SHAPES or a model's name
    (gpt-oss-20b)."""
    return LAYER_SHAPES[name] if name in LAYER_SHAPES else layer_shape(MODELS[name])


def measure(name: str, tokens: int, calls: int, bandwidth: float,
            tilings: list[dict[str, int]], *, mlx_tiles=(), skew: float = 0.0,
            sorted_rows: bool = True, kernel: bool = True, ceilings: bool = False,
            form: WeightFormat = WeightFormat(), ncu: bool = False) -> list[dict]:
    """Each projection's lines, then gate+up's: the package's kernel in each
    tiling (`kernel`), MLX's tiled gather_qmm at each `mlx_tiles` tile_m, and
    (`ceilings`) MLX's dense GEMMs of the same work, all against MLX's sorted
    gather_qmm (`sorted_rows`, where it launches), else against its first
    tiles (64 where none are given); routing skewed by `skew`
    (`routed_experts`); weights and rows as `form` says. With `ncu`, the
    sides' calls under Nsight Compute instead of timed (`checked_medians`),
    and no lines."""
    from mlx_moe_plan import _backend, _gpu, moe_gather, moe_plan
    from mlx_moe_plan.kernels import launch

    shape = shape_of(name)
    stream = mx.default_stream(mx.gpu)
    gpu = _gpu.for_backend(_backend.gpu_backend())
    rng = np.random.default_rng(tokens)
    routed = routed_experts(shape.experts, shape.top_k, tokens, skew, rng)
    busiest = busiest_share(routed, shape.experts)
    plan = moe_plan(mx.array(routed), shape.experts, tile_m=1)
    tiles = tile_plans(mx.array(routed), shape.experts, mlx_tiles)
    active = int((np.bincount(routed.reshape(-1), minlength=shape.experts) > 0).sum())
    most_rows = max([plan.capacity] + [tiled.capacity for tiled, _ in tiles.values()])
    sorted_rows = sorted_rows and plan.capacity < MLX_SORTED_ROWS
    if not sorted_rows and not tiles:  # the reference: MLX's tiles
        tiles = tile_plans(mx.array(routed), shape.experts, (64,))
    rows_out = []
    for projection, (out_dims, in_dims) in projections(shape).items():
        what = f"{name} T={tokens} {projection}"
        graph_calls = calls_within(most_rows * out_dims * 2, calls)
        touched = active * out_dims * column_bytes(in_dims, form.bits, form.group_size)
        weight_sets = [quantized_experts(shape.experts, out_dims, in_dims, form)
                       for _ in range(weight_sets_for(touched, graph_calls))]
        # Each plan's rows are the same entries' (tokens gathered), so that
        # the sides' outputs compare in entry order.
        x = (mx.random.normal((tokens, in_dims)) * 0.5).astype(getattr(mx, form.dtype))
        rows = moe_gather(x, plan)
        tiled_rows = {tile_m: moe_gather(x, tiled).reshape(tiled.max_tiles, tile_m, in_dims)
                      for tile_m, (tiled, _) in tiles.items()}
        mx.eval(rows, tiled_rows, plan.outputs)

        def ours(i, changes=None):
            packed, scales, biases = weight_sets[i % len(weight_sets)]
            with launch.grouped_qmm_tiling(**(changes or {})):
                return gpu.grouped_qmm(rows, packed, scales, biases, plan.expert_offsets,
                                       plan.row_experts, bits=form.bits,
                                       group_size=form.group_size, stream=stream)

        def theirs(i):
            packed, scales, biases = weight_sets[i % len(weight_sets)]
            return mx.gather_qmm(rows.reshape(-1, 1, in_dims), packed, scales, biases,
                                 rhs_indices=plan.row_experts, transpose=True,
                                 group_size=form.group_size, bits=form.bits,
                                 sorted_indices=True)

        def theirs_tiled(i, tile_m):
            packed, scales, biases = weight_sets[i % len(weight_sets)]
            return mx.gather_qmm(tiled_rows[tile_m], packed, scales, biases,
                                 rhs_indices=tiles[tile_m][1], transpose=True,
                                 group_size=form.group_size, bits=form.bits,
                                 sorted_indices=True)

        sides, views = {}, {}
        if sorted_rows:
            sides["gather_qmm"], views["gather_qmm"] = theirs, in_entry_order(plan)
        for tile_m, (tiled, _) in tiles.items():
            sides[f"mlx,tile_m={tile_m}"] = lambda i, tile_m=tile_m: theirs_tiled(i, tile_m)
            views[f"mlx,tile_m={tile_m}"] = in_entry_order(tiled)
        launches = {}
        if kernel:
            for changes in tilings:
                side = tiling_name(changes)
                sides[side] = lambda i, changes=changes: ours(i, changes)
                views[side] = in_entry_order(plan)
                launches[side] = launch_text(shape.experts, in_dims, out_dims, plan.capacity,
                                             changes, form=form)
        if ceilings:
            entries = x[mx.array(np.repeat(np.arange(tokens), shape.top_k))]
            mx.eval(entries)
            for side, call in ceiling_sides(entries, out_dims, in_dims, graph_calls,
                                            what, form).items():
                sides[side], views[side] = call, None
        medians = checked_medians(sides, graph_calls, what, views, ncu)
        if medians is None:
            continue
        rows_out += result_rows(name, tokens, projection, out_dims, in_dims, shape, active,
                                medians, touched / (bandwidth * 1e3), busiest, launches,
                                form)
    rows_out.extend(measure_gate_up(shape, name, tokens, plan, active, calls, bandwidth,
                                    tilings if kernel else [], tiles, busiest,
                                    unfused=kernel, sorted_rows=sorted_rows, form=form,
                                    ncu=ncu))
    return rows_out


def measure_gate_up(shape, name: str, tokens: int, plan, active: int, calls: int,
                    bandwidth: float, tilings: list[dict[str, int]], tiles=None,
                    busiest: float = 1.0, unfused: bool = True,
                    sorted_rows: bool = True, form: WeightFormat = WeightFormat(),
                    ncu: bool = False) -> list[dict]:
    """The layer's gate, up and activation from the tokens: the fused launch in
    each tiling (lines "fused" for the default, "fused,gated_tiles=1" ...), the
    unfused kernels ("unfused", default tiling) and MLX's tiled gather_qmm at
    each of `tiles` (`tile_plans`), against MLX's sorted `gather_qmm`
    (`sorted_rows`, as `measure` decides it; else the first of `tiles`); with
    `ncu` under Nsight Compute, no lines."""
    from mlx_moe_plan import _backend, _gpu, moe_gather
    from mlx_moe_plan.kernels import launch

    tiles = tiles or {}
    stream = mx.default_stream(mx.gpu)
    gpu = _gpu.for_backend(_backend.gpu_backend())
    out_dims, in_dims = shape.intermediate, shape.hidden
    most_rows = max([plan.capacity] + [tiled.capacity for tiled, _ in tiles.values()])
    # gate, up and their product are alive together in a call
    graph_calls = calls_within(3 * most_rows * out_dims * 2, calls)
    touched = 2 * active * out_dims * column_bytes(in_dims, form.bits, form.group_size)
    pairs = [[quantized_experts(shape.experts, out_dims, in_dims, form) for _ in range(2)]
             for _ in range(weight_sets_for(touched, graph_calls))]
    x = (mx.random.normal((tokens, in_dims)) * 0.5).astype(getattr(mx, form.dtype))
    mx.eval(x)

    def fused(i, changes=None):
        gate, up = pairs[i % len(pairs)]
        with launch.grouped_qmm_tiling(**(changes or {})):
            return gpu.grouped_qmm(x, *gate, plan.expert_offsets, plan.row_experts,
                                   bits=form.bits, group_size=form.group_size, stream=stream,
                                   row_tokens=plan.row_tokens, up=up)

    def unfused_kernels(i):
        rows = moe_gather(x, plan)
        gate, up = (gpu.grouped_qmm(rows, *matrices, plan.expert_offsets, plan.row_experts,
                                    bits=form.bits, group_size=form.group_size, stream=stream)
                    for matrices in pairs[i % len(pairs)])
        return gate * mx.sigmoid(gate) * up

    def theirs(i, tiled=plan, rhs_indices=plan.row_experts):
        # the sorted single rows are tiles of one row
        rows = moe_gather(x, tiled).reshape(-1, tiled.tile_m, in_dims)
        gate, up = (mx.gather_qmm(rows, *matrices, rhs_indices=rhs_indices, transpose=True,
                                  group_size=form.group_size, bits=form.bits,
                                  sorted_indices=True)
                    for matrices in pairs[i % len(pairs)])
        return (gate * mx.sigmoid(gate) * up).reshape(tiled.capacity, out_dims)

    sides, views = {}, {}
    if sorted_rows:
        sides["gather_qmm"], views["gather_qmm"] = theirs, in_entry_order(plan)
    for tile_m, (tiled, tile_experts) in tiles.items():
        sides[f"mlx,tile_m={tile_m}"] = \
            lambda i, tiled=tiled, tile_experts=tile_experts: theirs(i, tiled, tile_experts)
        views[f"mlx,tile_m={tile_m}"] = in_entry_order(tiled)
    if unfused:
        sides["unfused"], views["unfused"] = unfused_kernels, in_entry_order(plan)
    launches = {}
    for changes in tilings:
        side = "fused" if not changes else f"fused,{tiling_name(changes)}"
        sides[side] = lambda i, changes=changes: fused(i, changes)
        views[side] = in_entry_order(plan)
        launches[side] = launch_text(shape.experts, in_dims, out_dims, plan.capacity, changes,
                                     num_rows=tokens, gated=True, form=form)
    medians = checked_medians(sides, graph_calls, f"{name} T={tokens} gate+up", views, ncu)
    if medians is None:
        return []
    rows = result_rows(name, tokens, "gate+up", out_dims, in_dims, shape, active, medians,
                       touched / (bandwidth * 1e3), busiest, launches, form)
    # The side a layer runs by the backend's rule (GroupedExperts._fuses_gate_up),
    # whose layer line `layer_rows` repeats as the layer's default.
    fuses = gpu.grouped_qmm_fuses(num_experts=shape.experts, in_dims=in_dims, out_dims=out_dims,
                                  capacity=plan.capacity, bits=form.bits,
                                  group_size=form.group_size)
    for row in rows:
        row["layer_default"] = row["tiling"] == ("fused" if fuses else "unfused")
    return rows


def layer_rows(lines: list[dict]) -> list[dict]:
    """The layer's GEMMs, one shape and T's `measure` lines summed: gate and up
    then down, as each side runs them ("layer" lines, TFLOP/s of the three
    projections' work). A kernel tiling's is its fused launch ("fused", or
    "fused,TILING") and its down ("default", or TILING), "unfused" the unfused
    kernels and the default's down, MLX's tiles their gate+up and down; a
    ceiling's, its gate's twice and its down, the same work in dense GEMMs.
    The reference's times and the floors add up alike; the rest is the down's
    line's (the shape's routing). The side the layer runs by its rule (its
    gate+up line's `layer_default`: fused, or unfused where the rule leaves
    gate and up apart) has its layer line twice, the second as "default"."""
    by_side = {(line["projection"], line["tiling"]): line for line in lines}
    first_halves = {}
    for (projection, side), line in by_side.items():
        if projection == "gate+up":
            down = "default" if side in ("fused", "unfused") else side.removeprefix("fused,")
            first_halves[side] = ([line], down)
    for (projection, side), line in by_side.items():
        if projection == "gate" and (side == "qmm_dense" or side.startswith("matmul_")):
            first_halves[side] = ([line, line], side)
    layers = []
    for side, (halves, down_side) in first_halves.items():
        down = by_side.get(("down", down_side))
        if down is None:
            continue
        parts = [*halves, down]
        ours_us = sum(part["ours_us"] for part in parts)
        reference_us = sum(part["gather_qmm_us"] for part in parts)
        # each line's TFLOP/s over its own time gives back its work
        flops = sum(part["tflops"] * part["ours_us"] * 1e6 for part in parts)
        layers.append({**down, "projection": "layer", "tiling": side, "ours_us": ours_us,
                       "gather_qmm_us": reference_us,
                       "floor_us": sum(part["floor_us"] for part in parts),
                       "tflops": flops / ours_us / 1e6,
                       "gather_qmm_tflops": flops / reference_us / 1e6, "launch": ""})
        if halves[0].get("layer_default"):
            layers.append({**layers[-1], "tiling": "default"})
    return layers


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Lines of several processes' runs -> each line's medians, in the first
    run's order: a line is its shape, T, projection and tiling; its times the
    medians over the runs that have it, its TFLOP/s its work over them, and
    `spread` its slowest run's time over its fastest."""
    def key(row):
        return row["shape"], row["tokens"], row["projection"], row["tiling"]

    by_key = {}
    for rows in runs:
        for row in rows:
            by_key.setdefault(key(row), []).append(row)
    merged = []
    for row in runs[0]:
        alike = by_key[key(row)]
        ours = [line["ours_us"] for line in alike]
        line = {**row, "processes": len(alike), "spread": max(ours) / min(ours)}
        for time_key, tflops_key in (("ours_us", "tflops"),
                                     ("gather_qmm_us", "gather_qmm_tflops")):
            work = row[tflops_key] * row[time_key]
            line[time_key] = statistics.median(other[time_key] for other in alike)
            line[tflops_key] = work / line[time_key]
        line["floor_us"] = statistics.median(other["floor_us"] for other in alike)
        merged.append(line)
    return merged


def turned(names: list[str], turn: int) -> list[str]:
    """`names` begun `turn` places on, the ones before after them."""
    turn %= len(names)
    return names[turn:] + names[:turn]


def run_processes(argv: list[str], shapes: list[str], processes: int) -> list[list[dict]]:
    """This command (`argv`, less --processes and --json) in `processes`
    processes one after another, process p's `shapes` `turned` by p (its
    --shapes); each one's lines."""
    child = without_options(argv, ("--processes", "--json", "--shapes"))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(processes):
            out = os.path.join(tmp, f"{p}.json")
            order = ",".join(turned(shapes, p))
            print(f"# process {p + 1} of {processes}: --shapes {order}", flush=True)
            subprocess.run([sys.executable, "-m", "benchmarks.grouped_qmm", *child,
                            "--shapes", order, "--json", out], check=True)
            with open(out) as f:
                runs.append(json.load(f)["rows"])
    return runs


def format_row(row: dict) -> str:
    """A line of the table `main` prints."""
    return (f"{row['shape']:15s} {row['tokens']:4d} {row['projection']:7s} {row['tiling']:18s} "
            f"{row['active_experts']:7d} {row['ours_us']:8.1f} "
            f"{row['gather_qmm_us']:10.1f} {row['floor_us']:6.1f} "
            f"{row['gather_qmm_us'] / row['ours_us']:8.2f}x "
            f"{row['ours_us'] / row['floor_us']:7.1f}x "
            f"{row['tflops']:7.2f} {row['gather_qmm_tflops']:9.2f} "
            f"{row['busiest']:6.2f}x  {row['launch']}")


def write_lines(path: str, argv: list[str], rows: list[dict], **more) -> None:
    """The command (`argv`) and its lines as a JSON file, and `more`."""
    with open(path, "w") as f:
        json.dump({"command": "python -m benchmarks.grouped_qmm " + " ".join(argv),
                   "rows": rows, **more}, f, indent=1)


TABLE_HEADER = (f"{'shape':15s} {'T':>4s} {'proj':7s} {'tiling':18s} {'experts':>7s} "
                f"{'ours us':>8s} {'gather_qmm':>10s} {'floor':>6s} {'vs gather':>9s} "
                f"{'vs floor':>8s} {'TFLOP/s':>7s} {'gather TF':>9s} {'busiest':>7s}  launch")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grouped_qmm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b",
                        help=f"comma list from {', '.join(LAYER_SHAPES)}, or a model of "
                             f"{', '.join(MODELS)} (default: %(default)s)")
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
    parser.add_argument("--mlx-tiles", default="",
                        help="comma list of tile_m for MLX's tiled gather_qmm, the layer's "
                             "GEMM at prefill sizes (16,64) (default: none)")
    parser.add_argument("--skew", type=float, default=0.0,
                        help="routing skew S: experts drawn with probability "
                             "proportional to 1 / (rank + 1) ** S, 0 uniform "
                             "(default: %(default)s)")
    parser.add_argument("--no-sorted", dest="sorted_rows", action="store_false",
                        help="leave out MLX's sorted single rows, minutes at prefill sizes: "
                             "MLX's tiles are the reference, 64 unless --mlx-tiles "
                             "(default: sorted rows, the reference below 65,535 rows)")
    parser.add_argument("--bits", type=int, default=4,
                        help="bits a weight (default: %(default)s)")
    parser.add_argument("--group-size", type=int, default=64,
                        help="weights a quantization group (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="the rows', scales' and biases' dtype: bfloat16 or float16 "
                             "(default: %(default)s)")
    parser.add_argument("--ncu", action="store_true",
                        help="the sides under Nsight Compute instead of timed: each "
                             "side's one call after a marker kernel of its own (run under ncu "
                             "--profile-from-start off)")
    parser.add_argument("--sides", default="kernel,ceilings",
                        help="comma list of the sides timed beside MLX's gather_qmm: kernel "
                             "(the package's, each tiling, and gate+up unfused), ceilings "
                             "(MLX's dense matmul_bf16 and qmm_dense of the same work) "
                             "(default: %(default)s)")
    parser.add_argument("--processes", type=int, default=1,
                        help="run in N processes, the shapes' order turned by one each, and "
                             "print each line's medians (default: %(default)s)")
    parser.add_argument("--json", default=None,
                        help="write the lines (with --processes, their medians and each "
                             "process's) to this file (default: none)")
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error(f"--processes: at least 1, got {args.processes}")
    if args.processes > 1 and args.ncu:
        parser.error("--processes: times the sides, which --ncu does not")
    tilings = parse_tilings(args.tilings)
    mlx_tiles = [int(m) for m in args.mlx_tiles.split(",") if m.strip()]
    sides = {side.strip() for side in args.sides.split(",") if side.strip()}
    if not sides <= {"kernel", "ceilings"}:
        parser.error(f"--sides: expected kernel and/or ceilings, got {args.sides}")
    from mlx_moe_plan.kernels import launch

    if args.bits not in launch.GROUPED_QMM_BITS:
        parser.error(f"--bits: one of {launch.GROUPED_QMM_BITS}, got {args.bits}")
    if args.group_size not in launch.GROUPED_QMM_QUANT_GROUPS:
        parser.error(f"--group-size: one of {launch.GROUPED_QMM_QUANT_GROUPS}, "
                     f"got {args.group_size}")
    if args.dtype not in launch.GROUPED_QMM_DTYPES:
        parser.error(f"--dtype: one of {launch.GROUPED_QMM_DTYPES}, got {args.dtype}")
    form = WeightFormat(args.bits, args.group_size, args.dtype)
    if args.processes > 1:  # this process only starts the others and merges their lines
        runs = run_processes(argv, args.shapes.split(","), args.processes)
        rows = median_rows(runs)
        print(f"# {form.bits}-bit weights in groups of {form.group_size}, {form.dtype} rows; "
              f"medians of {args.processes} processes")
        print(TABLE_HEADER)
        for row in rows:
            print(format_row(row))
        widest = max(rows, key=lambda row: row["spread"], default=None)
        if widest is not None:
            print(f"# the widest spread of a line's processes: {widest['spread']:.2f}x "
                  f"({widest['shape']} T = {widest['tokens']} {widest['projection']} "
                  f"{widest['tiling']})")
        if args.json:
            write_lines(args.json, argv, rows, per_process=runs)
        return 0
    if mx.default_device().type != mx.gpu:
        raise SystemExit("benchmarks.grouped_qmm times a GPU kernel: this MLX has no GPU device")
    print(f"# {form.bits}-bit weights in groups of {form.group_size}, {form.dtype} rows")
    print(TABLE_HEADER)
    rows = []
    for name in args.shapes.split(","):
        # MLX quantizes whole groups of a row only (gpt-oss-20b's 2880 in 128s)
        uneven = sorted({in_dims for _, in_dims in projections(shape_of(name)).values()
                         if in_dims % form.group_size})
        if uneven:
            print(f"# {name}: rows of {', '.join(map(str, uneven))} values are not whole "
                  f"groups of {form.group_size}: not measured", flush=True)
            continue
        for tokens in (int(t) for t in args.tokens.split(",")):
            lines = measure(name, tokens, args.calls, args.bandwidth, tilings,
                            mlx_tiles=mlx_tiles, skew=args.skew, sorted_rows=args.sorted_rows,
                            kernel="kernel" in sides, ceilings="ceilings" in sides, form=form,
                            ncu=args.ncu)
            for row in lines + layer_rows(lines):
                print(format_row(row), flush=True)
                rows.append(row)
    if args.json:
        write_lines(args.json, argv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
