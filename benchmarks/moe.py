"""Benchmark of plan, gather, combine and unsort against the path mlx-lm uses today.

    python -m benchmarks.moe                 # quick: Qwen3-Next shape, T = 128 and 2048
    python -m benchmarks.moe --full          # every model shape, T = 128 ... 16384
    python -m benchmarks.moe --shapes mixtral,deepseek-v3 --tokens 512,4096 --json out.json
    python -m benchmarks.moe --layer         # the MoE layer end to end (benchmarks/layer.py)

Runs on MLX's default device (CPU, Metal or CUDA). First it checks every op
bit for bit against `mlx_moe_plan.reference` (and that the mlx-lm path it times
computes the same thing), then times it. The peer is `mlx_lm.models.switch_layers`:

- plan vs mlx-lm's index work: the index ops of `_gather_sort`, reproduced
  exactly (`argsort` of the flat ids, `argsort` of that order, the ids taken in
  that order); the row take of `_gather_sort` is timed under gather.
- gather (`tile_m=1`, so both make T*K rows) vs `_gather_sort`'s row take,
  `x.flatten(0, -3)[order // K]`, and vs a copy of the same bytes.
- combine vs `_scatter_unsort` followed by the model's weighted sum
  `(y * scores[..., None]).sum(axis=-2)`.
- unsort vs `_scatter_unsort`.

Routing is random but shaped like a real router: top-K of random logits by
`mx.argpartition` (K distinct experts per token), softmax weights over them in
the activation dtype. Both paths get the same int32 ids, cast once outside the
timed region. Times are medians over repeats of one graph of many calls
(`benchmarks.timing`); ratios compare figures measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

import mlx_moe_plan
from mlx_moe_plan import reference
from mlx_moe_plan.kernels import launch as geometry

from .timing import Timing, time_calls

try:
    import mlx_lm
    from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort
except ImportError as error:  # optional: without it only ours and the copy are timed
    mlx_lm = None
    MLX_LM_MISSING = f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class Model:
    name: str
    experts: int
    top_k: int
    hidden: int  # the model's own hidden size, used with --hidden model


MODELS = {
    "qwen3-next": Model("qwen3-next", 512, 10, 2048),
    "qwen3-30b-a3b": Model("qwen3-30b-a3b", 128, 8, 2048),
    "deepseek-v3": Model("deepseek-v3", 256, 8, 7168),
    "mixtral": Model("mixtral", 8, 2, 4096),
}
FULL_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_SHAPES = ("qwen3-next",)
QUICK_TOKENS = (128, 2048)
DEFAULT_HIDDEN = 2560
SMALL_TOKENS = 37  # the small check: an odd token count, a few skipped and invalid ids

# The targets, at one shape.
HEADLINE = {"model": "qwen3-next", "tokens": 2048, "hidden": 2560, "dtype": "float16"}
CPU_SPEEDUP_TARGETS = {"plan": 10.0, "gather": 4.0, "combine": 4.0}
GPU_PLAN_US_TARGET = 15.0
GPU_GATHER_COPY_TARGET = 0.80

LEGEND = {
    "MB, GB/s": "bytes read once + written once, the same count for ours and mlx-lm: plan 16*T*K "
                "(int32 ids in; order, inverse, sorted ids out), gather, unsort, copy 2*T*K*H*size, "
                "combine (T*K + T)*H*size",
    "mlx-lm": "plan = argsort, argsort, take of ids (_gather_sort's index ops); "
              "gather = its row take x[order // K]; combine = _scatter_unsort + "
              "(y * scores[..., None]).sum(-2); unsort = _scatter_unsort",
    "copy": "MLX's contiguous copy (mx.array(rows)) of the gather's bytes; "
            "%copy = ours GB/s / copy GB/s",
}
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
OPS = ("plan", "gather", "combine", "unsort", "copy")


# ---------------------------------------------------------------- progress


class Progress:
    """A one-line counter on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.width = 0

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        text = f"[{self.done:>{len(str(self.total))}}/{self.total}] {time.perf_counter() - self.start:6.1f}s  {label}"
        if self.tty:
            sys.stderr.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()


# ---------------------------------------------------------------- data


def routing(tokens: int, model: Model, dtype) -> tuple[mx.array, mx.array]:
    """Random router output: int32 ids `[T, K]` (K distinct experts per token), weights."""
    logits = mx.random.normal((tokens, model.experts))
    picked = mx.argpartition(logits, kth=-model.top_k, axis=-1)[..., -model.top_k :]
    scores = mx.softmax(mx.take_along_axis(logits, picked, axis=-1), axis=-1, precise=True)
    return picked.astype(mx.int32), scores.astype(dtype)


def _bits_dtype(dtype):
    return mx.uint32 if dtype == mx.float32 else mx.uint16


def variant(base: mx.array, layer: int) -> mx.array:
    """A distinct copy of `base` for each layer: low mantissa bits flipped.

    Cheaper than drawing new random numbers on a CPU; the exponent is never
    touched, so values stay finite and no value becomes zero.
    """
    bits = base.view(_bits_dtype(base.dtype))
    return (bits ^ ((layer * 37 + 1) & 0x3F)).view(base.dtype)


def random_values(shape, dtype) -> mx.array:
    return mx.random.uniform(-1.0, 1.0, shape).astype(dtype)


def copy_op(rows: mx.array) -> mx.array:
    """An honest copy: reads every byte of `rows` once and writes it once.

    `mx.array(rows)` records an `AsType` to the same dtype, which MLX evaluates
    with its plain contiguous copy (memcpy on the CPU, its vectorized copy
    kernel on a GPU). The obvious spellings are free instead: `astype` to the
    same dtype and `contiguous` of a contiguous array return their input.
    """
    return mx.array(rows)


def mlx_lm_index_work(ids: mx.array):
    """The index ops of `_gather_sort`, exactly, without its row take."""
    flat = ids.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    return order, flat[order], inv_order


def mlx_lm_take(x: mx.array, order: mx.array, top_k: int) -> mx.array:
    """`_gather_sort`'s row take, on `x` shaped as `SwitchGLU` shapes it."""
    x = mx.expand_dims(x, (-2, -3))
    return x.flatten(0, -3)[order // top_k]


def mlx_lm_unsort(rows: mx.array, inv_order: mx.array, shape) -> mx.array:
    """`SwitchGLU`'s tail: `_scatter_unsort` of the `[T*K, 1, H]` rows, then squeeze."""
    return _scatter_unsort(rows[:, None, :], inv_order, shape).squeeze(-2)


def mlx_lm_combine(rows: mx.array, inv_order: mx.array, scores: mx.array) -> mx.array:
    """`_scatter_unsort`, then the weighted sum the model applies to `SwitchGLU`'s output."""
    y = mlx_lm_unsort(rows, inv_order, scores.shape)
    return (y * scores[..., None]).sum(axis=-2)


def plan_outputs(plan) -> list[mx.array]:
    """Everything the plan computes: its kernel's (or primitive's) outputs. The
    fields are views of them, made when read (about 1.4 us a view on the H200,
    `python -m benchmarks.dispatch`), and each op that reads one pays for it."""
    return list(plan.outputs)


# ---------------------------------------------------------------- checks


class CheckError(Exception):
    pass


def to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a)


def _raw(a: np.ndarray) -> np.ndarray:
    """Floats as their bits, so that the comparison is bitwise (NaN payloads, -0)."""
    a = np.asarray(a)
    if a.dtype.kind == "f":
        return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])
    return a


def expect_equal(what: str, got, want) -> None:
    got, want = _raw(got), _raw(want)
    if got.shape != want.shape:
        raise CheckError(f"{what}: shape {got.shape}, reference {want.shape}")
    if got.dtype.itemsize != want.dtype.itemsize:
        raise CheckError(f"{what}: {got.dtype.itemsize}-byte elements, reference {want.dtype.itemsize}")
    bad = np.flatnonzero(got.ravel() != want.ravel())
    if bad.size:
        first = int(bad[0])
        where = np.unravel_index(first, got.shape) if got.ndim else ()
        raise CheckError(
            f"{what}: {bad.size} of {got.size} values differ from the reference; first at "
            f"{tuple(int(i) for i in where)}: got {got.ravel()[first]!r}, want {want.ravel()[first]!r}"
        )


def check_plan(what: str, plan, ref) -> None:
    for field in ("row_tokens", "row_experts", "row_entries", "positions",
                  "expert_counts", "expert_offsets", "tile_experts"):
        expect_equal(f"{what} plan.{field}", to_numpy(getattr(plan, field)), getattr(ref, field))
    if ref.row_weights is not None:
        expect_equal(f"{what} plan.row_weights", to_numpy(plan.row_weights), ref.row_weights)
    for field in ("num_rows", "num_tiles", "num_invalid"):
        got, want = int(getattr(plan, field).item()), getattr(ref, field)
        if got != want:
            raise CheckError(f"{what} plan.{field}: got {got}, want {want}")
    for field in ("capacity", "max_tiles", "top_k", "tile_m", "num_experts"):
        if getattr(plan, field) != getattr(ref, field):
            raise CheckError(f"{what} plan.{field}: got {getattr(plan, field)}, want {getattr(ref, field)}")


def dtype_name(dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def check_case(model: Model, tokens: int, hidden: int, *, tile_m: int, edge_ids: bool,
               dtypes, conversions, plan_weights: bool, weights_dtype=mx.float16) -> None:
    """One check: plan, gather, combine, unsort against the reference, bit for bit."""
    what = f"[{model.name} T={tokens} H={hidden} tile_m={tile_m}]"
    ids, scores = routing(tokens, model, weights_dtype)
    if edge_ids and ids.size >= 3:  # a skipped entry (-1), an invalid one (>= E)
        flat = np.array(ids).reshape(-1)
        flat[[0, flat.size // 2]] = -1
        flat[-1] = model.experts
        ids = mx.array(flat.reshape(ids.shape))
    ids_np, weights_np = np.array(ids), np.array(scores.astype(mx.float32))

    plan = mlx_moe_plan.moe_plan(ids, model.experts, weights=scores if plan_weights else None,
                                 tile_m=tile_m)
    ref = reference.moe_plan(ids_np, model.experts, weights=weights_np if plan_weights else None,
                             tile_m=tile_m)
    check_plan(what, plan, ref)

    x_base = random_values((tokens, hidden), mx.float32)
    rows_base = random_values((plan.capacity, hidden), mx.float32)
    for src, dst in [(d, d) for d in dtypes] + list(conversions):
        x = x_base.astype(src)
        got = mlx_moe_plan.moe_gather(x, plan, dtype=dst)
        want = reference.moe_gather(to_numpy(x), ref, dtype=dtype_name(dst), x_dtype=dtype_name(src))
        expect_equal(f"{what} gather {dtype_name(src)} -> {dtype_name(dst)}", to_numpy(got), want)
    for dtype in dtypes:
        rows = rows_base.astype(dtype)
        rows_np = to_numpy(rows)
        if plan_weights:
            got = mlx_moe_plan.moe_combine(rows, plan)
            want = reference.moe_combine(rows_np, ref, rows_dtype=dtype_name(dtype))
        else:  # as timed: the plan carries no weights, combine gets the router's
            got = mlx_moe_plan.moe_combine(rows, plan, weights=scores)
            want = reference.moe_combine(rows_np, ref, weights=weights_np, rows_dtype=dtype_name(dtype))
        expect_equal(f"{what} combine {dtype_name(dtype)}", to_numpy(got), want)
        got = mlx_moe_plan.moe_unsort(rows, plan)
        expect_equal(f"{what} unsort {dtype_name(dtype)}", to_numpy(got), reference.moe_unsort(rows_np, ref))


def check_peer(model: Model, tokens: int, hidden: int, dtype) -> None:
    """The mlx-lm path timed here does the same work as ours (and as mlx-lm itself)."""
    what = f"[{model.name} T={tokens} H={hidden}] mlx-lm path"
    ids, scores = routing(tokens, model, dtype)
    x = random_values((tokens, hidden), dtype)
    plan = mlx_moe_plan.moe_plan(ids, model.experts)
    order, sorted_ids, inv_order = mlx_lm_index_work(ids)

    # Our reproduction of `_gather_sort` is exact.
    taken, idx, inv = _gather_sort(mx.expand_dims(x, (-2, -3)), ids)
    expect_equal(f"{what}: index work vs _gather_sort ids", np.array(sorted_ids), np.array(idx))
    expect_equal(f"{what}: index work vs _gather_sort inverse", np.array(inv_order), np.array(inv))
    expect_equal(f"{what}: take vs _gather_sort rows", to_numpy(mlx_lm_take(x, order, model.top_k)),
                 to_numpy(taken))
    # Both sort the same entries: the same expert per row.
    expect_equal(f"{what}: sorted ids vs plan.row_experts", np.array(sorted_ids).astype(np.int32),
                 to_numpy(plan.row_experts))
    # Rows in mlx-lm's order are ours permuted (argsort need not be stable).
    ours_in_their_order = mlx_moe_plan.moe_gather(x, plan)[plan.positions.reshape(-1)[order]]
    expect_equal(f"{what}: take vs moe_gather", to_numpy(mlx_lm_take(x, order, model.top_k))[:, 0],
                 to_numpy(ours_in_their_order))
    rows = random_values((plan.capacity, hidden), dtype)
    their_rows = rows[plan.positions.reshape(-1)[order]]
    expect_equal(f"{what}: _scatter_unsort vs moe_unsort",
                 to_numpy(mlx_lm_unsort(their_rows, inv_order, ids.shape)),
                 to_numpy(mlx_moe_plan.moe_unsort(rows, plan)))
    theirs = np.array(mlx_lm_combine(their_rows, inv_order, scores).astype(mx.float32))
    ours = np.array(mlx_moe_plan.moe_combine(rows, plan, weights=scores).astype(mx.float32))
    if not np.allclose(theirs, ours, rtol=2e-2, atol=2e-2):
        worst = float(np.max(np.abs(theirs - ours)))
        raise CheckError(f"{what}: unsort + weighted sum differs from moe_combine by up to {worst}")


# ---------------------------------------------------------------- timing


def bytes_moved(op: str, tokens: int, top_k: int, hidden: int, itemsize: int) -> int:
    """Bytes read once plus bytes written once, the same for every implementation."""
    entries = tokens * top_k
    if op == "plan":  # int32 ids in; row order, its inverse, sorted ids out
        return 4 * entries * 4
    if op in ("gather", "unsort", "copy"):  # every row read once and written once
        return 2 * entries * hidden * itemsize
    if op == "combine":  # T*K rows in, T rows out (weights left out: K values a token)
        return (entries + tokens) * hidden * itemsize
    raise ValueError(op)


def memory_budget(override_gb: float | None) -> int:
    if override_gb is not None:
        return int(override_gb * 2**30)
    info = {}
    try:
        info = mx.device_info()
    except Exception:  # an older MLX: fall back to the host's memory
        pass
    total = info.get("memory_size") or info.get("total_memory")
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 16 * 2**30
    cap = 32 * 2**30 if mx.default_device().type == mx.gpu else 4 * 2**30
    return int(min(cap, total // 4))


@dataclass
class Settings:
    calls: int | None
    on_gpu: bool
    repeats: int | None
    min_repeats: int
    max_repeats: int
    target_s: float
    warmup: int
    budget: int


def measure_config(model: Model, tokens: int, hidden: int, dtype, settings: Settings,
                   progress: Progress) -> list[dict]:
    """Time every op at one shape; one result dict per (op, implementation)."""
    top_k, itemsize = model.top_k, mx.zeros((), dtype).itemsize
    entries = tokens * top_k
    index_calls = settings.calls or 48
    # On a CPU only 4: MLX keeps no CPU buffer cache, so outputs that one graph
    # holds together each take fresh pages (page faults a model would not pay
    # below glibc's mmap threshold); 4 outputs recycle, as a model's layers do.
    data_calls = settings.calls or (48 if settings.on_gpu else 4)
    # A call's rows (its input, output and up to two intermediates of the
    # mlx-lm combine) must fit the memory budget.
    per_call = 4 * entries * hidden * itemsize + tokens * hidden * itemsize
    data_calls = max(1, min(data_calls, settings.budget // per_call))

    layers = [routing(tokens, model, dtype) for _ in range(max(index_calls, data_calls))]
    ids = [layer[0] for layer in layers]
    scores = [layer[1] for layer in layers]
    mx.eval(ids, scores)
    x_base = random_values((tokens, hidden), dtype)
    rows_base = random_values((entries, hidden), dtype)
    xs = [variant(x_base, i) for i in range(data_calls)]
    rows = [variant(rows_base, i) for i in range(data_calls)]
    mx.eval(xs, rows)
    del x_base, rows_base
    plans = [mlx_moe_plan.moe_plan(ids[i], model.experts) for i in range(data_calls)]
    mx.eval([plan_outputs(p) for p in plans])
    if mlx_lm is not None:
        peer = [mlx_lm_index_work(ids[i]) for i in range(data_calls)]
        mx.eval(peer)
        orders = [p[0] for p in peer]
        inv_orders = [p[2] for p in peer]

    E = model.experts
    cases = [
        ("plan", "ours", index_calls, lambda i: plan_outputs(mlx_moe_plan.moe_plan(ids[i], E))),
        ("plan", "mlx-lm", index_calls, lambda i: mlx_lm_index_work(ids[i])),
        ("gather", "ours", data_calls, lambda i: mlx_moe_plan.moe_gather(xs[i], plans[i])),
        ("gather", "mlx-lm", data_calls, lambda i: mlx_lm_take(xs[i], orders[i], top_k)),
        ("copy", "copy", data_calls, lambda i: copy_op(rows[i])),
        ("combine", "ours", data_calls,
         lambda i: mlx_moe_plan.moe_combine(rows[i], plans[i], weights=scores[i])),
        ("combine", "mlx-lm", data_calls, lambda i: mlx_lm_combine(rows[i], inv_orders[i], scores[i])),
        ("unsort", "ours", data_calls, lambda i: mlx_moe_plan.moe_unsort(rows[i], plans[i])),
        ("unsort", "mlx-lm", data_calls, lambda i: mlx_lm_unsort(rows[i], inv_orders[i], ids[i].shape)),
    ]
    results = []
    for op, impl, calls, call in cases:
        if impl == "mlx-lm" and mlx_lm is None:
            continue
        progress.step(f"{model.name} T={tokens} H={hidden}: {op} ({impl}), {calls} calls a graph")
        timing: Timing = time_calls(
            call, calls, warmup=settings.warmup, repeats=settings.repeats,
            min_repeats=settings.min_repeats, max_repeats=settings.max_repeats,
            target_s=settings.target_s,
        )
        moved = bytes_moved(op, tokens, top_k, hidden, itemsize)
        results.append({
            "model": model.name, "experts": E, "top_k": top_k, "hidden": hidden,
            "tokens": tokens, "dtype": dtype_name(dtype), "op": op, "impl": impl,
            "median_us": timing.median_s * 1e6, "min_us": timing.min_s * 1e6,
            "build_us": timing.build_median_s * 1e6, "bytes": moved,
            "gbps": moved / timing.median_s / 1e9, "calls": timing.calls,
            "repeats": timing.repeats, "warmup": timing.warmup,
            "page_faults": statistics.median(timing.faults),
            "samples_us": [s * 1e6 for s in timing.eval_s],
        })
    mx.clear_cache()
    return results


# ---------------------------------------------------------------- report


def find(results, op, impl, **where):
    for r in results:
        if r["op"] == op and r["impl"] == impl and all(r[k] == v for k, v in where.items()):
            return r
    return None


def summarize(results: list[dict]) -> list[dict]:
    """One row per (shape, op): ours, mlx-lm, the speedup, the fraction of copy bandwidth."""
    rows = []
    configs = sorted({(r["model"], r["hidden"], r["tokens"], r["dtype"]) for r in results},
                     key=lambda c: (list(MODELS).index(c[0]), c[1], c[2]))
    for model, hidden, tokens, dtype in configs:
        where = {"model": model, "hidden": hidden, "tokens": tokens, "dtype": dtype}
        copy = find(results, "copy", "copy", **where)
        for op in OPS:
            ours = find(results, op, "copy" if op == "copy" else "ours", **where)
            if ours is None:
                continue
            theirs = find(results, op, "mlx-lm", **where)
            row = {**where, "experts": ours["experts"], "top_k": ours["top_k"], "op": op,
                   "ours_us": ours["median_us"], "ours_gbps": ours["gbps"], "bytes": ours["bytes"],
                   "mlx_lm_us": theirs["median_us"] if theirs else None,
                   "mlx_lm_gbps": theirs["gbps"] if theirs else None,
                   "speedup": theirs["median_us"] / ours["median_us"] if theirs else None,
                   "of_copy": None}
            if op in ("gather", "unsort") and copy is not None:
                row["of_copy"] = ours["gbps"] / copy["gbps"]
            rows.append(row)
    return rows


def format_mb(nbytes: int) -> str:
    mb = nbytes / 1e6
    return f"{mb:.0f}" if mb >= 100 else f"{mb:.2f}" if mb >= 1 else f"{mb:.3g}"


def format_table(rows: list[dict]) -> str:
    head = (f"{'model':<14}{'E':>4}{'K':>4}{'H':>6}{'T':>7}  {'op':<8}"
            f"{'us/call':>11}{'MB':>9}{'GB/s':>8}{'mlx-lm us':>12}{'GB/s':>8}{'speedup':>9}{'%copy':>7}")
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        config = (r["model"], r["hidden"], r["tokens"])
        if last is not None and config != last:
            lines.append("")
        last = config
        peer_us = f"{r['mlx_lm_us']:12.1f}" if r["mlx_lm_us"] is not None else f"{'-':>12}"
        peer_gbps = f"{r['mlx_lm_gbps']:8.1f}" if r["mlx_lm_gbps"] is not None else f"{'-':>8}"
        speedup = f"{r['speedup']:8.2f}x" if r["speedup"] is not None else f"{'-':>9}"
        of_copy = f"{100 * r['of_copy']:6.0f}%" if r["of_copy"] is not None else f"{'':>7}"
        lines.append(
            f"{r['model']:<14}{r['experts']:>4}{r['top_k']:>4}{r['hidden']:>6}{r['tokens']:>7}  "
            f"{r['op']:<8}{r['ours_us']:11.1f}{format_mb(r['bytes']):>9}{r['ours_gbps']:8.1f}"
            f"{peer_us}{peer_gbps}{speedup}{of_copy}"
        )
    return "\n".join(lines)


def targets(rows: list[dict], on_gpu: bool) -> tuple[list[dict], str]:
    where = dict(HEADLINE)
    model = MODELS[where["model"]]
    title = (f"targets at the headline shape ({model.name} E={model.experts} K={model.top_k}, "
             f"H={where['hidden']}, T={where['tokens']}, {where['dtype']}), "
             f"{'GPU' if on_gpu else 'CPU'}; information, not an assertion:")

    def row(op):
        return next((r for r in rows if r["op"] == op and r["model"] == where["model"]
                     and r["hidden"] == where["hidden"] and r["tokens"] == where["tokens"]
                     and r["dtype"] == where["dtype"]), None)

    if row("plan") is None:
        return [], title.split(";")[0] + ": not in this run"
    found = []
    if on_gpu:
        plan, gather = row("plan"), row("gather")
        found.append({"name": "plan us/call", "value": plan["ours_us"], "target": f"<= {GPU_PLAN_US_TARGET:g} us",
                      "pass": plan["ours_us"] <= GPU_PLAN_US_TARGET, "text": f"{plan['ours_us']:.1f} us"})
        if gather and gather["of_copy"] is not None:
            found.append({"name": "gather GB/s / copy GB/s", "value": gather["of_copy"],
                          "target": f">= {100 * GPU_GATHER_COPY_TARGET:.0f}%",
                          "pass": gather["of_copy"] >= GPU_GATHER_COPY_TARGET,
                          "text": f"{100 * gather['of_copy']:.0f}%"})
        for op in ("plan", "gather", "combine"):  # informative on a GPU
            r = row(op)
            if r and r["speedup"] is not None:
                found.append({"name": f"{op} vs mlx-lm", "value": r["speedup"], "target": None,
                              "pass": None, "text": f"{r['speedup']:.2f}x"})
    else:
        names = {"plan": "plan vs mlx-lm index work", "gather": "gather vs mlx-lm take",
                 "combine": "combine vs unsort + weighted sum"}
        for op, goal in CPU_SPEEDUP_TARGETS.items():
            r = row(op)
            ok = None if r is None or r["speedup"] is None else r["speedup"] >= goal
            text = "n/a (mlx-lm not installed)" if ok is None else f"{r['speedup']:.2f}x"
            found.append({"name": names[op], "value": None if ok is None else r["speedup"],
                          "target": f">= {goal:g}x", "pass": ok, "text": text})
        gather = row("gather")
        if gather and gather["of_copy"] is not None:
            found.append({"name": "gather GB/s / copy GB/s", "value": gather["of_copy"], "target": None,
                          "pass": None, "text": f"{100 * gather['of_copy']:.0f}%"})
    lines = [title]
    for t in found:
        verdict = "" if t["pass"] is None else ("PASS" if t["pass"] else "MISS")
        goal = f"(target {t['target']})" if t["target"] else ""
        lines.append(f"  {t['name']:<34}{t['text']:>12}  {goal:<20}{verdict}")
    return found, "\n".join(lines)


def page_fault_note(results: list[dict], on_gpu: bool) -> str | None:
    """On a CPU, say when fresh output pages bound the data ops (MLX keeps no CPU buffer cache)."""
    copies = [r for r in results if r["op"] == "copy"]
    if on_gpu or not copies:
        return None
    big = max(copies, key=lambda r: r["bytes"])
    try:
        page = os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        page = 4096
    out_pages = big["bytes"] / 2 / page
    if big["page_faults"] < 0.5 * out_pages:
        return None
    return (f"the copy at T={big['tokens']} takes {big['page_faults']:.0f} page faults a call "
            f"({big['page_faults'] / out_pages:.0%} of its output's pages): MLX's CPU allocator hands "
            f"large outputs fresh memory, so first-touch faults bound ours, mlx-lm and the copy alike")


def device_description() -> dict:
    device = mx.default_device()
    info = {}
    try:
        info = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    except Exception:
        pass
    return {"device": str(device), "type": "gpu" if device.type == mx.gpu else "cpu",
            "name": info.get("device_name", platform.processor() or platform.machine()),
            "info": info, "cpu_count": os.cpu_count()}


# ---------------------------------------------------------------- main


def parse_list(text: str, convert, what: str):
    try:
        values = [convert(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{what}: {error}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{what}: empty list")
    return values


def model_list(text: str):
    names = parse_list(text, str, "--shapes")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown shape(s) {unknown}; choose from {', '.join(MODELS)}")
    return names


def token_list(text: str):
    values = parse_list(text, int, "--tokens")
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("--tokens: every T must be at least 1")
    return values


def hidden_arg(text: str):
    if text == "model":
        return text
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("--hidden: must be at least 1 or 'model'")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.moe",
        description="Check mlx_moe_plan's ops against the NumPy reference, then time them "
                    "against mlx-lm's switch_layers path and a copy of the same bytes.",
    )
    parser.add_argument("--full", action="store_true",
                        help=f"every model shape ({', '.join(MODELS)}) and T in {', '.join(map(str, FULL_TOKENS))}")
    parser.add_argument("--shapes", type=model_list, help=f"comma list from {', '.join(MODELS)}")
    parser.add_argument("--tokens", type=token_list, help="comma list of token counts T")
    parser.add_argument("--hidden", type=hidden_arg, default=DEFAULT_HIDDEN,
                        help=f"hidden size H for every shape, or 'model' for each model's own "
                             f"(default {DEFAULT_HIDDEN})")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float16",
                        help="activation dtype (default float16)")
    parser.add_argument("--calls", type=int,
                        help="calls built into one graph, each on its own inputs (default 48; "
                             "4 for gather, combine, unsort on a CPU; fewer where memory is short)")
    parser.add_argument("--repeats", type=int, help="timed graph evaluations (default: by time)")
    parser.add_argument("--mem-gb", type=float,
                        help="memory for one graph's inputs and outputs "
                             "(default a quarter of the device's, at most 32 GiB on a GPU, 4 on a CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan-max-groups", type=int, metavar="N",
                        help="the GPU plan's cap on groups, past which each group places "
                             f"several blocks (default {geometry.PLAN_MAX_GROUPS}; kernels/launch.py)")
    parser.add_argument("--json", metavar="PATH", help="write every result, with the environment, as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    args = parser.parse_args(argv)
    if args.calls is not None and args.calls < 1:
        parser.error("--calls: must be at least 1")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats: must be at least 1")
    if args.plan_max_groups is not None and args.plan_max_groups < 1:
        parser.error("--plan-max-groups: must be at least 1")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--layer" in argv:  # the layer end to end: benchmarks/layer.py
        from . import layer

        return layer.main([a for a in argv if a != "--layer"])
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "benchmarks.moe", *(sys.argv[1:] if argv is None else argv)])
    on_gpu = mx.default_device().type == mx.gpu
    shapes = args.shapes or (list(MODELS) if args.full else list(QUICK_SHAPES))
    tokens = args.tokens or (list(FULL_TOKENS) if args.full else list(QUICK_TOKENS))
    dtype = DTYPES[args.dtype]
    settings = Settings(
        calls=args.calls, on_gpu=on_gpu, repeats=args.repeats,
        min_repeats=5, max_repeats=100 if on_gpu else 30,
        target_s=0.3 if on_gpu else 0.5, warmup=2 if on_gpu else 1,
        budget=memory_budget(args.mem_gb),
    )
    mx.random.seed(args.seed)
    notes = []
    if args.plan_max_groups is not None:
        geometry.PLAN_MAX_GROUPS = args.plan_max_groups
        notes.append(f"the GPU plan's groups capped at {args.plan_max_groups}")
    if mlx_lm is None:
        notes.append("mlx-lm's switch_layers path cannot be imported "
                     f"({MLX_LM_MISSING}; pip install mlx-lm): only ours and the copy are timed")
        print(f"note: {notes[-1]}", file=sys.stderr)

    def hidden_of(model):
        return model.hidden if args.hidden == "model" else args.hidden

    # The check at the benchmark shape uses the selected T nearest the headline's.
    check_tokens = min(tokens, key=lambda t: (abs(t - HEADLINE["tokens"]), t))
    n_steps = len(shapes) * (3 if mlx_lm else 2) + len(shapes) * len(tokens) * (9 if mlx_lm else 5)
    progress = Progress(n_steps, enabled=not args.no_progress)
    started = time.perf_counter()

    checks = []
    try:
        for name in shapes:
            model, hidden = MODELS[name], hidden_of(MODELS[name])
            progress.step(f"check {name} T={SMALL_TOKENS} H={hidden}: dtypes, tile_m 1 and 8, -1 and invalid ids")
            for tile_m in (1, 8):
                check_case(model, SMALL_TOKENS, hidden, tile_m=tile_m, edge_ids=True,
                           dtypes=list(DTYPES.values()),
                           conversions=[(mx.float32, mx.float16), (mx.float32, mx.bfloat16)],
                           plan_weights=True)
            checks.append({"model": name, "tokens": SMALL_TOKENS, "hidden": hidden, "tile_m": [1, 8],
                           "dtypes": list(DTYPES), "ok": True})
            progress.step(f"check {name} T={check_tokens} H={hidden} {args.dtype}, as timed")
            check_case(model, check_tokens, hidden, tile_m=1, edge_ids=False, dtypes=[dtype],
                       conversions=[], plan_weights=False, weights_dtype=dtype)
            checks.append({"model": name, "tokens": check_tokens, "hidden": hidden, "tile_m": [1],
                           "dtypes": [args.dtype], "ok": True})
            if mlx_lm is not None:
                progress.step(f"check the mlx-lm path for {name} T={SMALL_TOKENS}")
                check_peer(model, SMALL_TOKENS, hidden, dtype)
                checks.append({"model": name, "tokens": SMALL_TOKENS, "hidden": hidden,
                               "peer": "mlx-lm", "ok": True})
    except CheckError as error:
        progress.close()
        print(f"CHECK FAILED on {mx.default_device()}: {error}\nNothing was timed.", file=sys.stderr)
        return 1
    except ImportError as error:  # the extension is not built
        progress.close()
        print(f"cannot run mlx_moe_plan: {error}", file=sys.stderr)
        return 2

    results = []
    for name in shapes:
        model = MODELS[name]
        for t in tokens:
            results.extend(measure_config(model, t, hidden_of(model), dtype, settings, progress))
    progress.close()
    elapsed = time.perf_counter() - started

    rows = summarize(results)
    fault_note = page_fault_note(results, on_gpu)
    if fault_note:
        notes.append(fault_note)
    found, targets_text = targets(rows, on_gpu)
    device = device_description()
    hidden_rule = ("each model's own hidden size" if args.hidden == "model"
                   else f"H = {args.hidden} for every shape")
    header = [
        f"mlx_moe_plan benchmark on {device['device']} ({device['name']}), mlx {mx.__version__}, "
        f"mlx-lm {mlx_lm.__version__ if mlx_lm else 'not installed'}",
        f"{args.dtype} activations, {hidden_rule}, random top-K routing; "
        f"{len(checks)} checks bit for bit against mlx_moe_plan.reference passed; {elapsed:.0f} s",
        "us/call, GB/s: ours (the copy's on copy rows); mlx-lm us, GB/s: the peer; "
        "speedup = mlx-lm us / ours us",
        "  each time: the median over repeats of one mx.eval of a graph of many calls on distinct inputs",
        *(f"{key}: {text}" for key, text in LEGEND.items()),
    ]
    for note in notes:
        header.append(f"note: {note}")

    if args.json:
        document = {
            "benchmark": "benchmarks.moe", "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device, "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__ if mlx_lm else None,
            "python": platform.python_version(), "platform": platform.platform(),
            "dtype": args.dtype, "hidden": args.hidden, "shapes": shapes, "tokens": tokens,
            "settings": {"calls": settings.calls, "repeats": settings.repeats,
                         "min_repeats": settings.min_repeats, "max_repeats": settings.max_repeats,
                         "target_s": settings.target_s, "warmup": settings.warmup,
                         "memory_budget_bytes": settings.budget, "seed": args.seed,
                         "plan_max_groups": geometry.PLAN_MAX_GROUPS},
            "legend": LEGEND,
            "checks": checks, "results": results, "summary": rows,
            "targets": {"headline": HEADLINE, "device": "gpu" if on_gpu else "cpu", "found": found},
            "notes": notes, "elapsed_s": elapsed,
        }
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=1)
            handle.write("\n")

    print("\n".join(header))
    print()
    print(format_table(rows))
    print()
    print(targets_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
