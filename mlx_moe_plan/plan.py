"""`moe_plan`: a stable counting sort of the routing entries by expert."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import mlx.core as mx

from . import _backend
from ._checks import check_weights
from ._sizes import INT32_MAX, MAX_EXPERTS, capacity_for


@dataclass(frozen=True, eq=False)
class MoEPlan:
    """Where each routed (token, k) entry lives in the expert-sorted rows.

    Rows are ordered by expert; inside an expert by ascending flat entry index
    `t * K + k`. Each expert's span starts at a multiple of `tile_m` and is its
    count rounded up to a multiple of `tile_m`; the rows past the count are
    padding. See docs/DESIGN.md for the normative description of every field.

    The array fields are lazy views of what the plan's kernel (or CPU
    primitive) computed, `outputs`: each is made when first read, so a field
    nobody reads costs nothing, not even a graph node. `mx.eval(plan.outputs)`
    evaluates the whole plan.
    """

    num_experts: int
    tile_m: int
    capacity: int
    max_tiles: int
    top_k: int
    indices_shape: tuple[int, ...]
    """The shape of the `indices` the plan was built from, `[..., K]`."""
    outputs: tuple[mx.array, ...]
    """Every array the plan's kernel or primitive computed; the fields view them."""
    _field: Callable[[str, tuple[int, ...]], mx.array] = field(repr=False)
    _weights: mx.array | None = field(repr=False)
    _stream: mx.Stream = field(repr=False)

    @cached_property
    def row_tokens(self) -> mx.array:
        """int32 `[capacity]`: token of each row, `-1` on padding and tail rows."""
        return self._field("row_tokens", (self.capacity,))

    @cached_property
    def row_experts(self) -> mx.array:
        """int32 `[capacity]`: expert of each row (non-decreasing)."""
        return self._field("row_experts", (self.capacity,))

    @cached_property
    def row_weights(self) -> mx.array | None:
        """float32 `[capacity]`: the entry's weight, 0 on padding; None without weights."""
        if self._weights is None:
            return None
        return self._field("row_weights", (self.capacity,))

    @cached_property
    def row_entries(self) -> mx.array:
        """int32 `[capacity]`: flat entry `t * K + k` of each row, `-1` on padding."""
        return self._field("row_entries", (self.capacity,))

    @cached_property
    def positions(self) -> mx.array:
        """int32, `indices.shape`: row of each entry, `-1` where skipped or invalid."""
        return self._field("positions", self.indices_shape)

    @cached_property
    def expert_counts(self) -> mx.array:
        """int32 `[num_experts]`: routed entries per expert (unpadded)."""
        return self._field("expert_counts", (self.num_experts,))

    @cached_property
    def expert_offsets(self) -> mx.array:
        """int32 `[num_experts + 1]`: first row of each expert; the last is `num_rows`."""
        return self._field("expert_offsets", (self.num_experts + 1,))

    @cached_property
    def tile_experts(self) -> mx.array:
        """int32 `[max_tiles]`: expert of each tile of `tile_m` rows, `-1` past `num_tiles`."""
        return self._field("tile_experts", (self.max_tiles,))

    @cached_property
    def num_rows(self) -> mx.array:
        """int32 scalar: used rows, padding included."""
        return self._field("num_rows", ())

    @cached_property
    def num_tiles(self) -> mx.array:
        """int32 scalar: used tiles."""
        return self._field("num_tiles", ())

    @cached_property
    def num_invalid(self) -> mx.array:
        """int32 scalar: entries `>= num_experts`."""
        return self._field("num_invalid", ())

    @cached_property
    def entry_weights(self) -> mx.array | None:
        """float32, `indices.shape`: the weights the plan was built with, for `moe_combine`."""
        if self._weights is None:
            return None
        return self._weights.astype(mx.float32, stream=self._stream)


def check_plan(plan) -> None:
    """The `plan` argument of gather, combine and unsort: a MoEPlan."""
    if not isinstance(plan, MoEPlan):
        raise TypeError(f"plan: expected a MoEPlan, got {type(plan).__name__}")


def _as_plan_ids(indices: mx.array, num_experts: int, backend, stream) -> mx.array:
    """Ids the backend's plan reads, with every out-of-range value kept out of range.

    A dtype of `backend.plan_id_dtypes` is read as it is. Others become int32:
    narrower types convert exactly; wider ones are first clamped to
    `[-1, num_experts]`, so that no id wraps into a valid expert (2**32 + 3
    must stay invalid, not become expert 3).
    """
    if indices.dtype in backend.plan_id_dtypes:
        return indices
    if indices.dtype in (mx.int64, mx.uint32, mx.uint64):
        lowest = 0 if indices.dtype in (mx.uint32, mx.uint64) else -1
        indices = mx.clip(indices, lowest, num_experts, stream=stream)
    return indices.astype(mx.int32, stream=stream)


def moe_plan(
    indices: mx.array,
    num_experts: int,
    *,
    weights: mx.array | None = None,
    tile_m: int = 1,
    check: bool = False,
    stream: mx.Stream | mx.Device | None = None,
) -> MoEPlan:
    """Sort the routing entries by expert, stably, into padded rows.

    Args:
        indices (array): Integer expert ids of shape `[..., K]`; the leading
          dims are the tokens. A negative id skips the entry; an id
          `>= num_experts` is invalid, skipped too and counted in
          `num_invalid`.
        num_experts (int): Number of experts `E`, from 1 to 1024.
        weights (array, optional): Float routing weights, same shape as
          `indices`, carried to the rows (as float32).
        tile_m (int): Each expert's rows are padded to a multiple of this.
          Default: ``1``.
        check (bool): Evaluate `num_invalid` now and raise ``ValueError`` if
          any id is `>= num_experts`. Default: ``False``.
        stream (Stream or Device, optional): Where to run.

    Returns:
        MoEPlan: The plan; its arrays are lazy.
    """
    if not isinstance(indices, mx.array):
        raise TypeError(f"indices: expected an mlx.core.array, got {type(indices).__name__}")
    if not mx.issubdtype(indices.dtype, mx.integer):
        raise TypeError(f"indices: expected an integer dtype, got {indices.dtype}")
    if indices.ndim < 1:
        raise ValueError("indices: expected shape [..., K] with at least one dimension")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise TypeError(f"num_experts: expected an int, got {type(num_experts).__name__}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts: must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if isinstance(tile_m, bool) or not isinstance(tile_m, int):
        raise TypeError(f"tile_m: expected an int, got {type(tile_m).__name__}")
    if not 1 <= tile_m <= INT32_MAX:
        raise ValueError(f"tile_m: must be in [1, {INT32_MAX}], got {tile_m}")
    if weights is not None:
        check_weights(weights, indices.shape)

    top_k = indices.shape[-1]
    if top_k == 0:
        raise ValueError("indices: the last dimension K must be at least 1")
    num_entries = indices.size
    capacity = capacity_for(num_entries, num_experts, tile_m)
    if capacity > INT32_MAX:
        raise ValueError(
            f"indices, tile_m: {num_entries} entries with tile_m={tile_m} need {capacity} "
            "rows, more than int32 indexes"
        )

    stream = _backend.resolve_stream(stream)
    backend = _backend.implementation(stream)
    ids = _as_plan_ids(indices, num_experts, backend, stream)
    outputs, field_of = backend.plan(
        ids, weights, num_experts=num_experts, tile_m=tile_m, top_k=top_k, stream=stream
    )
    plan = MoEPlan(
        num_experts=num_experts,
        tile_m=tile_m,
        capacity=capacity,
        max_tiles=capacity // tile_m,
        top_k=top_k,
        indices_shape=tuple(indices.shape),
        outputs=tuple(outputs),
        _field=field_of,
        _weights=weights,
        _stream=stream,
    )
    if check:
        invalid = plan.num_invalid.item()
        if invalid:
            raise ValueError(
                f"indices: {invalid} entries are >= num_experts ({num_experts})"
            )
    return plan
