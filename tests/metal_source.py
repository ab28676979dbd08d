"""The Metal source MLX 0.32.4 compiles for one of our kernels (no GPU needed).

Our own restatement of what MLX's `mx.fast.metal_kernel` does when a kernel
object is called: `write_signature` plus the instantiation after it in
mlx/backend/common/metal_kernel.cpp (`metal_kernel`'s call operator). The
rules, as MLX 0.32.4 applies them:

- the header (our prelude) first, then `template <...>` when there are
  template arguments: `int`, `bool`, or `typename` for a Dtype;
- `[[kernel]] void <kernel name>(`, one parameter per line:
  - input i: `const constant T* name` if the array has fewer than 8 elements
    at call time, else `const device T* name` (`&` instead of `*` for a 0-d
    array), then `name_shape` / `name_strides` / `name_ndim` buffers when the
    body mentions them (arrays of 1+ dimensions only);
  - output: `device T* name`;
  - one `<type> <attr> [[<attr>]]` per thread attribute whose name occurs
    anywhere in the body text (plain substring search, comments included);
- the body (our prologue + body), `}`, then, with template arguments,
  `template [[host_name("K")]] [[kernel]] decltype(K<args>) K<args>;`.

MLX compiles `metal::utils()` (its kernels/utils.h, expanded when MLX was
built) followed by this text. `mx.fast.metal_kernel(...)(..., verbose=True)`
prints the same text; tests/test_metal_source.py checks the two agree.
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlx_moe_plan import kernels
from mlx_moe_plan.kernels.launch import INPUTS_OUTPUTS

# MLX's get_type_string for the dtypes our kernels see.
TYPE_NAMES = {
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.bool_: "bool",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
}

# The kernel input attributes MLX looks for, in its order, with the type it
# declares them with (MSL specification, Table 5.8).
THREAD_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

# Inputs with fewer elements go to the constant address space.
CONSTANT_LIMIT = 8

# The header MLX puts first, as the MLX wheel ships it (for an offline compile).
UTILS_INCLUDE = '#include "mlx/backend/metal/kernels/utils.h"\n'


def _template_value(value) -> tuple[str, str]:
    if isinstance(value, bool):
        return "bool", str(int(value))
    if isinstance(value, int):
        return "int", str(value)
    return "typename", TYPE_NAMES[value]


def input_location(dtype, shape) -> str:
    """The address space MLX gives an input array: 'constant' or 'device'."""
    return "constant" if math.prod(shape) < CONSTANT_LIMIT else "device"


def metal_source(name, template, input_arrays_meta, output_dtypes, *, utils=False) -> str:
    """The Metal text MLX compiles for kernel `name` of `_gpu.py`.

    `template` is the list of (name, value) pairs `_gpu.py` passes,
    `input_arrays_meta` one (dtype, shape) pair per input, or the arrays
    themselves. `utils=True` puts an #include of MLX's utils.h first, standing
    in for the `metal::utils()` text MLX prepends, so `xcrun metal` can compile it.
    """
    input_names, output_names = INPUTS_OUTPUTS[name]
    source = kernels.body(name, "metal")
    metas = [(m.dtype, tuple(m.shape)) if isinstance(m, mx.array) else m for m in input_arrays_meta]
    assert len(metas) == len(input_names) and len(output_dtypes) == len(output_names)

    kernel = f"custom_kernel_moe_{name}"
    params = [_template_value(value) for _, value in template]
    args = "<" + ", ".join(text for _, text in params) + ">"
    if template:
        kernel += "_" + args.replace(", ", "_").replace("<", "_").replace(">", "_")[:-1]
    for dtype, shape in metas:
        suffix = "s" if not shape else "c" if input_location(dtype, shape) == "constant" else ""
        kernel += "_" + TYPE_NAMES[dtype] + suffix
    kernel += "".join("_" + TYPE_NAMES[dtype] for dtype in output_dtypes)

    text = UTILS_INCLUDE if utils else ""
    text += kernels.prelude("metal", name)
    if template:
        text += "template <" + ", ".join(
            f"{kind} {pname}" for (pname, _), (kind, _) in zip(template, params)) + ">\n"
    text += f"[[kernel]] void {kernel}(\n"
    index = 0
    for input_name, (dtype, shape) in zip(input_names, metas):
        ref = "*" if shape else "&"
        text += (f"  const {input_location(dtype, shape)} {TYPE_NAMES[dtype]}{ref} {input_name}"
                 f" [[buffer({index})]],\n")
        index += 1
        extras = [("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                  ("_ndim", "const constant int&")]
        for extra, kind in extras if shape else []:
            if input_name + extra in source:
                text += f"  {kind} {input_name}{extra} [[buffer({index})]],\n"
                index += 1
    attributes = [f"  {kind} {attr} [[{attr}]]"
                  for attr, kind in THREAD_ATTRIBUTES if attr in source]
    for output_name, dtype in zip(output_names, output_dtypes):
        text += f"  device {TYPE_NAMES[dtype]}* {output_name} [[buffer({index})]]"
        # MLX compares the buffer index (shape buffers included) with the
        # number of inputs and outputs to find the last parameter.
        last = index >= len(metas) + len(output_names) - 1 and not attributes
        text += ") {\n" if last else ",\n"
        index += 1
    if attributes:
        text += ",\n".join(attributes) + ") {\n"
    text += source + "\n}\n"
    if template:
        text += (f'\ntemplate [[host_name("{kernel}")]] [[kernel]] '
                 f"decltype({kernel}{args}) {kernel}{args};\n")
    return text
