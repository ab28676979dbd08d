"""The GPU implementation: the kernel texts of `kernels/` as MLX custom kernels.

Each kernel object is built once per backend and name and cached; MLX then
compiles one instance per template argument set. How each body is run (its
arguments, sizes, grid and template constants) comes from `kernels/launch.py`,
shared with the OpenCL tests. Gradients go through `mx.custom_function`,
with the formulas of `_gradients.py` run on these kernels, wherever a
transform could differentiate a launch (`_when_traced`); the C++ primitives'
vjps (`src/gather.cpp`, `src/combine.cpp`) are the same formulas in C++.
"""

from __future__ import annotations

import math
from functools import cache, lru_cache, partial
from typing import Callable

import mlx.core as mx

from . import _gradients, kernels
from ._checks import decoding_mask_fits
from ._tracing import carries_gradients
from .kernels import launch

# Tests set this to a value no kernel writes, so unwritten elements show.
POISON: float | None = None


@cache
def _kernel(backend: str, name: str, shared_bytes: int = 0,
            launch_bounds: tuple[int, int] | None = None):
    """Body `name` as MLX's kernel; on CUDA with `shared_bytes` of dynamic
    shared memory (a kernel object has one size: a kernel a size), and with
    `launch_bounds`, (threads, groups an SM), compiled for them
    (`kernels.launch_bounds`)."""
    inputs, outputs = launch.INPUTS_OUTPUTS[name]
    header = kernels.prelude(backend, name)
    if backend == "metal":
        make = mx.fast.metal_kernel
    else:
        make = partial(mx.fast.cuda_kernel, shared_memory=shared_bytes)
        if launch_bounds is not None:
            header += kernels.launch_bounds(*launch_bounds)
    return make(
        name=f"moe_{name}",
        input_names=list(inputs),
        output_names=list(outputs),
        source=kernels.body(name, backend),
        header=header,
        ensure_row_contiguous=name not in launch.STRIDED_BODIES,
    )


def _mlx_value(value):
    return getattr(mx, value) if isinstance(value, str) else value


def _when_traced(launched: Callable, vjp: Callable) -> Callable:
    """`launched` as an `mx.custom_function` whose gradient is `vjp` (its
    `vjp(primals, cotangents, outputs)`), where a transform could
    differentiate a call (`_tracing.carries_gradients`); `launched` itself
    elsewhere.

    A custom function costs the host its call and two graph nodes an output
    (the output's `StopGradient` and the `CustomTransforms`), at every
    launch of every decoding step, replayed from a compiled forward's tape
    too. Only a transform can ask for a gradient or a vmap, on the arrays it
    traces (`_tracing` says when it cannot), so the graph is the same either
    way wherever one could be taken.
    """
    differentiable = mx.custom_function(launched)
    differentiable.vjp(vjp)

    def call(*arrays):
        return differentiable(*arrays) if carries_gradients(arrays) else launched(*arrays)

    return call


def cache_by_stream(make=None, *, maxsize: int | None = None):
    """Caches `make(*args, stream)` by `args` and the stream's text; with
    `maxsize`, dropping the oldest entry past it.

    `functools.cache` would key on the Stream object, and Stream objects hash
    by identity (`resolve_stream` makes a new one each call): every call
    would miss and the cache grow without bound.
    """
    if make is None:
        return partial(cache_by_stream, maxsize=maxsize)
    made = {}

    def get(*args):
        *rest, stream = args
        key = (*rest, str(stream))
        found = made.get(key)
        if found is None:
            if maxsize is not None and len(made) >= maxsize:
                del made[next(iter(made))]
            found = made[key] = make(*args)
        return found

    get.cache_clear = made.clear
    # an empty cache of the same `make` and bound, for a test to stand in with
    get.fresh = lambda: cache_by_stream(make, maxsize=maxsize)
    return get


def _run(backend: str, arrays: list, kernel_launch: launch.Launch, stream):
    """Run `kernel_launch`'s body on `arrays`, then its `params` array, as it says."""
    call, params = _launch_call(backend, kernel_launch, POISON, stream)
    return call(inputs=[*arrays, params])


@cache_by_stream(maxsize=1024)
def _launch_call(backend: str, kernel_launch: launch.Launch, poison: float | None,
                 stream) -> tuple[Callable, mx.array]:
    """`kernel_launch`'s kernel object with every argument of its call but the
    inputs bound (`_bound_kernel`), and its `params` array: made once a
    launch and stream, and found in one lookup. A decoding step calls the
    same launches in every layer; making the template's MLX values anew each
    call was most of the host's time for a call, and looking up the kernel
    and the params apart made the stream's text twice."""
    return (_bound_kernel(backend, kernel_launch, poison, stream),
            _params(kernel_launch.params, stream))


def _bound_kernel(backend: str, kernel_launch: launch.Launch, poison: float | None,
                  stream) -> Callable:
    """`kernel_launch`'s kernel object with every argument of its call but the
    inputs bound: `call(inputs=[...])`."""
    cuda = backend == "cuda"
    shared_bytes = kernel_launch.shared_bytes if cuda else 0
    bounds = (kernel_launch.group_size, kernel_launch.min_groups) \
        if cuda and kernel_launch.min_groups else None
    arguments = dict(
        template=[(key, _mlx_value(value)) for key, value in kernel_launch.template],
        grid=(kernel_launch.groups * kernel_launch.group_size, 1, 1),
        threadgroup=(kernel_launch.group_size, 1, 1),
        output_shapes=[shape for shape, _ in kernel_launch.outputs],
        output_dtypes=[_mlx_value(dtype) for _, dtype in kernel_launch.outputs],
        **({} if poison is None else {"init_value": poison}))
    return partial(_kernel(backend, kernel_launch.body, shared_bytes, bounds), stream=stream,
                   **arguments)


_DEVICE_MIN_INTS = 8  # 32 bytes: past the 8 that MLX's CUDA allocator keeps in managed memory


def device_ints(values: tuple[int, ...], stream: mx.Stream) -> mx.array:
    """int32 `values` in device memory, made by an op on `stream` and evaluated.

    The array is a view of the first `len(values)` ints of one of at least
    `_DEVICE_MIN_INTS` (32 bytes): an array of 8 bytes or less would be
    managed memory, read remotely by every launch that takes it. While the
    grouped kernel as one expert took its spans `[0, count]` in 8 bytes,
    Nsight Compute put most of its warps' stall samples on the load of them
    and on the barrier behind it (benchmarks/HISTORY.md, "The one-expert
    plan in device memory").
    """
    padded = list(values) + [0] * (_DEVICE_MIN_INTS - len(values))
    on_device = mx.add(mx.array(padded, dtype=mx.int32), 0, stream=stream)[:len(values)]
    mx.eval(on_device)
    return on_device


@cache_by_stream
def _params(values: tuple[int, ...], stream: mx.Stream) -> mx.array:
    """The small int32 array of run-time sizes a kernel reads, in device
    memory (`device_ints`); cached, since the same sizes recur in every layer
    of a model (32 bytes for each distinct set). Sizes as template constants
    would compile a kernel per prompt length instead.
    """
    return device_ints(values, stream)


@cache
def _unused_weights() -> mx.array:
    """Stands in for an absent weights input (the kernel never reads it).

    Evaluated here: made lazily, inside a compiled forward's first trace, it
    would be two nodes of the trace (a fill and a broadcast), made again at
    every call of the compiled forward."""
    unused = mx.zeros((1,), mx.float32)
    mx.eval(unused)
    return unused


_NAMES: dict[mx.Dtype, str] = {}


def _name(dtype: mx.Dtype) -> str:
    """"bfloat16" for mx.bfloat16: the dtype's name in launch.py's tables
    (looked up, not made anew: every call of a kernel asks)."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype).rsplit(".", 1)[-1]
    return name


class GpuBackend:
    """The GPU backend: the kernel texts of `kernels/` as MLX custom kernels.

    Satisfies `_backend.Backend` (tests/test_structure.py checks it without a
    GPU: building one runs nothing).

    Args:
        backend (str): "metal" or "cuda": which instantiation of the kernels.
    """

    # plan.h reads either as it is: uint32 ids, as routers give them, need no
    # conversion launched before the plan.
    plan_id_dtypes = (mx.int32, mx.uint32)

    def __init__(self, backend: str):
        self.backend = backend

    def plan(
        self,
        ids: mx.array,
        weights: mx.array | None,
        *,
        num_experts: int,
        tile_m: int,
        top_k: int,
        stream: mx.Stream,
    ) -> tuple[list[mx.array], Callable[[str, tuple[int, ...]], mx.array]]:
        num_entries = ids.size
        has_weights = weights is not None
        layout, data_size = launch.plan_layout(num_entries, num_experts, tile_m)
        if num_entries == 0:
            # No kernel to run: with no entries every field is zeros (counts,
            # offsets and totals) or empty (the rest, capacity being 0).
            plan_data = mx.zeros((data_size,), mx.int32, stream=stream)
            row_weights = mx.zeros((0,), mx.float32, stream=stream)
        else:
            plan_launch = launch.plan_launch(num_entries, num_experts, tile_m, top_k,
                                             has_weights)
            # row_weights is a permutation of the weights that carries no gradient
            # (as in the C++ primitive); combine's gradient reaches them directly.
            weights_in = mx.stop_gradient(weights) if has_weights else _unused_weights()
            plan_data, row_weights = _run(self.backend, [ids, weights_in], plan_launch, stream)

        def field(name: str, shape: tuple[int, ...]) -> mx.array:
            if name == "row_weights":
                return row_weights
            offset, _ = layout[name]
            strides = [1] * len(shape)
            for axis in range(len(shape) - 2, -1, -1):
                strides[axis] = strides[axis + 1] * shape[axis + 1]
            return mx.as_strided(plan_data, shape, strides, offset, stream=stream)

        return [plan_data, row_weights] if has_weights else [plan_data], field

    def gather_rows(
        self,
        src: mx.array,
        index: mx.array,
        inverse: mx.array | None,
        *,
        dtype: mx.Dtype,
        stream: mx.Stream,
    ) -> mx.array:
        if inverse is None:  # the kernel alone: no gradient
            return _gather(self.backend, src, index, dtype, stream)
        return _gather_function(self.backend, dtype, stream)(src, index, inverse)

    def combine_rows(
        self,
        src: mx.array,
        index: mx.array,
        weights: mx.array | None,
        inverse: mx.array | None,
        *,
        dtype: mx.Dtype,
        stream: mx.Stream,
    ) -> mx.array:
        if inverse is None:  # the kernel alone: no gradient
            return _combine(self.backend, src, index, weights, dtype, stream)
        if weights is None:
            return _combine_function(self.backend, dtype, False, stream)(src, index, inverse)
        return _combine_function(self.backend, dtype, True, stream)(src, index, inverse, weights)

    def grouped_qmm_computes(self, *, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
        return (bits in launch.GROUPED_QMM_BITS and group_size in launch.GROUPED_QMM_QUANT_GROUPS
                and _name(dtype) in launch.GROUPED_QMM_DTYPES)

    def grouped_qmm_fuses(self, *, num_experts: int, in_dims: int, out_dims: int,
                          capacity: int, bits: int, group_size: int) -> bool:
        """By the launches' rule, `launch.fuses_gate_up`."""
        return launch.fuses_gate_up(num_experts, in_dims, out_dims, capacity, bits, group_size,
                                    backend=self.backend, warpgroup=warpgroup_mma())

    def argsort_slice_computes(self, *, row_size: int, dtype: mx.Dtype) -> bool:
        return _name(dtype) in launch.ROW_KINDS and row_size <= launch.ARGSORT_SLICE_MAX_ROW

    def head_norm_rope_computes(self, *, head_dim: int, dtype: mx.Dtype) -> bool:
        return _head_norm_rope_computes(head_dim, dtype)

    def head_norm_rope(self, queries_in: mx.array, keys_in: mx.array, q_weight: mx.array,
                       k_weight: mx.array, offsets: mx.array, *, batch: int, q_heads: int,
                       k_heads: int, q_at: int, k_at: int, eps: float, base: float,
                       scale: float, stream: mx.Stream) -> tuple[mx.array, mx.array]:
        """`_backend.HeadNormRope` in one launch of kernels/head_norm_rope.h."""
        q_shape, k_shape = queries_in.shape, keys_in.shape
        _check_head_norm_rope(q_shape, k_shape, q_weight.shape, k_weight.shape, offsets.shape,
                              queries_in.dtype, keys_in.dtype, q_weight.dtype, k_weight.dtype,
                              offsets.dtype, batch, q_heads, k_heads, q_at, k_at)
        step = _head_norm_rope_step(self.backend, batch, q_shape[1], q_heads, k_heads,
                                    q_weight.shape[0], q_shape[2], q_at, k_shape[2], k_at,
                                    offsets.size > 1, float(eps), float(base), float(scale),
                                    _name(queries_in.dtype), POISON, stream)
        return step(queries_in, keys_in, q_weight, k_weight, offsets)

    def decode_attention_computes(self, *, head_dim: int, heads: int, kv_heads: int,
                                  dtype: mx.Dtype) -> bool:
        # Not on Metal: MSL cannot test a pointer's alignment (IS_ALIGNED16 says
        # true there), so a view starting at an odd element would take the
        # body's 16-byte loads; CUDA tests it and takes the plain path.
        return self.backend == "cuda" and launch.decode_attention_computes(
            head_dim, heads, kv_heads, _name(dtype))

    def decode_attention(self, queries: mx.array, keys: mx.array, values: mx.array,
                         sinks: mx.array | None, *, scale: float, stream: mx.Stream,
                         mask: mx.array | None = None) -> mx.array:
        """`_backend.DecodeAttention` in two launches: kernels/decode_attention.h
        and kernels/decode_attention_merge.h."""
        _check_decode_attention(queries.shape, keys.shape, values.shape,
                                None if sinks is None else sinks.shape, queries.dtype,
                                keys.dtype, values.dtype, None if sinks is None else sinks.dtype,
                                None if mask is None else mask.shape,
                                None if mask is None else mask.dtype)
        batch, heads, _, head_dim = queries.shape
        step = _decode_attention_step(self.backend, batch, heads, keys.shape[1], head_dim,
                                      _name(queries.dtype), sinks is not None, mask is not None,
                                      float(scale), POISON, stream)
        # The step takes the sinks and mask it was made for, in that order.
        if sinks is None:
            if mask is None:
                return step(queries, keys, values)
            return step(queries, keys, values, mask)
        if mask is None:
            return step(queries, keys, values, sinks)
        return step(queries, keys, values, sinks, mask)

    def add_rms_norm_computes(self, *, dtype: mx.Dtype) -> bool:
        return _name(dtype) in launch.ROW_KINDS

    def add_rms_norm(self, residual: mx.array, update: mx.array, weight: mx.array, *,
                     eps: float, stream: mx.Stream) -> tuple[mx.array, mx.array]:
        """`_backend.AddRmsNorm` in one launch of kernels/add_rms_norm.h."""
        shape = residual.shape
        _check_add_rms_norm(shape, update.shape, weight.shape, residual.dtype, update.dtype,
                            weight.dtype)
        return _add_rms_norm_step(self.backend, shape, float(eps), _name(residual.dtype), POISON,
                                  stream)(residual, update, weight)

    def argsort_slice(self, values: mx.array, start: int, count: int, *,
                      normalize: bool = False,
                      stream: mx.Stream) -> tuple[mx.array, mx.array]:
        """`_backend.ArgsortSlice` in one launch of kernels/argsort_slice.h."""
        return _argsort_slice_function(self.backend, start, count, bool(normalize),
                                       stream)(values)

    def grouped_qmm(
        self,
        rows: mx.array,
        weight: mx.array,
        scales: mx.array,
        biases: mx.array,
        expert_offsets: mx.array,
        row_experts: mx.array,
        *,
        bits: int,
        group_size: int,
        stream: mx.Stream,
        row_tokens: mx.array | None = None,
        up: tuple[mx.array, mx.array, mx.array] | None = None,
        bias: mx.array | None = None,
        up_bias: mx.array | None = None,
        clamped_swiglu: tuple[float, float] | None = None,
        dense: bool = False,
    ) -> mx.array:
        """`_backend.GroupedQmm` by kernels/grouped_qmm.h: rows of
        `launch.GROUPED_QMM_DTYPES`, `launch.GROUPED_QMM_BITS` bits, quant
        groups of `launch.GROUPED_QMM_QUANT_GROUPS`."""
        if _name(rows.dtype) not in launch.GROUPED_QMM_DTYPES:
            raise ValueError(f"rows: grouped_qmm takes {' or '.join(launch.GROUPED_QMM_DTYPES)} "
                             f"rows, got {rows.dtype}")
        # The kernel walks each weight row by the rows' length: matrices of
        # another would be read past their ends, or at the wrong places.
        in_dims = rows.shape[-1]
        if (rows.ndim != 2 or weight.dtype != mx.uint32 or weight.ndim != 3
                or in_dims % group_size or weight.shape[2] * 32 != in_dims * bits):
            raise ValueError(f"weight: expected uint32 [E, N, {in_dims} * {bits} / 32] for rows "
                             f"{rows.shape} in groups of {group_size}, got {weight.dtype} "
                             f"{weight.shape}")
        expected = (*weight.shape[:2], in_dims // group_size)
        for name, array in (("scales", scales), ("biases", biases)):
            if (array.dtype, array.shape) != (rows.dtype, expected):
                raise ValueError(f"{name}: expected {rows.dtype} {expected} (the rows' dtype, "
                                 f"a group of {group_size} values each), got {array.dtype} "
                                 f"{array.shape}")
        if row_tokens is not None and (row_tokens.dtype != mx.int32 or row_tokens.ndim != 1):
            raise ValueError(f"row_tokens: expected int32 [capacity], got {row_tokens.dtype} "
                             f"{row_tokens.shape}")
        if up is not None:
            for name, mine, theirs in zip(("weight", "scales", "biases"), up,
                                          (weight, scales, biases)):
                if (mine.dtype, mine.shape) != (theirs.dtype, theirs.shape):
                    raise ValueError(f"up: its {name} must be {theirs.dtype} {theirs.shape} "
                                     f"as the gate's, got {mine.dtype} {mine.shape}")
        if up_bias is not None and (up is None or bias is None):
            raise ValueError("up_bias: the up projection's bias, given with up and bias only")
        if up is not None and bias is not None and up_bias is None:
            raise ValueError("up_bias: needed with up and bias (both projections' biases)")
        if clamped_swiglu is not None and up is None:
            raise ValueError("clamped_swiglu: the gated form's, given with up only")
        if clamped_swiglu is not None and not (
                len(clamped_swiglu) == 2 and all(math.isfinite(v) for v in clamped_swiglu)
                and clamped_swiglu[1] >= 0):
            raise ValueError(f"clamped_swiglu: expected (alpha, limit), finite, limit >= 0, "
                             f"got {clamped_swiglu}")
        for name, array in (("bias", bias), ("up_bias", up_bias)):
            if array is not None and (array.dtype, array.shape) != (rows.dtype,
                                                                     weight.shape[:2]):
                raise ValueError(f"{name}: expected {rows.dtype} {weight.shape[:2]} (the "
                                 f"rows' dtype, [E, N]), got {array.dtype} {array.shape}")
        clamped = None if clamped_swiglu is None else tuple(map(float, clamped_swiglu))
        function = _grouped_qmm_function(self.backend, bits, group_size, row_tokens is not None,
                                         up is not None, bias is not None, clamped, bool(dense),
                                         stream)
        extra = ([] if row_tokens is None else [row_tokens]) + ([] if up is None else list(up)) \
            + [b for b in (bias, up_bias) if b is not None]
        return function(rows, weight, scales, biases, expert_offsets, row_experts, *extra)


def _argsort_slice(backend, values, start, count, stream, normalize=False):
    *rows_shape, row_size = values.shape
    num_rows = math.prod(rows_shape)
    if num_rows == 0:
        return (mx.zeros((*rows_shape, count), mx.uint32),
                mx.zeros((*rows_shape, count), values.dtype))
    slice_launch = launch.argsort_slice_launch(num_rows, row_size, start, count,
                                               _name(values.dtype), normalize)
    indices, slice_values = _run(backend, [_device_buffer(values, stream)], slice_launch,
                                 stream)
    return indices.reshape(*rows_shape, count), slice_values.reshape(*rows_shape, count)


@cache_by_stream
def _argsort_slice_function(backend, start, count, normalize, stream):
    def launched(values):
        return _argsort_slice(backend, values, start, count, stream, normalize)

    def argsort_slice_vjp(primals, cotangents, outputs):
        # The gradient of take_along_axis at the same indices (and of the
        # division by their sum, normalized), by MLX's own (one input: MLX
        # hands it over as itself, not in a tuple).
        values, (indices, _) = primals, outputs

        def picked(v):
            taken = mx.take_along_axis(v, indices, axis=-1, stream=stream)
            if not normalize:
                return taken
            return mx.divide(taken, mx.sum(taken, axis=-1, keepdims=True, stream=stream),
                             stream=stream)

        _, (grad,) = mx.vjp(picked, [values], [cotangents[1]])
        return grad

    return _when_traced(launched, argsort_slice_vjp)


def _head_norm_rope_computes(head_dim: int, dtype: mx.Dtype) -> bool:
    return (_name(dtype) in launch.ROW_KINDS and head_dim % 2 == 0
            and 2 <= head_dim <= launch.HEAD_NORM_ROPE_MAX_HEAD)


@lru_cache(maxsize=256)
def _check_head_norm_rope(q_shape, k_shape, q_weight_shape, k_weight_shape, offsets_shape,
                          dtype, k_dtype, q_weight_dtype, k_weight_dtype, offsets_dtype, batch,
                          q_heads, k_heads, q_at, k_at) -> None:
    """Raises ValueError, naming the argument, where head_norm_rope.h cannot take
    these arrays (their shapes and dtypes) and sizes. Cached: every layer of a
    decoding step asks alike, and reading the arrays' attributes a check
    cost the host as much as the rest of the call."""
    for name, heads in (("q_heads", q_heads), ("k_heads", k_heads)):
        if heads < 1:
            raise ValueError(f"{name}: expected at least 1 head, got {heads}")
    if len(q_shape) != 3 or q_shape[0] != batch:
        raise ValueError(f"queries_in: expected [batch={batch}, length, values], got {q_shape}")
    head_dim = q_weight_shape[-1] if q_weight_shape else 0
    if len(q_weight_shape) != 1 or not _head_norm_rope_computes(head_dim, dtype):
        raise ValueError(f"q_weight: expected [head_dim], head_dim even from 2 to "
                         f"{launch.HEAD_NORM_ROPE_MAX_HEAD}, rows of a dtype of "
                         f"{launch.ROW_KINDS}, got {q_weight_shape} for rows of {dtype}")
    length = q_shape[1]
    for name, shape, rows_dtype, at, heads in (("queries_in", q_shape, dtype, q_at, q_heads),
                                               ("keys_in", k_shape, k_dtype, k_at, k_heads)):
        if (rows_dtype != dtype or len(shape) != 3 or shape[:2] != (batch, length)
                or at < 0 or at + heads * head_dim > shape[2]):
            raise ValueError(f"{name}: expected {dtype} [{batch}, {length}, >= {at} + {heads} "
                             f"* {head_dim}], got {rows_dtype} {shape}")
    for name, shape, weight_dtype in (("q_weight", q_weight_shape, q_weight_dtype),
                                      ("k_weight", k_weight_shape, k_weight_dtype)):
        if weight_dtype != dtype or shape != (head_dim,):
            raise ValueError(f"{name}: expected {dtype} [{head_dim}], got {weight_dtype} {shape}")
    if offsets_dtype != mx.int32 or offsets_shape not in ((1,), (batch,)):
        raise ValueError(f"offsets: expected int32 [1] or [{batch}], got {offsets_dtype} "
                         f"{offsets_shape}")


def _head_norm_rope_launched(backend, batch, length, q_heads, k_heads, head_dim, q_row, q_at,
                             k_row, k_at, per_sequence, eps, base, scale, dtype, poison,
                             stream) -> Callable:
    """The launch of an attention's queries' and keys' norms and rotations
    for these sizes (`launch.head_norm_rope_launch`'s), as
    `launched(queries_in, keys_in, q_weight, k_weight, offsets)`, bound here,
    once, as `_decode_attention_launched`'s."""
    if length == 0:
        return lambda queries_in, *_: (
            mx.zeros((batch, q_heads, 0, head_dim), queries_in.dtype),
            mx.zeros((batch, k_heads, 0, head_dim), queries_in.dtype))
    call, params = _launch_call(backend, launch.head_norm_rope_launch(
        batch, length, q_heads, k_heads, head_dim, q_row, q_at, k_row, k_at, per_sequence, eps,
        base, scale, dtype), poison, stream)

    def launched(queries_in, keys_in, q_weight, k_weight, offsets):
        queries, keys = call(inputs=[queries_in, keys_in, q_weight, k_weight, offsets, params])
        return queries, keys

    return launched


def head_norm_rope_by_ops(queries_in, keys_in, q_weight, k_weight, offsets, q_heads, k_heads,
                          q_at, k_at, eps, base, scale, stream=None):
    """What kernels/head_norm_rope.h computes, by MLX's own ops (`mx.fast.rms_norm`,
    `mx.fast.rope`), as Qwen3's attention calls them: its gradient's formula."""
    batch, length, _ = queries_in.shape
    head_dim = q_weight.shape[0]
    offset = offsets if offsets.size > 1 else offsets.reshape(())

    def heads(rows_in, at, count, weight):
        part = rows_in[..., at:at + count * head_dim].reshape(batch, length, count, head_dim)
        normed = mx.fast.rms_norm(part, weight, eps, stream=stream).transpose(0, 2, 1, 3)
        return mx.fast.rope(normed, head_dim, traditional=False, base=base, scale=scale,
                            offset=offset, stream=stream)

    return heads(queries_in, q_at, q_heads, q_weight), heads(keys_in, k_at, k_heads, k_weight)


def decode_attention_by_ops(queries, keys, values, sinks, mask, scale, stream=None):
    """What kernels/decode_attention.h computes, by MLX's own attention, as
    mlx-lm calls it for a decoding step: its gradient's formula."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask,
                                                sinks=sinks, stream=stream)


@lru_cache(maxsize=256)
def _check_decode_attention(q_shape, k_shape, v_shape, sinks_shape, dtype, k_dtype, v_dtype,
                            sinks_dtype, mask_shape=None, mask_dtype=None) -> None:
    """Raises ValueError, naming the argument, where decode_attention.h cannot
    take arrays of these shapes and dtypes. Cached, as `_check_head_norm_rope`."""
    if len(q_shape) != 4 or q_shape[2] != 1:
        raise ValueError(f"queries: expected [batch, heads, 1, head_dim], got {q_shape}")
    batch, heads, _, head_dim = q_shape
    if len(k_shape) != 4 or k_shape[0] != batch or k_shape[3] != head_dim or k_shape[2] < 1:
        raise ValueError(f"keys: expected [{batch}, kv_heads, >= 1 keys, {head_dim}], "
                         f"got {k_shape}")
    if not launch.decode_attention_computes(head_dim, heads, k_shape[1], _name(dtype)):
        raise ValueError(
            f"queries: expected float16 or bfloat16 heads of {launch.DECODE_ATTENTION_HEAD_DIMS} "
            f"values, 1 to 16 a key-value head and at most {launch.DECODE_ATTENTION_MAX_ROWS} "
            f"values in all, got {dtype} {q_shape} over {k_shape[1]} key-value heads")
    if k_dtype != dtype:
        raise ValueError(f"keys: expected {dtype}, got {k_dtype}")
    if v_shape != k_shape or v_dtype != dtype:
        raise ValueError(f"values: expected {dtype} {k_shape}, got {v_dtype} {v_shape}")
    if sinks_shape is not None and (sinks_shape != (heads,) or sinks_dtype != dtype):
        raise ValueError(f"sinks: expected {dtype} [{heads}], got {sinks_dtype} {sinks_shape}")
    if mask_shape is not None and (
            mask_dtype != mx.bool_
            or not decoding_mask_fits(mask_shape, batch, heads, k_shape[2])):
        raise ValueError(f"mask: expected bool [1 or {batch}, 1 or {heads}, 1, {k_shape[2]}], "
                         f"got {mask_dtype} {mask_shape}")


def _decode_attention_launched(backend, batch, heads, kv_heads, head_dim, dtype, has_sinks,
                               has_mask, scale, poison, stream) -> Callable:
    """The two launches of a decoding step's attention for these sizes, as
    `launched(queries, keys, values[, sinks][, mask])`: for each split count
    (`launch.decode_attention_splits` of the keys' count), its kernel
    objects and arguments bound once, when a call first takes it, rather
    than looked up anew at every call of every layer. The params of every
    split count are made here, in one array in device memory, each count's
    a view of it: a count met as the context grows then evaluates nothing
    in the middle of a step."""
    if batch == 0:
        return lambda queries, *_: mx.zeros(queries.shape, queries.dtype)
    unused_mask = _unused_mask()
    fields = launch.decode_attention_launches(batch, heads, kv_heads, head_dim, has_sinks,
                                              scale, dtype, has_mask, 1)[0].params
    most_splits = launch.decode_attention_most_splits(batch, kv_heads)
    # params_by_splits[splits - 1]: lazy views, evaluated with the first step
    # that takes them
    params_by_splits = mx.split(device_ints(
        tuple(value for splits in range(1, most_splits + 1)
              for value in fields._replace(splits=splits)), stream), most_splits, stream=stream)
    by_splits = {}

    def bound(splits):
        split_launch, merge_launch = launch.decode_attention_launches(
            batch, heads, kv_heads, head_dim, has_sinks, scale, dtype, has_mask, splits)
        made = by_splits[splits] = (_bound_kernel(backend, split_launch, poison, stream),
                                    _bound_kernel(backend, merge_launch, poison, stream),
                                    params_by_splits[splits - 1])
        return made

    def launched(queries, keys, values, *sinks_mask):
        splits = launch.decode_attention_splits(batch, kv_heads, keys.shape[2])
        split_call, merge_call, params = by_splits.get(splits) or bound(splits)
        # Without sinks or a mask the launches are handed arrays they never read.
        mask = sinks_mask[-1] if has_mask else unused_mask
        part_out, part_max, part_sum = split_call(inputs=[queries, keys, values, mask, params])
        sinks = sinks_mask[0] if has_sinks else part_max
        return merge_call(inputs=[part_out, part_max, part_sum, sinks, params])[0]

    return launched


@cache
def _unused_mask() -> mx.array:
    """Stands in for an absent mask: bool, as a mask is (the kernel's test of
    one must compile), and of 4 dimensions (its shape is handed over only
    for an array of some). Evaluated here, as `_unused_weights`."""
    unused = mx.ones((1, 1, 1, 1), mx.bool_)
    mx.eval(unused)
    return unused


def _decode_attention_by_ops_bound(has_sinks, has_mask, scale, stream) -> Callable:
    """`decode_attention_by_ops` called as `_decode_attention_launched`'s
    launches are: `(queries, keys, values[, sinks][, mask])`."""
    def by_ops(queries, keys, values, *sinks_mask):
        return decode_attention_by_ops(queries, keys, values,
                                       sinks_mask[0] if has_sinks else None,
                                       sinks_mask[-1] if has_mask else None, scale,
                                       stream=stream)

    return by_ops


@cache_by_stream(maxsize=256)
def _decode_attention_step(backend, batch, heads, kv_heads, head_dim, dtype, has_sinks,
                           has_mask, scale, poison, stream) -> Callable:
    """`_decode_attention_launched`'s launches as one differentiable call,
    made once for each size, dtype, form and stream: what a decoding step's
    every layer looks up. `poison` is the `POISON` its launches fill their
    outputs with first."""
    return _gradient_by_ops(
        _decode_attention_launched(backend, batch, heads, kv_heads, head_dim, dtype, has_sinks,
                                   has_mask, scale, poison, stream),
        _decode_attention_by_ops_bound(has_sinks, has_mask, scale, stream),
        differentiable=4 if has_sinks else 3)


def _gradient_by_ops(launched: Callable, by_ops: Callable, differentiable: int) -> Callable:
    """`launched(*arrays)` (a launch's outputs) with the gradient of `by_ops`
    (the same computation by MLX's own ops, as the launch's glue states it)
    with respect to the first `differentiable` arrays, the others (positions,
    say) getting zeros: an `mx.custom_function` where a transform could
    differentiate it (`_when_traced`)."""
    def vjp(primals, cotangents, outputs):
        fixed = primals[differentiable:]
        # A launch of one output gets its cotangent alone, not in a list.
        if isinstance(cotangents, mx.array):
            cotangents = [cotangents]
        _, grads = mx.vjp(lambda *arrays: by_ops(*arrays, *fixed),
                          list(primals[:differentiable]), list(cotangents))
        return (*grads, *(mx.zeros_like(array) for array in fixed))

    return _when_traced(launched, vjp)


@cache_by_stream(maxsize=256)
def _head_norm_rope_step(backend, batch, length, q_heads, k_heads, head_dim, q_row, q_at, k_row,
                         k_at, per_sequence, eps, base, scale, dtype, poison,
                         stream) -> Callable:
    """`_head_norm_rope_launched`'s launch as one differentiable call, made
    once for each size, dtype and stream, as `_decode_attention_step`."""
    launched = _head_norm_rope_launched(backend, batch, length, q_heads, k_heads, head_dim,
                                        q_row, q_at, k_row, k_at, per_sequence, eps, base, scale,
                                        dtype, poison, stream)
    sizes = (q_heads, k_heads, q_at, k_at, eps, base, scale)
    return _gradient_by_ops(
        launched, lambda *arrays: head_norm_rope_by_ops(*arrays, *sizes, stream=stream),
        differentiable=4)


@lru_cache(maxsize=256)
def _check_add_rms_norm(residual_shape, update_shape, weight_shape, dtype, update_dtype,
                        weight_dtype) -> None:
    """Raises ValueError, naming the argument, where add_rms_norm.h cannot take
    arrays of these shapes and dtypes. Cached, as `_check_head_norm_rope`."""
    if (len(residual_shape) < 1 or residual_shape[-1] < 1
            or _name(dtype) not in launch.ROW_KINDS):
        raise ValueError(f"residual: expected [..., dims] of a dtype of {launch.ROW_KINDS}, "
                         f"got {dtype} {residual_shape}")
    if update_shape != residual_shape or update_dtype != dtype:
        raise ValueError(f"update: expected {dtype} {residual_shape}, got {update_dtype} "
                         f"{update_shape}")
    if weight_shape != residual_shape[-1:] or weight_dtype != dtype:
        raise ValueError(f"weight: expected {dtype} [{residual_shape[-1]}], got {weight_dtype} "
                         f"{weight_shape}")


def _add_rms_norm_launched(backend, shape, eps, dtype, poison, stream) -> Callable:
    """The launch of a residual add and its norm for a residual of `shape`
    (`[..., dims]`), as `launched(residual, update, weight)`, bound here,
    once, as `_decode_attention_launched`'s; its rows come back in `shape`.
    Bound by the shape rather than the rows: the glue reads it for its check
    anyway, and a call then reads nothing of the arrays."""
    dims = shape[-1]
    rows = math.prod(shape) // dims
    if rows == 0:
        return lambda residual, *_: (mx.zeros(shape, residual.dtype),
                                     mx.zeros(shape, residual.dtype))
    call, params = _launch_call(backend, launch.add_rms_norm_launch(rows, dims, eps, dtype),
                                poison, stream)

    def launched(residual, update, weight):
        sums, normed = call(inputs=[residual, update, weight, params])
        return sums.reshape(shape), normed.reshape(shape)

    return launched


def add_rms_norm_by_ops(residual, update, weight, eps, stream=None):
    """What kernels/add_rms_norm.h computes, by MLX's own ops (an add and
    `mx.fast.rms_norm`), as a decoder layer calls them: its gradient's formula."""
    sums = mx.add(residual, update, stream=stream)
    return sums, mx.fast.rms_norm(sums, weight, eps, stream=stream)


@cache_by_stream(maxsize=256)
def _add_rms_norm_step(backend, shape, eps, dtype, poison, stream) -> Callable:
    """`_add_rms_norm_launched`'s launch as one differentiable call, made
    once for each shape, dtype and stream, as `_decode_attention_step`."""
    return _gradient_by_ops(
        _add_rms_norm_launched(backend, shape, eps, dtype, poison, stream),
        lambda *arrays: add_rms_norm_by_ops(*arrays, eps, stream=stream), differentiable=3)


def _device_buffer(array, stream):
    """`array`, or if it has fewer than 8 elements, flat and padded with zeros to 8.

    The bodies make `device` pointers into some of their inputs (casts to raw
    types in gather.h, combine.h and argsort_slice.h, a column's pointers in
    grouped_qmm.h), which Metal allows only into a `device` buffer, and MLX
    passes arrays of fewer than 8 elements as `constant`
    (tests/test_metal_source.py::test_inputs_pointed_into_are_device_buffers).
    The kernels never read the padding: they bound their reads by the sizes in
    their params, not by the buffer's.
    """
    if array.size >= 8:
        return array
    flat = array.reshape(-1)
    return mx.concatenate([flat, mx.zeros((8 - flat.size,), array.dtype)], stream=stream)


def _gather(backend, src, index, dtype, stream):
    num_src, hidden = src.shape
    num_rows = index.shape[0]
    if num_rows == 0 or hidden == 0:
        return mx.zeros((num_rows, hidden), dtype)
    src = _device_buffer(src, stream)
    gather_launch = launch.gather_launch(num_src, hidden, num_rows, _name(src.dtype),
                                         _name(dtype))
    (out,) = _run(backend, [src, index], gather_launch, stream)
    return out


def _combine(backend, src, index, weights, dtype, stream):
    num_src, hidden = src.shape
    num_out, fan_in = index.shape
    if num_out == 0 or hidden == 0:
        return mx.zeros((num_out, hidden), dtype)
    has_weights = weights is not None
    combine_launch = launch.combine_launch(
        num_src, hidden, num_out, fan_in, has_weights, _name(src.dtype), _name(dtype))
    weights_in = weights if has_weights else _unused_weights()
    src = _device_buffer(src, stream)
    (out,) = _run(backend, [src, index, weights_in], combine_launch, stream)
    return out


@cache_by_stream
def _gather_function(backend, dtype, stream):
    def launched(src, index, inverse):
        return _gather(backend, src, index, dtype, stream)

    def gather_vjp(primals, cotangent, output):
        src, index, inverse = primals
        # The formula of GatherRows::vjp in src/gather.cpp (tests/test_gradients.py).
        grad = _gradients.gather_rows_vjp(for_backend(backend), cotangent, src, inverse,
                                          stream=stream)
        return grad, mx.zeros_like(index), mx.zeros_like(inverse)

    return _when_traced(launched, gather_vjp)


@cache_by_stream
def _combine_function(backend, dtype, has_weights, stream):
    def combine_impl(src, index, inverse, weights=None):
        return _combine(backend, src, index, weights, dtype, stream)

    def combine_vjp(primals, cotangent, output):
        src, index, inverse = primals[:3]
        weights = primals[3] if has_weights else None
        # The formulas of CombineRows::vjp in src/combine.cpp (tests/test_gradients.py).
        grad_src, grad_weights = _gradients.combine_rows_vjp(
            for_backend(backend), cotangent, src, index, weights, inverse, stream=stream)
        if not has_weights:
            return grad_src, mx.zeros_like(index), mx.zeros_like(inverse)
        return grad_src, mx.zeros_like(index), mx.zeros_like(inverse), grad_weights

    return _when_traced(combine_impl, combine_vjp)


def _grouped_qmm(backend, rows, weight, scales, biases, expert_offsets, row_tokens, up,
                 out_biases, clamped, dense, bits, group_size, stream):
    num_rows, in_dims = rows.shape
    capacity = num_rows if row_tokens is None else row_tokens.shape[0]
    num_experts, out_dims, _ = weight.shape
    if capacity == 0 or out_dims == 0 or num_rows == 0:  # no rows: all tail, zeros
        return mx.zeros((capacity, out_dims), rows.dtype)
    qmm_launch = launch.grouped_qmm_launch(
        num_experts, in_dims, out_dims, capacity, bits, group_size, _name(rows.dtype),
        backend=backend, num_rows=None if row_tokens is None else num_rows,
        gated=up is not None, out_bias=out_biases is not None, clamped_swiglu=clamped,
        dense=dense, warpgroup=warpgroup_mma())
    # The body's arguments are fixed: an absent input is another it never reads.
    weight, scales, biases = (_device_buffer(a, stream) for a in (weight, scales, biases))
    up = (weight, scales, biases) if up is None else \
        tuple(_device_buffer(a, stream) for a in up)
    # The gate's bias and up's: one projection's stands in for up's too.
    out_biases = (scales, scales) if out_biases is None else \
        tuple(_device_buffer(a, stream) for a in (*out_biases, out_biases[0])[:2])
    (out,) = _run(backend, [rows, expert_offsets if row_tokens is None else row_tokens, weight,
                            scales, biases, *up, *out_biases, expert_offsets], qmm_launch,
                  stream)
    if out.ndim == 3:  # the input's splits' float sums (INPUT_SPLITS)
        splits = out.shape[0]
        out = _combine(backend, out.reshape(splits * capacity, out_dims),
                       _input_split_index(splits, capacity, stream), None, rows.dtype,
                       stream)
    return out


@cache  # the process's GPU does not change
def warpgroup_mma() -> bool:
    """Whether MLX's GPU has a warpgroup multiply-add: Hopper's wgmma, on CUDA's
    compute capability 9.0, for which MLX compiles custom kernels as sm_90a
    (the `a` features; not on 10.0, which has no wgmma). False elsewhere: a
    Metal GPU's and a CPU-only MLX's `device_info` give no compute capability.
    The block tiles take it there (`launch.grouped_qmm_launch`'s `warpgroup`)."""
    info = mx.device_info(mx.gpu)
    return (info.get("compute_capability_major"), info.get("compute_capability_minor")) == (9, 0)


@cache_by_stream
def _input_split_index(splits: int, capacity: int, stream: mx.Stream) -> mx.array:
    """combine.h's index that adds a split GEMM's float sums `[splits *
    capacity, N]` into its rows in split order, rounded once (one launch, the
    bits fixed; MLX's sum over the splits and then a cast are two): row r
    from rows r, capacity + r, ...; made once a shape and stream, on the
    device."""
    index = (mx.arange(capacity, dtype=mx.int32, stream=stream)[:, None]
             + mx.arange(0, splits * capacity, capacity, dtype=mx.int32, stream=stream))
    mx.eval(index)
    return index


def gated_activation(gate: mx.array, up: mx.array, clamped: tuple[float, float] | None,
                     stream=None) -> mx.array:
    """What the fused launch stores of its gate and up sums, in MLX's ops:
    mlx-lm's SwiGLU, silu(gate) * up, or with `clamped` (alpha, limit)
    gpt-oss's (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g =
    min(gate, limit) (mlx_lm.models.activations.swiglu_oai)."""
    if clamped is None:
        return gate * mx.sigmoid(gate, stream=stream) * up
    alpha, limit = clamped
    gate = mx.minimum(gate, limit, stream=stream)
    up = mx.clip(up, -limit, limit, stream=stream)
    return (up + 1.0) * (gate * mx.sigmoid(alpha * gate, stream=stream))


@cache_by_stream
def _grouped_qmm_function(backend, bits, group_size, token_rows, gated, out_bias, clamped,
                          dense, stream):
    def launched(rows, weight, scales, biases, expert_offsets, row_experts, *extra):
        row_tokens = extra[0] if token_rows else None
        up = tuple(extra[token_rows:token_rows + 3]) if gated else None
        out_biases = tuple(extra[token_rows + 3 * gated:]) if out_bias else None
        return _grouped_qmm(backend, rows, weight, scales, biases, expert_offsets, row_tokens,
                            up, out_biases, clamped, dense, bits, group_size, stream)

    def rows_projection(rows, row_experts, weight, scales, biases):
        # rows[r] @ dequantize(weight[e]).T by MLX's GEMM, each row [1, D]
        # against its expert (reshaped, not expand_dims: see
        # nn.SwitchGLU._expert_rows_used).
        out = mx.gather_qmm(rows.reshape(-1, 1, rows.shape[-1]), weight, scales, biases,
                            rhs_indices=row_experts, transpose=True, group_size=group_size,
                            bits=bits, sorted_indices=True, stream=stream)
        return out.reshape(rows.shape[0], out.shape[-1])

    def grouped_qmm_vjp(primals, cotangent, output):
        rows, weight, scales, biases, expert_offsets, row_experts, *extra = primals
        zeros = [mx.zeros_like(primal) for primal in primals[1:]]
        if not token_rows and not gated and not out_bias:
            # d rows[r] = cotangent[r] @ dequantize(weight[e]): MLX's own
            # GEMM. Tail rows carry the last expert and a zero cotangent
            # (nothing reads their zeros).
            grad = mx.gather_qmm(cotangent.reshape(-1, 1, cotangent.shape[-1]), weight, scales,
                                 biases, rhs_indices=row_experts, transpose=False,
                                 group_size=group_size, bits=bits, sorted_indices=True,
                                 stream=stream)
            return (grad.reshape(rows.shape), *zeros)

        # The fused forms: the gradient of what they fuse, in MLX's ops, with
        # the kernel's tokens: clamped into the tokens, the tail rows zeros
        # (their biases too). The projections' biases get theirs.
        in_spans = mx.arange(output.shape[0], stream=stream) < expert_offsets[-1]
        first_bias = token_rows + 3 * gated

        def unfused(rows, *out_biases):
            if token_rows:
                tokens = mx.clip(extra[0], 0, rows.shape[0] - 1, stream=stream)
                rows = mx.take(rows, tokens, axis=0, stream=stream)
                rows = mx.where(in_spans[:, None], rows, 0, stream=stream)

            def project(matrices, bias):
                out = rows_projection(rows, row_experts, *matrices)
                if bias is None:
                    return out
                row_bias = mx.take(bias, row_experts, axis=0, stream=stream)
                return out + mx.where(in_spans[:, None], row_bias, 0, stream=stream)

            out = project((weight, scales, biases), out_biases[0] if out_bias else None)
            if gated:
                up = project(extra[token_rows:first_bias], out_biases[1] if out_bias else None)
                out = gated_activation(out, up, clamped, stream)
            return out

        _, grads = mx.vjp(unfused, [rows, *extra[first_bias:]], [cotangent])
        return (grads[0], *zeros[:len(zeros) - (len(grads) - 1)], *grads[1:])

    return _when_traced(launched, grouped_qmm_vjp)


@cache
def for_backend(backend: str) -> GpuBackend:
    """The GPU backend of `backend` ("metal" or "cuda"), one per process."""
    return GpuBackend(backend)
