"""Timing each op, ours and its peers', at one shape.

Times are medians over repeats of one graph of many calls, each call on its
own inputs (`benchmarks.timing`); ratios compare figures measured in the same
run. Each result also counts the bytes the op must move, the same for every
implementation, for its GB/s.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

import mlx_moe_plan

from .op_inputs import dtype_name, random_values, routing, variant
from .op_peers import copy_op, mlx_lm, mlx_lm_combine, mlx_lm_index_work, mlx_lm_take, mlx_lm_unsort
from .timing import Timing, time_calls
from .workloads import LayerShape

# What is timed at each shape, in order: (op, implementation).
CASES = (("plan", "ours"), ("plan", "mlx-lm"), ("gather", "ours"), ("gather", "mlx-lm"),
         ("copy", "copy"), ("combine", "ours"), ("combine", "mlx-lm"), ("unsort", "ours"),
         ("unsort", "mlx-lm"))


def timed_cases() -> list[tuple[str, str]]:
    """CASES but mlx-lm's where it is not installed."""
    return [case for case in CASES if case[1] != "mlx-lm" or mlx_lm is not None]


@dataclass
class Settings:
    """How every shape is timed (`benchmarks.timing.time_calls`' arguments)."""

    calls: int | None  # calls a graph; None: the defaults of `measure_shape`
    on_gpu: bool
    repeats: int | None  # None: by time, `target_s`
    min_repeats: int
    max_repeats: int
    target_s: float
    warmup: int
    budget: int  # bytes one graph's inputs and outputs may take


def memory_budget(override_gb: float | None) -> int:
    """Bytes one graph may hold: `override_gb` GiB, else a quarter of the device's
    memory, at most 32 GiB on a GPU and 4 on a CPU."""
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


def plan_outputs(plan) -> list[mx.array]:
    """Everything the plan computes: its kernel's (or primitive's) outputs. The
    fields are views of them, made when read (about 1.4 us a view on the H200,
    `python -m benchmarks.dispatch`), and each op that reads one pays for it."""
    return list(plan.outputs)


def measure_shape(name: str, shape: LayerShape, tokens: int, hidden: int, dtype,
                  settings: Settings, step: Callable[[str], None]) -> list[dict]:
    """Time every op at one shape.

    Args:
        name (str): The shape's name in `workloads.LAYER_SHAPES`.
        shape (LayerShape): Its experts and top_k.
        tokens (int): Token count T.
        hidden (int): Hidden size H.
        dtype (Dtype): Activation dtype.
        settings (Settings): How to time.
        step (callable): Called with a label before each of `timed_cases()`.

    Returns:
        list[dict]: One result per (op, implementation) in `timed_cases()`.
    """
    top_k, itemsize = shape.top_k, mx.zeros((), dtype).itemsize
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

    layers = [routing(tokens, shape, dtype) for _ in range(max(index_calls, data_calls))]
    ids = [layer[0] for layer in layers]
    scores = [layer[1] for layer in layers]
    mx.eval(ids, scores)
    x_base = random_values((tokens, hidden), dtype)
    rows_base = random_values((entries, hidden), dtype)
    xs = [variant(x_base, i) for i in range(data_calls)]
    rows = [variant(rows_base, i) for i in range(data_calls)]
    mx.eval(xs, rows)
    del x_base, rows_base
    plans = [mlx_moe_plan.moe_plan(ids[i], shape.experts) for i in range(data_calls)]
    mx.eval([plan_outputs(p) for p in plans])
    if mlx_lm is not None:
        peer = [mlx_lm_index_work(ids[i]) for i in range(data_calls)]
        mx.eval(peer)
        orders = [p[0] for p in peer]
        inv_orders = [p[2] for p in peer]

    E = shape.experts
    calls = {
        ("plan", "ours"): (index_calls, lambda i: plan_outputs(mlx_moe_plan.moe_plan(ids[i], E))),
        ("plan", "mlx-lm"): (index_calls, lambda i: mlx_lm_index_work(ids[i])),
        ("gather", "ours"): (data_calls, lambda i: mlx_moe_plan.moe_gather(xs[i], plans[i])),
        ("gather", "mlx-lm"): (data_calls, lambda i: mlx_lm_take(xs[i], orders[i], top_k)),
        ("copy", "copy"): (data_calls, lambda i: copy_op(rows[i])),
        ("combine", "ours"): (
            data_calls, lambda i: mlx_moe_plan.moe_combine(rows[i], plans[i], weights=scores[i])),
        ("combine", "mlx-lm"): (
            data_calls, lambda i: mlx_lm_combine(rows[i], inv_orders[i], scores[i])),
        ("unsort", "ours"): (data_calls, lambda i: mlx_moe_plan.moe_unsort(rows[i], plans[i])),
        ("unsort", "mlx-lm"): (
            data_calls, lambda i: mlx_lm_unsort(rows[i], inv_orders[i], ids[i].shape)),
    }
    results = []
    for op, impl in timed_cases():
        graph_calls, call = calls[op, impl]
        step(f"{name} T={tokens} H={hidden}: {op} ({impl}), {graph_calls} calls a graph")
        timing: Timing = time_calls(
            call, graph_calls, warmup=settings.warmup, repeats=settings.repeats,
            min_repeats=settings.min_repeats, max_repeats=settings.max_repeats,
            target_s=settings.target_s,
        )
        moved = bytes_moved(op, tokens, top_k, hidden, itemsize)
        results.append({
            "model": name, "experts": E, "top_k": top_k, "hidden": hidden,
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
