"""A plan's static shape: the expert limit, the rows it reserves, its fields.

Plain Python, no MLX and no NumPy: `moe_plan` checks its arguments with
these, both backends name and size the plan's outputs from `PLAN_FIELDS` and
`field_sizes`, and `kernels/launch.py` lays out the plan kernel's output with
them. The tests restate `capacity_for` independently (tests/test_plan.py), so
that the formula is checked, not only shared.
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


# The plan's fields in the one order every backend produces them: the int32
# fields in the order the GPU kernel packs them into its one int32 output
# (kernels/plan.h), then row_weights, the one float32 field, which a plan has
# only when built with weights. The C++ primitive returns its outputs in this
# order too (kPlanOutputs in src/primitives.h). C++ and kernel texts cannot
# import this tuple: tests/test_structure.py checks both against it.
PLAN_FIELDS = ("row_tokens", "row_experts", "row_entries", "tile_experts", "positions",
               "expert_counts", "expert_offsets", "num_rows", "num_tiles", "num_invalid",
               "row_weights")
WEIGHT_FIELD = "row_weights"


def field_sizes(num_entries: int, num_experts: int, tile_m: int) -> dict[str, int]:
    """Elements of each of the plan's fields, in `PLAN_FIELDS` order.

    Args:
        num_entries (int): Routing entries `T * K`.
        num_experts (int): Number of experts `E`.
        tile_m (int): The padding multiple.

    Returns:
        dict(str, int): The size of each field; the three counts are scalars,
        of one element.
    """
    capacity = capacity_for(num_entries, num_experts, tile_m)
    sizes = dict(row_tokens=capacity, row_experts=capacity, row_entries=capacity,
                 tile_experts=capacity // tile_m, positions=num_entries,
                 expert_counts=num_experts, expert_offsets=num_experts + 1,
                 num_rows=1, num_tiles=1, num_invalid=1, row_weights=capacity)
    return {name: sizes[name] for name in PLAN_FIELDS}
