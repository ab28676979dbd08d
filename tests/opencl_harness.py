"""The kernel bodies as OpenCL C on PoCL: the third instantiation of each text.

A program is `#define` lines for the template constants, then
`kernels.prelude("opencl", name)`, then a generated `__kernel void moe_<name>(...)`
around `kernels.body(name, "opencl")`, its arguments named and ordered as in
`kernels/launch.py`'s INPUTS_OUTPUTS (inputs `const`). OpenCL C has no templates: a dtype
argument becomes `#define InT half` (say), and InT / OutT also an IN_DTYPE /
OUT_DTYPE code that picks the prelude's conversions; ints and bools become
numbers.

`plan`, `gather`, `combine` and `grouped_qmm` run the bodies as `_gpu.py` does, from the same
`kernels/launch.py` launches: arrays, params, template constants, groups and
group sizes. Every output buffer is poisoned first (`POISON_BYTE` in every
byte), so an element no kernel writes shows in the comparison with the
reference.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import cache

# pyopencl's wheel brings its own PoCL (3.0, on LLVM 14), which cannot build a
# kernel for a CPU that LLVM 14 does not know ("unknown target CPU 'generic'",
# on AMD's Zen 5): let its ICD loader see the system's OpenCL platforms too
# (Debian's pocl-opencl-icd, which .ci/run installs), before it first looks.
if "OCL_ICD_VENDORS" not in os.environ and os.path.isdir("/etc/OpenCL/vendors"):
    os.environ["OCL_ICD_VENDORS"] = "/etc/OpenCL/vendors"
# PoCL runs a group's work-items as loops between its barriers; by default it
# then vectorizes those loops (loopvec), and PoCL 3.1's vectorized form of
# grouped_qmm_tiles.h, since its items ran in runs (ACROSS_ITEMS), corrupted
# the heap in groups of 256 and 512 work-items, default runs of one item
# too, where the plain loops and the continuation-based form (cbs) ran it
# right. The plain loops, which also build faster.
os.environ.setdefault("POCL_WORK_GROUP_METHOD", "loops")

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402

from mlx_moe_plan import kernels
from mlx_moe_plan import reference as ref
from mlx_moe_plan.kernels import launch

# 0x7F7F7F7F: int32 2139062143, float32 3.39e38, float16 a NaN, bfloat16
# 3.39e38. No kernel writes it: rows, ids and counts are far smaller, and the
# tests' float values avoid it.
POISON_BYTE = 0x7F

# Dtype name: (NumPy storage, OpenCL C type). bfloat16 is stored as its bits,
# as the reference takes it.
DTYPES = {
    "float32": (np.float32, "float"),
    "float16": (np.float16, "half"),
    "bfloat16": (np.uint16, "ushort"),
    "int32": (np.int32, "int"),
    "uint16": (np.uint16, "ushort"),
    "uint32": (np.uint32, "uint"),
}
ROW_DTYPES = ("float32", "float16", "bfloat16")  # prelude_opencl.h's codes 0, 1, 2
_DTYPE_CODES = {"InT": "IN_DTYPE", "OutT": "OUT_DTYPE"}

# Argument types by name; every other argument is int32, or uint32 where the
# array given for it is (`run`: the plan's ids, as routers give them).
_ARG_TYPES = {"src": "InT", "out": "OutT", "weights": "float", "row_weights": "float",
              "rows": "InT", "weight": "uint", "scales": "InT", "biases": "InT",
              "up_weight": "uint", "up_scales": "InT", "up_biases": "InT", "bias": "InT",
              "up_bias": "InT",
              "values": "InT", "indices": "uint", "slice_values": "InT",
              "queries_in": "InT", "keys_in": "InT", "q_weight": "InT", "k_weight": "InT",
              "queries": "OutT", "keys": "OutT",
              "residual": "InT", "update": "InT", "norm_weight": "InT", "sums": "OutT",
              "normed": "OutT"}

# Where a body's argument of a name above has another type.
_BODY_ARG_TYPES = {
    "decode_attention": {"queries": "InT", "keys": "InT", "values": "InT", "mask": "uchar",
                         "part_out": "float", "part_max": "float", "part_sum": "float"},
    "decode_attention_merge": {"part_out": "float", "part_max": "float", "part_sum": "float",
                               "sinks": "InT"},
}

# The shape and strides (in elements) MLX hands with an input whose
# `NAME_shape` or `NAME_strides` a body names, as buffers after it.
_VIEW_ARGUMENTS = (("_shape", "int", np.int32), ("_strides", "long", np.int64))


@cache
def _views(name: str) -> dict[str, tuple[tuple[str, str, type], ...]]:
    """Each input of body `name` and the view arguments that follow it, in order."""
    body = kernels.body(name, "opencl")
    return {arg: tuple(view for view in _VIEW_ARGUMENTS if arg + view[0] in body)
            for arg in launch.INPUTS_OUTPUTS[name][0]}

_BUILD_OPTIONS = ["-cl-std=CL1.2"]

# OpenCL buffers always start 16-byte aligned, so IS_ALIGNED16 holds for every
# argument here; a GPU gets unaligned ones from MLX views (an array sliced past
# its first element), and the bodies take their element paths for them.
# Within `unaligned_buffers()` the programs take every pointer as unaligned.
_UNALIGNED = "#undef IS_ALIGNED16\n#define IS_ALIGNED16(p) false"
_unaligned = False


@contextmanager
def unaligned_buffers():
    """Run the bodies as if no buffer were 16-byte aligned, within the block."""
    global _unaligned
    _unaligned = True
    try:
        yield
    finally:
        _unaligned = False


class Unavailable(RuntimeError):
    """No OpenCL platform of PoCL with a device is present."""


class CannotBuild(RuntimeError):
    """PoCL is present, and none of its devices builds a kernel: a failure of
    the setup, not a reason to skip the kernel bodies' tests."""


@cache
def _opencl() -> tuple[cl.Context, cl.CommandQueue]:
    """The first PoCL device that builds a kernel, its context and queue."""
    try:
        platforms = cl.get_platforms()
    except cl.Error as error:  # no ICD loader entry at all
        platforms, why = [], str(error)
    else:
        why = f"OpenCL platforms: {[platform.name for platform in platforms]}"
    failures = []
    for platform in platforms:
        if "portable computing language" not in platform.name.lower():
            continue
        for one in platform.get_devices():
            context = cl.Context([one])
            try:
                cl.Program(context, "__kernel void probe(__global int* a) { a[0] = 1; }").build()
            except cl.Error as error:
                log = str(error).strip().splitlines()
                said = [line for line in log if "error:" in line] or log[-1:]
                failures.append(f"{platform.version.strip()}: {said[0].strip()}")
                continue
            return context, cl.CommandQueue(context)
    if failures:
        raise CannotBuild(f"no PoCL device builds a kernel here ({'; '.join(failures)}). "
                          "pyopencl's PoCL 3.0 (LLVM 14) does not know CPUs newer than "
                          "LLVM 14, such as AMD's Zen 5: install the system's PoCL "
                          "(Debian and Ubuntu: apt-get install pocl-opencl-icd)")
    raise Unavailable(f"no PoCL device ({why}); install the test extra, which brings "
                      "pyopencl and pocl-binary-distribution")


def device() -> cl.Device:
    return _opencl()[0].devices[0]


def dtype_name(array: np.ndarray) -> str:
    """The reference's dtype name of a row array: uint16 holds bfloat16 bits."""
    for name in ROW_DTYPES:
        if array.dtype == DTYPES[name][0]:
            return name
    raise TypeError(f"not a row dtype: {array.dtype}")


def source(name: str, template: tuple, unaligned: bool = False,
           unsigned_inputs: tuple[str, ...] = ()) -> str:
    """The OpenCL C program of body `name` with `template`'s constants (and
    every pointer taken as unaligned if `unaligned`); the inputs named in
    `unsigned_inputs` are uint32, as MLX types an argument by its array."""
    defines = []
    for key, value in template:
        if key in _DTYPE_CODES:
            defines.append(f"#define {_DTYPE_CODES[key]} {ROW_DTYPES.index(value)}")
        value = DTYPES[value][1] if isinstance(value, str) else int(value)
        defines.append(f"#define {key} {value}")
    inputs, outputs = launch.INPUTS_OUTPUTS[name]
    types = _ARG_TYPES | _BODY_ARG_TYPES.get(name, {})
    arguments = []
    for arg in inputs:
        kind = "uint" if arg in unsigned_inputs else types.get(arg, "int")
        arguments.append(f"__global const {kind}* {arg}")
        arguments += [f"__global const {view_kind}* {arg}{suffix}"
                      for suffix, view_kind, _ in _views(name)[arg]]
    arguments += [f"__global {types.get(arg, 'int')}* {arg}" for arg in outputs]
    return "\n".join([
        *defines,
        kernels.prelude("opencl", name),
        *([_UNALIGNED] if unaligned else []),
        f"__kernel void moe_{name}({', '.join(arguments)}) {{",
        kernels.body(name, "opencl"),
        "}",
    ])


@cache
def kernel(name: str, template: tuple, unaligned: bool = False,
           unsigned_inputs: tuple[str, ...] = ()) -> cl.Kernel:
    """The built kernel, one per body, set of defines and argument types."""
    context, _ = _opencl()
    program = cl.Program(context, source(name, template, unaligned, unsigned_inputs)).build(
        options=_BUILD_OPTIONS)
    return cl.Kernel(program, f"moe_{name}")


def max_group_size(name: str, template: tuple) -> int:
    return kernel(name, template).get_work_group_info(
        cl.kernel_work_group_info.WORK_GROUP_SIZE, device())


def _buffer(context: cl.Context, queue: cl.CommandQueue, array: np.ndarray) -> cl.Buffer:
    # OpenCL has no empty buffers; an empty input is never read.
    buffer = cl.Buffer(context, cl.mem_flags.READ_WRITE, max(array.nbytes, 16))
    if array.nbytes:
        cl.enqueue_copy(queue, buffer, np.ascontiguousarray(array))
    return buffer


def run(arrays: list[np.ndarray], kernel_launch: launch.Launch,
        views: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None
        ) -> list[np.ndarray]:
    """`kernel_launch`'s body on `arrays`, then the params array, as `_gpu._run` runs it.

    An input whose shape or strides the body reads gets its array's own
    (C order), or the (shape, strides in elements) `views` gives for its
    name: a view of the array's buffer, as MLX hands a slice over."""
    name = kernel_launch.body
    context, queue = _opencl()
    limit = max_group_size(name, kernel_launch.template)
    if kernel_launch.group_size > limit:  # never shrink a group here: the bodies assume their size
        raise RuntimeError(
            f"moe_{name}: launch.py asks for groups of {kernel_launch.group_size} but this "
            f"OpenCL device ({device().name}) runs at most {limit} for this kernel, so the test "
            "cannot run it as Metal and CUDA do")
    outputs = []
    for shape, dtype in kernel_launch.outputs:
        poisoned = np.empty(shape, DTYPES[dtype][0])
        poisoned.view(np.uint8)[...] = POISON_BYTE
        outputs.append(poisoned)
    inputs = [*arrays, np.array(kernel_launch.params, np.int32)]
    unsigned_inputs = tuple(arg for arg, array in zip(launch.INPUTS_OUTPUTS[name][0], inputs)
                            if arg not in _ARG_TYPES and array.dtype == np.uint32)
    views = views or {}
    arguments = []
    for arg, array in zip(launch.INPUTS_OUTPUTS[name][0], inputs):
        arguments.append(array)
        view = dict(zip(("_shape", "_strides"), views.get(
            arg, (array.shape, tuple(stride // array.itemsize for stride in array.strides)))))
        arguments += [np.array(view[suffix], dtype) for suffix, _, dtype in _views(name)[arg]]
    buffers = [_buffer(context, queue, array) for array in [*arguments, *outputs]]
    size = kernel_launch.group_size
    kernel(name, kernel_launch.template, _unaligned, unsigned_inputs)(
        queue, (kernel_launch.groups * size,), (size,), *buffers)
    for array, buffer in zip(outputs, buffers[len(arguments):]):
        cl.enqueue_copy(queue, array, buffer)
    queue.finish()
    return outputs


def plan(ids, weights, num_experts: int, tile_m: int, top_k: int) -> ref.ReferencePlan:
    """The plan kernel as `_gpu.GpuBackend.plan` runs it; int32 or uint32 `ids` [..., K]."""
    ids = np.asarray(ids)
    assert ids.dtype in (np.int32, np.uint32), \
        "the kernel reads int32 or uint32 ids (plan.py converts the others)"
    flat = ids.reshape(-1)
    num_entries = flat.size
    capacity = ref.capacity_for(num_entries, num_experts, tile_m)
    has_weights = weights is not None
    sizes = dict(num_experts=num_experts, tile_m=tile_m, capacity=capacity,
                 max_tiles=capacity // tile_m, top_k=top_k)
    if num_entries == 0:  # _gpu.py runs no kernel
        empty = np.zeros(0, np.int32)
        return ref.ReferencePlan(
            empty, empty, np.zeros(0, np.float32) if has_weights else None, empty,
            empty.reshape(ids.shape), np.zeros(num_experts, np.int32),
            np.zeros(num_experts + 1, np.int32), empty, 0, 0, 0, **sizes)
    plan_launch = launch.plan_launch(num_entries, num_experts, tile_m, top_k, has_weights)
    weights_in = np.zeros(1, np.float32) if weights is None else np.asarray(weights, np.float32)
    plan_data, row_weights = run([flat, weights_in.reshape(-1)], plan_launch)
    layout, _ = launch.plan_layout(num_entries, num_experts, tile_m)
    fields = {name: plan_data[offset:offset + size] for name, (offset, size) in layout.items()}
    return ref.ReferencePlan(
        row_tokens=fields["row_tokens"], row_experts=fields["row_experts"],
        row_weights=row_weights if has_weights else None, row_entries=fields["row_entries"],
        positions=fields["positions"].reshape(ids.shape),
        expert_counts=fields["expert_counts"], expert_offsets=fields["expert_offsets"],
        tile_experts=fields["tile_experts"], num_rows=int(fields["num_rows"][0]),
        num_tiles=int(fields["num_tiles"][0]), num_invalid=int(fields["num_invalid"][0]),
        **sizes,
    )


def _device_buffer(array: np.ndarray) -> np.ndarray:
    """`array`, or flat and padded with zeros to 8 elements if it has fewer,
    as `_gpu._device_buffer` hands the inputs a body points into to Metal
    (the bodies never read the padding)."""
    if array.size >= 8:
        return array
    return np.concatenate([array.reshape(-1), np.zeros(8 - array.size, array.dtype)])


def gather(src: np.ndarray, index: np.ndarray, out_dtype: str) -> np.ndarray:
    """`out[r] = src[index[r]]` (zeros where absent) as `_gpu._gather` runs it.

    `src` is [num_src, H] float32, float16 or uint16 (bfloat16 bits); `index`
    int32 [num_rows]; `out_dtype` one of `ROW_DTYPES`.
    """
    num_src, hidden = src.shape
    num_rows = index.shape[0]
    if num_rows == 0 or hidden == 0:
        return np.zeros((num_rows, hidden), DTYPES[out_dtype][0])
    gather_launch = launch.gather_launch(num_src, hidden, num_rows, dtype_name(src), out_dtype)
    (out,) = run([_device_buffer(src), np.asarray(index, np.int32)], gather_launch)
    return out


def combine(src: np.ndarray, index: np.ndarray, weights, out_dtype: str) -> np.ndarray:
    """`out[n] = sum_m weights[n, m] * src[index[n, m]]` as `_gpu._combine` runs it.

    `index` is int32 [num_out, FAN_IN]; `weights` float32 of its shape or None.
    """
    num_src, hidden = src.shape
    num_out, fan_in = index.shape
    if num_out == 0 or hidden == 0:
        return np.zeros((num_out, hidden), DTYPES[out_dtype][0])
    has_weights = weights is not None
    combine_launch = launch.combine_launch(
        num_src, hidden, num_out, fan_in, has_weights, dtype_name(src), out_dtype)
    weights_in = np.asarray(weights, np.float32) if has_weights else np.zeros(1, np.float32)
    (out,) = run([_device_buffer(src), np.asarray(index, np.int32), weights_in],
                 combine_launch)
    return out


def grouped_qmm(rows: np.ndarray, weight: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                expert_offsets: np.ndarray, bits: int, group_size: int, *,
                row_tokens: np.ndarray | None = None, up: tuple | None = None,
                out_biases: tuple | None = None,
                clamped_swiglu: tuple[float, float] | None = None,
                dense: bool = False) -> np.ndarray:
    """The expert GEMM over sorted rows as `_gpu._grouped_qmm` runs it.

    `rows` [capacity, in] float32, float16 or uint16 (bfloat16 bits), the
    scales and biases of the same dtype; `weight` uint32 [E, out, in * bits /
    32]; `expert_offsets` int32 [E + 1]. With `row_tokens` int32 [capacity],
    `rows` are tokens [T, in] and row r is `rows[row_tokens[r]]`; with `up`,
    (weight, scales, biases) of a second projection, silu(gate) * up, or
    gpt-oss's `clamped_swiglu` (alpha, limit); `out_biases`: each
    projection's bias [E, out] (the gate's, then up's when gated) of the
    rows' dtype; `dense`: one expert, a dense projection (the launch's).
    Returns [capacity, out] in the rows' dtype.
    """
    num_rows, in_dims = rows.shape
    num_experts, out_dims, _ = weight.shape
    capacity = num_rows if row_tokens is None else len(row_tokens)
    if capacity == 0 or out_dims == 0 or num_rows == 0:  # no kernel runs: all tail, zeros
        return np.zeros((capacity, out_dims), rows.dtype)
    qmm_launch = launch.grouped_qmm_launch(
        num_experts, in_dims, out_dims, capacity, bits, group_size, dtype_name(rows),
        backend="opencl", num_rows=None if row_tokens is None else num_rows,
        gated=up is not None, out_bias=out_biases is not None, clamped_swiglu=clamped_swiglu,
        dense=dense)
    offsets = np.asarray(expert_offsets, np.int32)
    weight = np.asarray(weight, np.uint32)
    matrices = [_device_buffer(a) for a in (weight, scales, biases)]
    up = matrices if up is None else \
        [_device_buffer(a) for a in (np.asarray(up[0], np.uint32), *up[1:])]
    # The gate's bias and up's; one projection's stands in for up's too.
    out_biases = [matrices[1]] * 2 if out_biases is None else \
        [_device_buffer(b) for b in (*out_biases, out_biases[0])][:2]
    arrays = [rows, offsets if row_tokens is None else np.asarray(row_tokens, np.int32),
              *matrices, *up, *out_biases, offsets]
    (out,) = run(arrays, qmm_launch)
    if out.ndim == 3:  # the input's splits' float sums (INPUT_SPLITS), as _gpu adds them
        splits = out.shape[0]
        index = np.arange(capacity)[:, None] + capacity * np.arange(splits)
        out = combine(out.reshape(splits * capacity, out_dims), index, None, dtype_name(rows))
    return out


def argsort_slice(values: np.ndarray, start: int, count: int,
                  normalize: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Positions [start, start + count) of each row's stable ascending argsort,
    and the values there (over their sum with `normalize`), as
    `_gpu.GpuBackend.argsort_slice` runs it; `values` [rows, E] float32,
    float16 or uint16 (bfloat16 bits). Returns uint32 [rows, count] and
    [rows, count] of `values`' dtype."""
    num_rows, row_size = values.shape
    if num_rows == 0:
        return np.zeros((0, count), np.uint32), np.zeros((0, count), values.dtype)
    slice_launch = launch.argsort_slice_launch(num_rows, row_size, start, count,
                                               dtype_name(values), normalize)
    indices, slice_values = run([_device_buffer(values)], slice_launch)
    return indices, slice_values


def head_norm_rope(queries_in: np.ndarray, keys_in: np.ndarray, q_weight: np.ndarray,
                   k_weight: np.ndarray, offsets: np.ndarray, q_heads: int, k_heads: int,
                   q_at: int, k_at: int, eps: float, base: float,
                   scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Queries and keys normalized and rotated, as `_gpu.GpuBackend.head_norm_rope`
    runs it; `queries_in` and `keys_in` [batch, length, values] float32,
    float16 or uint16 (bfloat16 bits), the weights of the same storage,
    `offsets` int32 [batch] or [1]."""
    batch, length, _ = queries_in.shape
    head_dim = q_weight.shape[0]
    head_launch = launch.head_norm_rope_launch(
        batch, length, q_heads, k_heads, head_dim, queries_in.shape[2], q_at, keys_in.shape[2],
        k_at, offsets.size > 1, eps, base, scale, dtype_name(queries_in))
    queries, keys = run([queries_in, keys_in, q_weight, k_weight,
                         np.asarray(offsets, np.int32)], head_launch)
    return queries, keys


def add_rms_norm(residual: np.ndarray, update: np.ndarray, weight: np.ndarray,
                 eps: float) -> tuple[np.ndarray, np.ndarray]:
    """A residual add and the RMS norm after it, as `_gpu.GpuBackend.add_rms_norm`
    runs it; `residual` and `update` [rows, dims] float32, float16 or uint16
    (bfloat16 bits), `weight` [dims] of the same storage."""
    rows, dims = residual.shape
    norm_launch = launch.add_rms_norm_launch(rows, dims, eps, dtype_name(residual))
    sums, normed = run([residual, update, weight], norm_launch)
    return sums, normed


def decode_attention(queries: np.ndarray, key_buffer: np.ndarray, value_buffer: np.ndarray,
                     keys_count: int, sinks: np.ndarray | None, scale: float,
                     mask: np.ndarray | None = None) -> np.ndarray:
    """A decoding step's attention as `_gpu.GpuBackend.decode_attention` runs it:
    `queries` [batch, heads, 1, head_dim] float16 or uint16 (bfloat16 bits),
    the first `keys_count` keys and values of `key_buffer` and `value_buffer`
    [batch, kv_heads, length, head_dim] of the same storage, read where they
    lie (a cache's slice), `sinks` [heads] or None, `mask` bool [batch or 1,
    heads or 1, 1, keys_count] or None."""
    batch, heads, _, head_dim = queries.shape
    kv_heads = key_buffer.shape[1]
    dtype = dtype_name(queries)
    split_launch, merge_launch = launch.decode_attention_launches(
        batch, heads, kv_heads, head_dim, sinks is not None, scale, dtype, mask is not None,
        launch.decode_attention_splits(batch, kv_heads, keys_count))
    views = {name: ((batch, kv_heads, keys_count, head_dim),
                    tuple(stride // buffer.itemsize for stride in buffer.strides))
             for name, buffer in (("keys", key_buffer), ("values", value_buffer))}
    mask = np.ones((1, 1, 1, 1), bool) if mask is None else mask  # an unread stand-in
    parts = run([queries, key_buffer, value_buffer, mask], split_launch, views)
    (out,) = run([*parts, queries.reshape(-1)[:heads] if sinks is None else sinks],
                 merge_launch)
    return out
