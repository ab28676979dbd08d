"""NumPy reference of the semantics in docs/DESIGN.md.

Short, obvious code that every backend must match bit for bit. Nothing here
is fast: it is the definition the tests and the benchmark check against. The
package's ops never import it, nor NumPy (tests/test_structure.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def capacity_for(num_entries: int, num_experts: int, tile_m: int) -> int:
    """Rows a plan reserves: every entry, plus the worst-case padding.

    The reference's own statement of the formula; the package computes it in
    `mlx_moe_plan/_sizes.py`, and tests/test_plan.py checks both against a
    third, written out by hand.
    """
    if tile_m == 1:
        return num_entries
    worst = num_entries + min(num_experts, num_entries) * (tile_m - 1)
    return -(-worst // tile_m) * tile_m


@dataclass
class ReferencePlan:
    row_tokens: np.ndarray
    row_experts: np.ndarray
    row_weights: np.ndarray | None
    row_entries: np.ndarray
    positions: np.ndarray
    expert_counts: np.ndarray
    expert_offsets: np.ndarray
    tile_experts: np.ndarray
    num_rows: int
    num_tiles: int
    num_invalid: int
    num_experts: int
    tile_m: int
    capacity: int
    max_tiles: int
    top_k: int


def moe_plan(indices, num_experts: int, weights=None, tile_m: int = 1) -> ReferencePlan:
    indices = np.asarray(indices)
    top_k = indices.shape[-1]
    ids = indices.reshape(-1).astype(np.int64)
    num_entries = ids.size
    routed = (ids >= 0) & (ids < num_experts)
    num_invalid = int(np.count_nonzero(ids >= num_experts))

    counts = np.bincount(ids[routed], minlength=num_experts).astype(np.int32)
    spans = -(-counts // tile_m) * tile_m
    offsets = np.concatenate([[0], np.cumsum(spans)]).astype(np.int32)
    capacity = capacity_for(num_entries, num_experts, tile_m)
    max_tiles = capacity // tile_m
    num_rows = int(offsets[-1])

    row_tokens = np.full(capacity, -1, np.int32)
    row_entries = np.full(capacity, -1, np.int32)
    row_experts = np.full(capacity, num_experts - 1, np.int32)
    row_weights = None if weights is None else np.zeros(capacity, np.float32)
    positions = np.full(num_entries, -1, np.int32)

    next_row = offsets[:-1].copy()
    for entry in range(num_entries):  # ascending flat index: stable within an expert
        if routed[entry]:
            row = next_row[ids[entry]]
            next_row[ids[entry]] += 1
            positions[entry] = row
            row_tokens[row] = entry // top_k
            row_entries[row] = entry
    for expert in range(num_experts):  # padding rows carry their span's expert
        row_experts[offsets[expert] : offsets[expert + 1]] = expert
    if weights is not None:
        flat_weights = np.asarray(weights, np.float32).reshape(-1)
        used = positions >= 0
        row_weights[positions[used]] = flat_weights[used]

    num_tiles = num_rows // tile_m
    tile_experts = np.full(max_tiles, -1, np.int32)
    tile_experts[:num_tiles] = row_experts[: num_rows : tile_m][:num_tiles]

    return ReferencePlan(
        row_tokens=row_tokens,
        row_experts=row_experts,
        row_weights=row_weights,
        row_entries=row_entries,
        positions=positions.reshape(indices.shape),
        expert_counts=counts,
        expert_offsets=offsets,
        tile_experts=tile_experts,
        num_rows=num_rows,
        num_tiles=num_tiles,
        num_invalid=num_invalid,
        num_experts=num_experts,
        tile_m=tile_m,
        capacity=capacity,
        max_tiles=max_tiles,
        top_k=top_k,
    )


# Element conversions, rounding to nearest even like every backend.
def to_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """Values stored as `dtype` ("float32", "float16" or "bfloat16" as uint16 bits)."""
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype`; bfloat16 comes back as uint16 bits."""
    values = np.asarray(values, np.float32)
    if dtype != "bfloat16":
        return values.astype(dtype)
    bits = values.view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    return np.where(np.isnan(values), quiet_nan, rounded).astype(np.uint16)


def moe_gather(x, plan: ReferencePlan, dtype: str | None = None, x_dtype: str | None = None):
    """`X[row] = x[row_tokens[row]]`, zeros on padding rows.

    `x` is a NumPy array (bfloat16 as uint16 bits with `x_dtype="bfloat16"`).
    """
    x_dtype = x_dtype or str(x.dtype)
    dtype = dtype or x_dtype
    tokens = np.asarray(x).reshape(-1, x.shape[-1])
    rows = np.zeros((plan.capacity, x.shape[-1]), np.float32)
    used = plan.row_tokens >= 0
    values = to_float32(tokens[plan.row_tokens[used]], x_dtype)
    rows[used] = values
    if dtype == x_dtype:  # a copy moves bits, NaN payloads included
        out = np.zeros((plan.capacity, x.shape[-1]), tokens.dtype)
        out[used] = tokens[plan.row_tokens[used]]
        return out
    return from_float32(rows, dtype)


def moe_combine(rows, plan: ReferencePlan, weights=None, rows_dtype: str | None = None,
                dtype: str | None = None):
    """`y[t] = sum_k w[t,k] * rows[positions[t,k]]`, float32, ascending k,
    rounded once to `dtype` (default: the rows' dtype)."""
    rows_dtype = rows_dtype or str(rows.dtype)
    positions = plan.positions.reshape(-1, plan.top_k)
    if weights is None:
        weights = np.zeros(positions.shape, np.float32)
        weights[positions >= 0] = plan.row_weights[positions[positions >= 0]]
    weights = np.asarray(weights, np.float32).reshape(positions.shape)
    values = to_float32(np.asarray(rows), rows_dtype)
    out = np.zeros((positions.shape[0], values.shape[-1]), np.float32)
    for k in range(plan.top_k):
        used = positions[:, k] >= 0
        term = weights[used, k][:, None] * values[positions[used, k]]
        out[used] = out[used] + term
    out = from_float32(out, dtype or rows_dtype)
    return out.reshape(plan.positions.shape[:-1] + (values.shape[-1],))


def moe_unsort(rows, plan: ReferencePlan):
    """Rows back to `[..., K, H]` order; zeros for skipped entries."""
    rows = np.asarray(rows)
    flat = plan.positions.reshape(-1)
    out = np.zeros((flat.size, rows.shape[-1]), rows.dtype)
    out[flat >= 0] = rows[flat[flat >= 0]]
    return out.reshape(plan.positions.shape + (rows.shape[-1],))
