"""The GPU implementation: the kernel texts of `kernels/` as MLX custom kernels.

Each kernel object is built once per backend and name and cached; MLX then
compiles one instance per template argument set. Gradients go through
`mx.custom_function`, with the same formulas as the C++ primitives' vjp
(`src/combine.cpp`, `src/gather.cpp`), so they run on these kernels too.
"""

from __future__ import annotations

from functools import cache, lru_cache

import mlx.core as mx

from . import kernels

# Tests set this to a value no kernel writes, so unwritten elements show.
POISON: float | None = None

_INPUTS_OUTPUTS = {
    "plan_hist": (["ids", "params"], ["block_counts", "block_invalid"]),
    "plan_scan": (
        ["block_counts", "block_invalid", "params"],
        ["expert_counts", "expert_offsets", "block_bases", "totals"],
    ),
    "plan_place": (
        ["ids", "weights", "block_bases", "expert_counts", "expert_offsets", "totals", "params"],
        ["row_tokens", "row_experts", "row_weights", "row_entries", "positions", "tile_experts"],
    ),
    "gather": (["src", "index", "params"], ["out"]),
    "combine": (["src", "index", "weights", "params"], ["out"]),
}


@cache
def _kernel(backend: str, name: str):
    inputs, outputs = _INPUTS_OUTPUTS[name]
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return make(
        name=f"moe_{name}",
        input_names=inputs,
        output_names=outputs,
        source=kernels.body(name, backend),
        header=kernels.prelude(backend),
    )


def _launch(backend, name, inputs, template, groups, group_size, shapes, dtypes, stream):
    extra = {} if POISON is None else {"init_value": POISON}
    return _kernel(backend, name)(
        inputs=inputs,
        template=template,
        grid=(groups * group_size, 1, 1),
        threadgroup=(group_size, 1, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
        stream=stream,
        **extra,
    )


@lru_cache(maxsize=1024)
def _params(*values: int) -> mx.array:
    """The small int32 array of run-time sizes a kernel reads.

    Cached: a new array per call would be a new host-to-device transfer per
    call, and the same sizes recur in every layer of a model.
    """
    return mx.array(values, dtype=mx.int32)


@cache
def _unused_weights() -> mx.array:
    """Stands in for an absent weights input (the kernel never reads it)."""
    return mx.zeros((1,), mx.float32)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# Groups loop over rows beyond this many, keeping every grid within limits.
_MAX_GROUPS = 1 << 16


class _Backend:
    def __init__(self, backend: str):
        self.backend = backend

    def plan(self, ids, weights, *, num_experts, tile_m, top_k, stream):
        from .reference import capacity_for

        num_entries = ids.size
        capacity = capacity_for(num_entries, num_experts, tile_m)
        max_tiles = capacity // tile_m
        if num_entries == 0:  # no kernel to run: every array but two is empty
            empty = mx.zeros((0,), mx.int32)
            zero = mx.array(0, mx.int32)
            return (empty, empty, None if weights is None else mx.zeros((0,), mx.float32),
                    empty, empty, mx.zeros((num_experts,), mx.int32),
                    mx.zeros((num_experts + 1,), mx.int32), empty, zero, zero, zero)
        block, limit = kernels.PLAN_BLOCK, kernels.MAX_EXPERTS
        num_blocks = max(1, -(-num_entries // block))
        i32 = mx.int32
        hist_counts, hist_invalid = _launch(
            self.backend, "plan_hist", [ids, _params(num_entries, num_experts)],
            [("BLOCK", block), ("MAX_EXPERTS", limit)], num_blocks, block,
            [(num_blocks * num_experts,), (num_blocks,)], [i32, i32], stream,
        )
        counts, offsets, bases, totals = _launch(
            self.backend, "plan_scan",
            [hist_counts, hist_invalid, _params(num_blocks, num_experts, tile_m)],
            [("MAX_EXPERTS", limit)], 1, limit,
            [(num_experts,), (num_experts + 1,), (num_blocks * num_experts,), (3,)],
            [i32, i32, i32, i32], stream,
        )
        has_weights = weights is not None
        weights_in = weights if has_weights else _unused_weights()
        row_tokens, row_experts, row_weights, row_entries, positions, tile_experts = _launch(
            self.backend, "plan_place",
            [ids, weights_in, bases, counts, offsets, totals,
             _params(num_entries, num_experts, tile_m, top_k, capacity, max_tiles)],
            [("BLOCK", block), ("MAX_EXPERTS", limit), ("HAS_WEIGHTS", has_weights)],
            num_blocks, block,
            [(capacity,), (capacity,), (capacity if has_weights else 1,), (capacity,),
             (num_entries,), (max_tiles,)],
            [i32, i32, mx.float32, i32, i32, i32], stream,
        )
        return (
            row_tokens, row_experts, row_weights if has_weights else None, row_entries,
            positions, counts, offsets, tile_experts, totals[0], totals[1], totals[2],
        )

    def gather_rows(self, src, index, inverse, *, dtype, stream):
        return _gather_function(self.backend, dtype, stream)(src, index, inverse)

    def combine_rows(self, src, index, weights, inverse, *, dtype, stream):
        if weights is None:
            return _combine_function(self.backend, dtype, False, stream)(src, index, inverse)
        return _combine_function(self.backend, dtype, True, stream)(src, index, inverse, weights)


_GATHER_ROWS = 4


def _gather(backend, src, index, dtype, stream):
    num_src, hidden = src.shape
    num_rows = index.shape[0]
    if num_rows == 0 or hidden == 0:
        return mx.zeros((num_rows, hidden), dtype)
    row_bytes = hidden * src.dtype.size
    copy_vectors = src.dtype == dtype and row_bytes % 16 == 0
    row_vectors = row_bytes // 16 if copy_vectors else 0
    per_row = row_vectors if copy_vectors else hidden
    group_size = min(1024 if copy_vectors else 256, _round_up(per_row, 32))
    groups = min(-(-num_rows // _GATHER_ROWS), _MAX_GROUPS)
    (out,) = _launch(
        backend, "gather", [src, index, _params(num_src, hidden, num_rows, row_vectors)],
        [("InT", src.dtype), ("OutT", dtype), ("COPY_VECTORS", copy_vectors),
         ("ROWS", _GATHER_ROWS)],
        groups, group_size, [(num_rows, hidden)], [dtype], stream,
    )
    return out


_COMBINE_UNROLL = 4


def _combine(backend, src, index, weights, dtype, stream):
    num_src, hidden = src.shape
    num_out, fan_in = index.shape
    if num_out == 0 or hidden == 0:
        return mx.zeros((num_out, hidden), dtype)
    has_weights = weights is not None
    weights_in = weights if has_weights else _unused_weights()
    group_size = min(1024, _round_up(-(-hidden // _COMBINE_UNROLL), 32))
    (out,) = _launch(
        backend, "combine", [src, index, weights_in, _params(num_src, hidden, num_out)],
        [("InT", src.dtype), ("OutT", dtype), ("FAN_IN", fan_in),
         ("HAS_WEIGHTS", has_weights), ("UNROLL", _COMBINE_UNROLL)],
        min(num_out, _MAX_GROUPS), group_size, [(num_out, hidden)], [dtype], stream,
    )
    return out


@cache
def _gather_function(backend, dtype, stream):
    @mx.custom_function
    def gather(src, index, inverse):
        return _gather(backend, src, index, dtype, stream)

    @gather.vjp
    def gather_vjp(primals, cotangent, output):
        src, index, inverse = primals
        # Each src row was copied to the rows its inverse lists: sum them.
        grad = _combine(backend, cotangent, inverse, None, src.dtype, stream)
        return grad, mx.zeros_like(index), mx.zeros_like(inverse)

    return gather


@cache
def _combine_function(backend, dtype, has_weights, stream):
    def combine_impl(src, index, inverse, weights=None):
        return _combine(backend, src, index, weights, dtype, stream)

    combine = mx.custom_function(combine_impl)

    @combine.vjp
    def combine_vjp(primals, cotangent, output):
        src, index, inverse = primals[:3]
        weights = primals[3] if has_weights else None
        if inverse is None:
            raise ValueError("combine: no inverse index was given, so no gradient")
        fan_in = index.shape[1]
        used = inverse >= 0
        token = mx.where(used, inverse // fan_in, -1)
        grad_src = _gather_function(backend, src.dtype, stream)(cotangent, token, index)
        grads = []
        if has_weights:
            row_weight = mx.where(used, mx.take(weights.reshape(-1), mx.maximum(inverse, 0)), 0.0)
            grad_src = (grad_src.astype(mx.float32) * row_weight[:, None]).astype(src.dtype)
            picked = _gather(backend, src, index.reshape(-1), mx.float32, stream)
            picked = picked.reshape(index.shape + (src.shape[1],))
            grad_weights = (picked * cotangent.astype(mx.float32)[:, None, :]).sum(-1)
            grads = [grad_weights]
        return (grad_src, mx.zeros_like(index), mx.zeros_like(inverse), *grads)

    return combine


@cache
def for_backend(backend: str) -> _Backend:
    return _Backend(backend)
