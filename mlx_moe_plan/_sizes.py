"""The sizes a plan is built with: the expert limit and the rows it reserves.

Plain Python, no MLX and no NumPy: `moe_plan` checks its arguments with
these, `kernels/launch.py` sizes the plan kernel's outputs with them, and the
NumPy reference (`reference.py`) takes MAX_EXPERTS from here. The tests
restate `capacity_for` independently (tests/test_plan.py), so that the
formula is checked, not only shared.
"""

from __future__ import annotations

# The most experts a plan takes. The GPU plan keeps a counter per expert in a
# group's shared memory (kernels/plan.h), which this bounds; it must stay a
# multiple of the plan kernel's block (kernels/launch.py, PLAN_BLOCK).
MAX_EXPERTS = 1024

# Rows, tiles and entries are indexed with int32 in every backend.
INT32_MAX = 2**31 - 1


def capacity_for(num_entries: int, num_experts: int, tile_m: int) -> int:
    """Rows a plan reserves: every entry, plus the worst-case padding.

    Each expert's span is its count rounded up to a multiple of `tile_m`, so
    at most `tile_m - 1` padding rows per expert that has entries, and at most
    `min(num_experts, num_entries)` experts have any.

    Args:
        num_entries (int): Routing entries `T * K`.
        num_experts (int): Number of experts `E`.
        tile_m (int): The padding multiple, at least 1.

    Returns:
        int: `num_entries` if `tile_m == 1`, else `num_entries +
        min(num_experts, num_entries) * (tile_m - 1)` rounded up to a multiple
        of `tile_m`.
    """
    if tile_m == 1:
        return num_entries
    worst = num_entries + min(num_experts, num_entries) * (tile_m - 1)
    return -(-worst // tile_m) * tile_m
