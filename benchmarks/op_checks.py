"""What the op benchmark checks before it times anything.

Every op against `mlx_moe_plan.reference`, bit for bit, with the comparisons
the tests use (`reference.bitwise_mismatch`, `reference.plan_mismatch`); and
that the mlx-lm path it times computes what mlx-lm computes, and what ours does.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

import mlx_moe_plan
from mlx_moe_plan import reference

from .op_inputs import DTYPES, dtype_name, random_values, routing
from .op_peers import (mlx_lm, mlx_lm_combine, mlx_lm_gather_sort, mlx_lm_index_work, mlx_lm_take,
                       mlx_lm_unsort)
from .workloads import LayerShape

# The small check: an odd token count, a few skipped and invalid ids.
SMALL_TOKENS = 37


class CheckError(Exception):
    """An op, or the peer, computed something other than what it is checked against."""


def expect_bitwise(what: str, actual, expected) -> None:
    """Raise CheckError unless `actual` holds exactly the bits of `expected`."""
    problem = reference.bitwise_mismatch(actual, expected)
    if problem:
        raise CheckError(f"{what}: {problem}")


def check_case(name: str, shape: LayerShape, tokens: int, hidden: int, *, tile_m: int,
               edge_ids: bool, dtypes, conversions, plan_weights: bool,
               weights_dtype=mx.float16) -> None:
    """One check: plan, gather, combine, unsort against the reference, bit for bit."""
    what = f"[{name} T={tokens} H={hidden} tile_m={tile_m}]"
    ids, scores = routing(tokens, shape, weights_dtype)
    if edge_ids and ids.size >= 3:  # a skipped entry (-1), an invalid one (>= E)
        flat = np.array(ids).reshape(-1)
        flat[[0, flat.size // 2]] = -1
        flat[-1] = shape.experts
        ids = mx.array(flat.reshape(ids.shape))
    ids_np, weights_np = np.array(ids), np.array(scores.astype(mx.float32))

    plan = mlx_moe_plan.moe_plan(ids, shape.experts, weights=scores if plan_weights else None,
                                 tile_m=tile_m)
    ref = reference.moe_plan(ids_np, shape.experts, weights=weights_np if plan_weights else None,
                             tile_m=tile_m)
    problem = reference.plan_mismatch(plan, ref)
    if problem:
        raise CheckError(f"{what} plan: {problem}")

    x_base = random_values((tokens, hidden), mx.float32)
    rows_base = random_values((plan.capacity, hidden), mx.float32)
    for src, dst in [(d, d) for d in dtypes] + list(conversions):
        x = x_base.astype(src)
        got = mlx_moe_plan.moe_gather(x, plan, dtype=dst)
        want = reference.moe_gather(reference.to_numpy(x), ref, dtype=dtype_name(dst),
                                    x_dtype=dtype_name(src))
        expect_bitwise(f"{what} gather {dtype_name(src)} -> {dtype_name(dst)}", got, want)
    for dtype in dtypes:
        rows = rows_base.astype(dtype)
        rows_np = reference.to_numpy(rows)
        if plan_weights:
            got = mlx_moe_plan.moe_combine(rows, plan)
            want = reference.moe_combine(rows_np, ref, rows_dtype=dtype_name(dtype))
        else:  # as timed: the plan carries no weights, combine gets the router's
            got = mlx_moe_plan.moe_combine(rows, plan, weights=scores)
            want = reference.moe_combine(rows_np, ref, weights=weights_np,
                                         rows_dtype=dtype_name(dtype))
        expect_bitwise(f"{what} combine {dtype_name(dtype)}", got, want)
        expect_bitwise(f"{what} unsort {dtype_name(dtype)}", mlx_moe_plan.moe_unsort(rows, plan),
                       reference.moe_unsort(rows_np, ref))


def check_peer(name: str, shape: LayerShape, tokens: int, hidden: int, dtype) -> None:
    """The mlx-lm path timed here does the same work as ours (and as mlx-lm itself)."""
    what = f"[{name} T={tokens} H={hidden}] mlx-lm path"
    ids, scores = routing(tokens, shape, dtype)
    x = random_values((tokens, hidden), dtype)
    plan = mlx_moe_plan.moe_plan(ids, shape.experts)
    order, sorted_ids, inv_order = mlx_lm_index_work(ids)

    # Our reproduction of `_gather_sort` is exact.
    taken, idx, inv = mlx_lm_gather_sort(x, ids)
    expect_bitwise(f"{what}: index work vs _gather_sort ids", sorted_ids, np.array(idx))
    expect_bitwise(f"{what}: index work vs _gather_sort inverse", inv_order, np.array(inv))
    expect_bitwise(f"{what}: take vs _gather_sort rows", mlx_lm_take(x, order, shape.top_k),
                   reference.to_numpy(taken))
    # Both sort the same entries: the same expert per row.
    expect_bitwise(f"{what}: sorted ids vs plan.row_experts", np.array(sorted_ids).astype(np.int32),
                   reference.to_numpy(plan.row_experts))
    # Rows in mlx-lm's order are ours permuted (argsort need not be stable).
    ours_in_their_order = mlx_moe_plan.moe_gather(x, plan)[plan.positions.reshape(-1)[order]]
    expect_bitwise(f"{what}: take vs moe_gather", mlx_lm_take(x, order, shape.top_k)[:, 0],
                   reference.to_numpy(ours_in_their_order))
    rows = random_values((plan.capacity, hidden), dtype)
    their_rows = rows[plan.positions.reshape(-1)[order]]
    expect_bitwise(f"{what}: _scatter_unsort vs moe_unsort",
                   mlx_lm_unsort(their_rows, inv_order, ids.shape),
                   reference.to_numpy(mlx_moe_plan.moe_unsort(rows, plan)))
    # Close, not equal: mlx-lm rounds each product to the activation dtype, ours
    # sums in float32 and rounds once.
    theirs = np.array(mlx_lm_combine(their_rows, inv_order, scores).astype(mx.float32))
    ours = np.array(mlx_moe_plan.moe_combine(rows, plan, weights=scores).astype(mx.float32))
    if not np.allclose(theirs, ours, rtol=2e-2, atol=2e-2):
        worst = float(np.max(np.abs(theirs - ours)))
        raise CheckError(f"{what}: unsort + weighted sum differs from moe_combine by up to {worst}")


def checks_per_shape() -> int:
    """The steps `check_shape` takes: two of ours, one of the peer's where it is installed."""
    return 3 if mlx_lm is not None else 2


def check_shape(name: str, shape: LayerShape, hidden: int, tokens: int, dtype,
                step: Callable[[str], None]) -> list[dict]:
    """Every check at one shape, before it is timed.

    Args:
        name (str): The shape's name in `workloads.LAYER_SHAPES`.
        shape (LayerShape): Its experts and top_k.
        hidden (int): The hidden size H of the rows.
        tokens (int): The token count T of the check as timed (float rows in
          `dtype`, no weights in the plan, tile_m 1).
        dtype (Dtype): The timed activation dtype.
        step (callable): Called with a label before each of `checks_per_shape()` steps.

    Returns:
        list[dict]: One record per check passed, for the report.

    Raises:
        CheckError: At the first value that differs.
    """
    checks = []
    step(f"check {name} T={SMALL_TOKENS} H={hidden}: dtypes, tile_m 1 and 8, -1 and invalid ids")
    for tile_m in (1, 8):
        check_case(name, shape, SMALL_TOKENS, hidden, tile_m=tile_m, edge_ids=True,
                   dtypes=list(DTYPES.values()),
                   conversions=[(mx.float32, mx.float16), (mx.float32, mx.bfloat16)],
                   plan_weights=True)
    checks.append({"model": name, "tokens": SMALL_TOKENS, "hidden": hidden, "tile_m": [1, 8],
                   "dtypes": list(DTYPES), "ok": True})
    step(f"check {name} T={tokens} H={hidden} {dtype_name(dtype)}, as timed")
    check_case(name, shape, tokens, hidden, tile_m=1, edge_ids=False, dtypes=[dtype],
               conversions=[], plan_weights=False, weights_dtype=dtype)
    checks.append({"model": name, "tokens": tokens, "hidden": hidden, "tile_m": [1],
                   "dtypes": [dtype_name(dtype)], "ok": True})
    if mlx_lm is not None:
        step(f"check the mlx-lm path for {name} T={SMALL_TOKENS}")
        check_peer(name, shape, SMALL_TOKENS, hidden, dtype)
        checks.append({"model": name, "tokens": SMALL_TOKENS, "hidden": hidden,
                       "peer": "mlx-lm", "ok": True})
    return checks
