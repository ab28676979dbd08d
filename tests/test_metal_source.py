# The Metal text of every kernel launch _gpu.py makes, checked against the
# Metal Shading Language specification (MSL 4, section numbers below) without
# a GPU: tests/metal_source.py builds the source as MLX 0.32.4 does, and
# test_matches_mlx checks it against the text MLX itself generates.
#
# The launches are recorded, not restated: the GPU backend runs with
# _gpu._kernel replaced by a recorder, so the template arguments, input sizes
# (constant vs device) and group sizes are those _gpu.py really uses.
#
# Compiling needs Apple's Metal compiler (`xcrun metal`), which exists only on
# macOS: test_xcrun_compiles runs there and is skipped everywhere else.

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import mlx.core as mx
import pytest
from conftest import EVERY_SIZE_MIN_GROUPS, OTHER_MADE_WEIGHTS_ROW_TILES, SHARED_WEIGHTS_BLOCK
from metal_source import THREAD_ATTRIBUTES, TYPE_NAMES, input_location, metal_source

from mlx_moe_plan import MAX_EXPERTS, _gpu, kernels
from mlx_moe_plan.kernels.launch import GROUPED_QMM_TILING, INPUTS_OUTPUTS, grouped_qmm_tiling

ROW_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
ADDRESS_SPACES = ("device", "constant", "threadgroup", "thread")
THREADGROUP_MEMORY = 32 * 1024  # bytes a Metal threadgroup may declare
MAX_THREADS = 1024  # threads a threadgroup may have
TYPE_BYTES = {"atomic_uint": 4, "atomic_int": 4, "int": 4, "uint": 4, "unsigned": 4,
              "float": 4, "half": 2, "bfloat": 2, "i64": 8, "long": 8, "uint4": 16}


# --- the launches ---------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    name: str
    template: tuple
    inputs: tuple  # (dtype, shape) per input
    output_dtypes: tuple
    grid: tuple
    threadgroup: tuple
    launch_bounds: tuple | None = None  # CUDA's (threads, groups an SM), as the glue asks

    def source(self, **kwargs) -> str:
        return metal_source(self.name, self.template, self.inputs, self.output_dtypes, **kwargs)

    def location(self, input_name: str) -> str:
        names = INPUTS_OUTPUTS[self.name][0]
        return input_location(*self.inputs[names.index(input_name)])

    @property
    def id(self) -> str:
        return re.search(r"\[\[kernel\]\] void custom_kernel_moe_(\w+)", self.source()).group(1)


@contextmanager
def recording(launches: list[Launch]):
    """Within the block, the GPU backend's kernels replaced by a recorder that
    appends each launch to `launches` and returns zeros."""
    def fake_kernel(backend, name, shared_bytes=0, launch_bounds=None):
        def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
            metas = tuple((a.dtype, tuple(a.shape)) for a in inputs)
            launches.append(Launch(name, tuple(template), metas, tuple(output_dtypes),
                                   tuple(grid), tuple(threadgroup), launch_bounds))
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return call

    # The glues that bind their launches once a size keep them in caches of
    # their own: fresh ones while the recorder stands in, dropped after it.
    steps = {name: getattr(_gpu, name).fresh()
             for name in ("_decode_attention_step", "_head_norm_rope_step", "_add_rms_norm_step")}
    with mock.patch.object(_gpu, "_kernel", fake_kernel), mock.patch.multiple(_gpu, **steps):
        yield


def record_launches(backend: str = "metal") -> list[Launch]:
    """Every launch the GPU backend makes for `backend` over the shapes below,
    its kernels replaced by a recorder, repeats included."""
    launches = []
    gpu = _gpu.GpuBackend(backend)
    with recording(launches):
        # plan: tiny arrays (constant address space) up to the expert limit;
        # int32 ids, and uint32 ones as routers give them.
        for entries, experts, tile_m, top_k in [(1, 1, 1, 1), (6, 3, 2, 2), (3000, 1024, 128, 2),
                                                (5000, MAX_EXPERTS, 16, 8)]:
            for ids in (mx.zeros((entries,), mx.int32), mx.zeros((entries,), mx.uint32)):
                for weights in (None, mx.zeros((entries,), mx.float32)):
                    gpu.plan(ids, weights, num_experts=experts, tile_m=tile_m, top_k=top_k,
                             stream=None)
        for src_dtype in ROW_DTYPES:
            for dtype in ROW_DTYPES:
                # gather: tiny, 16-byte rows, 1024-vector rows, odd rows.
                for num_src, hidden, num_rows in [(1, 4, 1), (16, 8, 40), (8, 4096, 9), (5, 7, 3)]:
                    src = mx.zeros((num_src, hidden), src_dtype)
                    index = mx.zeros((num_rows,), mx.int32)
                    gpu.gather_rows(src, index, index, dtype=dtype, stream=None)
                # combine: tiny, wide, odd; weighted and not.
                combine_shapes = [(1, 1, 1, 1), (64, 5000, 8, 8), (10, 33, 3, 2)]
                for num_src, hidden, num_out, fan_in in combine_shapes:
                    src = mx.zeros((num_src, hidden), src_dtype)
                    index = mx.zeros((num_out, fan_in), mx.int32)
                    for weights in (None, mx.zeros((num_out, fan_in), mx.float32)):
                        gpu.combine_rows(src, index, weights, index, dtype=dtype, stream=None)
        # grouped_qmm: one expert of one column (tiny: constant), a decode
        # shape, each bit width and quantization group.
        for experts, out_dims, in_dims, bits, group_size in [
                (1, 1, 32, 8, 32), (128, 768, 2048, 4, 64), (8, 40, 256, 8, 128)]:
            words = in_dims * bits // 32
            matrices = (mx.zeros((experts, out_dims, words), mx.uint32),
                        mx.zeros((experts, out_dims, in_dims // group_size), src_dtype),
                        mx.zeros((experts, out_dims, in_dims // group_size), src_dtype))
            plan_arrays = (mx.zeros((experts + 1,), mx.int32), mx.zeros((5,), mx.int32))
            gpu.grouped_qmm(mx.zeros((5, in_dims), src_dtype), *matrices, *plan_arrays,
                            bits=bits, group_size=group_size, stream=None)
            # The layer's fused form (rows from 3 tokens, silu(gate) * up),
            # and each fusion alone.
            for row_tokens, up in [(mx.zeros((5,), mx.int32), matrices),
                                   (mx.zeros((5,), mx.int32), None), (None, matrices)]:
                rows = mx.zeros((5 if row_tokens is None else 3, in_dims), src_dtype)
                gpu.grouped_qmm(rows, *matrices, *plan_arrays, bits=bits, group_size=group_size,
                                stream=None, row_tokens=row_tokens, up=up)
            # The words through a warp's ring in group memory (`word_stages`),
            # one projection and the fused form.
            with grouped_qmm_tiling(word_stages=2):
                gpu.grouped_qmm(mx.zeros((5, in_dims), src_dtype), *matrices, *plan_arrays,
                                bits=bits, group_size=group_size, stream=None)
                gpu.grouped_qmm(mx.zeros((3, in_dims), src_dtype), *matrices, *plan_arrays,
                                bits=bits, group_size=group_size, stream=None,
                                row_tokens=mx.zeros((5,), mx.int32), up=matrices)
            # A prefill's rows (block tiles, grouped_qmm_tiles.h), each fusion;
            # and as many as take the gated launch's tall blocks.
            # The layer's shape also with the blocks' multiply-adds a
            # warpgroup's (`block_warpgroup`; on CUDA, as on a GPU that has
            # the instruction), and the warpgroups' of the weights made in
            # shared memory (its block; Metal's 32 KB keep the warps' own).
            warpgroups = (0, 1, 2) if experts == 128 else (0,)
            for rows_per_expert, warpgroup in itertools.product(
                    (GROUPED_QMM_TILING.tiles_from_rows, GROUPED_QMM_TILING.block_gated_tall_rows),
                    warpgroups):
                capacity = experts * rows_per_expert
                prefill_arrays = (mx.zeros((experts + 1,), mx.int32),
                                  mx.zeros((capacity,), mx.int32))
                for row_tokens, up in [(None, None), (mx.zeros((capacity,), mx.int32), matrices),
                                       (mx.zeros((capacity,), mx.int32), None), (None, matrices)]:
                    rows = mx.zeros((capacity, in_dims), src_dtype)
                    block = SHARED_WEIGHTS_BLOCK if warpgroup == 2 else dict(
                        block_warpgroup=warpgroup)
                    with (grouped_qmm_tiling(**block),
                          mock.patch.object(_gpu, "warpgroup_mma", lambda: True)):
                        gpu.grouped_qmm(rows, *matrices, *prefill_arrays, bits=bits,
                                        group_size=group_size, stream=None,
                                        row_tokens=row_tokens, up=up)
                # The made weights' blocks of the other rows they take
                # (wgmma's N of as many), the weights made a step ahead of
                # their multiply-adds, and a group's items one run of stages
                # (ACROSS_ITEMS), one projection and the layer's fused form.
                blocks = (*({**SHARED_WEIGHTS_BLOCK, "block_row_tiles": row_tiles,
                             "block_gated_row_tiles": row_tiles}
                            for row_tiles in OTHER_MADE_WEIGHTS_ROW_TILES),
                          {**SHARED_WEIGHTS_BLOCK, "block_weights_ahead": 1},
                          {**SHARED_WEIGHTS_BLOCK, "block_across_items": 1},
                          # a warpgroup that only makes the weights
                          # (grouped_qmm_roles.h)
                          {**SHARED_WEIGHTS_BLOCK, "block_specialized": 1})
                # The warps' own block compiled for 3 groups an SM
                # (`block_min_groups`: CUDA's launch bounds) at every size,
                # not only where the tiling's bounds take it.
                if warpgroup == 0:
                    with grouped_qmm_tiling(block_min_groups=3, **EVERY_SIZE_MIN_GROUPS):
                        gpu.grouped_qmm(mx.zeros((capacity, in_dims), src_dtype), *matrices,
                                        *prefill_arrays, bits=bits, group_size=group_size,
                                        stream=None, row_tokens=mx.zeros((capacity,), mx.int32),
                                        up=matrices)
                for block in blocks if warpgroup == 2 else ():
                    with (grouped_qmm_tiling(**block),
                          mock.patch.object(_gpu, "warpgroup_mma", lambda: True)):
                        for row_tokens, up in [(None, None),
                                               (mx.zeros((capacity,), mx.int32), matrices)]:
                            gpu.grouped_qmm(mx.zeros((capacity, in_dims), src_dtype), *matrices,
                                            *prefill_arrays, bits=bits, group_size=group_size,
                                            stream=None, row_tokens=row_tokens, up=up)
        # argsort_slice: a tiny row (constant), a router's rows, the longest;
        # and a router's, its top k over their sum.
        for dtype in ROW_DTYPES:
            for rows, row_size, start, count in [(1, 3, 2, 1), (4, 128, 120, 8),
                                                 (2, MAX_EXPERTS, 0, 10)]:
                gpu.argsort_slice(mx.zeros((rows, row_size), dtype), start, count, stream=None)
            gpu.argsort_slice(mx.zeros((4, 128), dtype), 120, 8, normalize=True, stream=None)
        # head_norm_rope: one GEMM's queries, keys and values (Qwen3-30B-A3B's
        # heads, an offset for all), and a tiny head apart from its keys (an
        # offset a sequence).
        for dtype in ROW_DTYPES:
            joined = mx.zeros((8, 1, 5120), dtype)
            norm = mx.zeros((128,), dtype)
            gpu.head_norm_rope(joined, joined, norm, norm, mx.zeros((1,), mx.int32), batch=8,
                               q_heads=32, k_heads=4, q_at=0, k_at=4096, eps=1e-6, base=1e6,
                               scale=1.0, stream=None)
            norm = mx.zeros((2,), dtype)
            gpu.head_norm_rope(mx.zeros((2, 3, 2), dtype), mx.zeros((2, 3, 4), dtype), norm,
                               norm, mx.zeros((2,), mx.int32), batch=2, q_heads=1, k_heads=2,
                               q_at=0, k_at=0, eps=1e-5, base=1e4, scale=0.5, stream=None)
        # decode_attention: Qwen3-30B-A3B's heads over a cache's slice,
        # gpt-oss-20b's with their sinks, and one head of one key; without a
        # mask and with a batch cache's.
        for dtype in (mx.float16, mx.bfloat16):
            for batch, heads, kv_heads, head_dim, keys, sinks in [
                    (8, 32, 4, 128, 513, False), (8, 64, 8, 64, 513, True),
                    (1, 1, 1, 64, 1, False)]:
                buffer = mx.zeros((batch, kv_heads, keys + 255, head_dim), dtype)
                for mask in (None, mx.ones((batch, 1, 1, keys), mx.bool_)):
                    gpu.decode_attention(
                        mx.zeros((batch, heads, 1, head_dim), dtype), buffer[:, :, :keys],
                        buffer[:, :, :keys], mx.zeros((heads,), dtype) if sinks else None,
                        scale=head_dim ** -0.5, stream=None, mask=mask)
        # add_rms_norm: a decoding step's rows of Qwen3-30B-A3B's width, and
        # rows narrower than a warp.
        for dtype in ROW_DTYPES:
            for shape in ((8, 1, 2048), (3, 7)):
                rows = mx.zeros(shape, dtype)
                gpu.add_rms_norm(rows, rows, mx.zeros(shape[-1:], dtype), eps=1e-6, stream=None)
    # The backend caches a launch's kernel object: drop the recorder's, so a
    # test on the GPU that makes the same launch makes the real kernel.
    _gpu._launch_call.cache_clear()
    return launches


def unique_launches(launches: list[Launch]) -> list[Launch]:
    """`launches` without repeats: the first of each kernel text."""
    unique = {}
    for launch in launches:
        unique.setdefault(launch.id, launch)
    return list(unique.values())


LAUNCHES = unique_launches(record_launches())
launch_params = pytest.mark.parametrize("launch", LAUNCHES, ids=[launch.id for launch in LAUNCHES])


def test_every_kernel_and_configuration_is_covered():
    seen = {launch.name for launch in LAUNCHES}
    # but grouped_qmm_roles.h: its block, the made weights', is more than Metal's
    # 32 KB of threadgroup memory (it runs on CUDA; its text is checked here)
    assert seen == set(INPUTS_OUTPUTS) - {"grouped_qmm_roles"}
    templates = {(launch.name, launch.template) for launch in LAUNCHES}
    for has_weights in (False, True):
        for name in ("plan", "combine"):
            assert any(n == name and ("HAS_WEIGHTS", has_weights) in t for n, t in templates)
    for src_dtype in ROW_DTYPES:
        for dtype in ROW_DTYPES:
            for name in ("gather", "combine"):
                assert any(n == name and ("InT", src_dtype) in t and ("OutT", dtype) in t
                           for n, t in templates)
    # gather's 16-byte-vector flag (a bool template argument named *VECTORS), both ways
    for flag in (False, True):
        assert any(n == "gather" and any(k.endswith("VECTORS") and v is flag for k, v in t)
                   for n, t in templates)
    # grouped_qmm's fusions, each alone and together, in both bodies
    for name in ("grouped_qmm", "grouped_qmm_tiles"):
        for gated in (False, True):
            for token_rows in (False, True):
                assert any(n == name and ("GATED", gated) in t
                           and ("TOKEN_ROWS", token_rows) in t for n, t in templates)


# --- text helpers ---------------------------------------------------------------------


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def _object_macros(prelude: str) -> dict[str, str]:
    """The prelude's object-like macros (`#define NAME value`, no parameters)."""
    return dict(re.findall(r"^\s*#\s*define\s+(\w+)(?![\w(])[ \t]*(.*)$", prelude, flags=re.M))


def _expand(text: str, macros: dict[str, str]) -> str:
    for _ in range(4):  # macros may use one another
        text = re.sub(r"\b\w+\b", lambda m: macros.get(m.group(0), m.group(0)), text)
    return text


def _body(launch_or_name) -> str:
    """The kernel body (prologue + body), comments gone, object-like macros expanded."""
    name = getattr(launch_or_name, "name", launch_or_name)
    macros = _object_macros(kernels.prelude("metal"))
    return _expand(_strip_comments(kernels.body(name, "metal")), macros)


def _depth_at(text: str, position: int) -> int:
    return text.count("{", 0, position) - text.count("}", 0, position)


def _signature(source: str) -> list[str]:
    start = source.index("[[kernel]] void ")
    return source[start:source.index(") {\n", start)].split("\n")[1:]


def _threadgroup_arrays(body: str):
    """(type, name, dims, depth, has initializer) per threadgroup variable."""
    pattern = r"\bthreadgroup\s+([\w:<>]+)\s+(\w+)\s*((?:\[[^\]]+\])*)\s*(=?)"
    for m in re.finditer(pattern, body):
        dims = re.findall(r"\[([^\]]+)\]", m.group(3))
        yield m.group(1), m.group(2), dims, _depth_at(body, m.start()), m.group(4) == "="


BODIES = sorted(INPUTS_OUTPUTS)


# --- MLX agreement ----------------------------------------------------------------------


@launch_params
def test_matches_mlx(launch, tmp_path, capfd):
    """metal_source is the text MLX 0.32.4 generates (printed with verbose=True).

    Without a Metal device MLX generates the text only while exporting a graph,
    so the kernel call is traced by mx.export_function.
    """
    kernel = _gpu._kernel("metal", launch.name)
    _, output_names = INPUTS_OUTPUTS[launch.name]

    def call(*inputs):
        return kernel(inputs=list(inputs), template=list(launch.template), grid=launch.grid,
                      threadgroup=launch.threadgroup, output_shapes=[(1,)] * len(output_names),
                      output_dtypes=list(launch.output_dtypes), verbose=True)

    arrays = [mx.zeros(shape, dtype) for dtype, shape in launch.inputs]
    capfd.readouterr()
    mx.export_function(str(tmp_path / "kernel.mlxfn"), call, *arrays)
    printed = capfd.readouterr().out
    generated = printed.split("```\n", 1)[1].rsplit("\n```\n", 1)[0]
    assert generated == launch.source()


# --- address spaces (MSL 4.0 to 4.4) ----------------------------------------------------


@launch_params
def test_pointer_parameters_have_address_spaces(launch):
    """Pointer and reference kernel arguments need an address space (MSL 4)."""
    pointers = [line for line in _signature(launch.source()) if "*" in line or "&" in line]
    assert pointers, "no pointer parameter found: every kernel takes its buffers as pointers"
    for line in pointers:
        assert re.search(r"\b(device|constant|threadgroup)\b", line), line


# Bodies that read and write their buffers by index alone, making no pointer.
INDEXED_ONLY = ("head_norm_rope", "decode_attention_merge", "add_rms_norm")


@pytest.mark.parametrize("name", BODIES)
def test_pointers_in_bodies_have_address_spaces(name):
    """Every pointer declared or cast to in a body names its address space (MSL 4)."""
    body = _body(name)
    casts = re.findall(r"\(\s*([A-Za-z_][\w\s]*?)\s*\*\s*\)", body)
    declarations = re.findall(r"(?m)^\s*((?:\w+\s+)*\w+)\s*\*\s*\w+\s*=(?!=)", body)
    if name in INDEXED_ONLY:
        assert not casts + declarations, f"{name} now makes pointers: take it from INDEXED_ONLY"
    else:
        assert casts + declarations, "no pointer found: every other body points into its buffers"
    for pointer_type in casts + declarations:
        assert set(pointer_type.split()) & set(ADDRESS_SPACES), pointer_type


# The inputs a body makes `device` pointers into (casts to raw types, or a
# column's pointers made once an item), which Metal allows only into a
# `device` buffer: _gpu.py pads them to 8 elements, where MLX stops passing
# `constant` ones.
POINTED_INTO = {"gather": ("src",), "combine": ("src",), "argsort_slice": ("values",),
                "grouped_qmm": ("rows", "weight", "scales", "biases", "up_weight", "up_scales",
                                "up_biases")}


def _casts_of_parameters(launch):
    """(cast address space, parameter, parameter address space) for casts of kernel buffers."""
    body = _body(launch)
    inputs, outputs = INPUTS_OUTPUTS[launch.name]
    for m in re.finditer(r"\(\s*([A-Za-z_][\w\s]*?)\s*\*\s*\)\s*(\w+)", body):
        spaces = set(m.group(1).split()) & set(ADDRESS_SPACES)
        if m.group(2) in inputs:
            yield spaces, m.group(2), launch.location(m.group(2))
        elif m.group(2) in outputs:
            yield spaces, m.group(2), "device"


@launch_params
def test_casts_keep_the_buffer_address_space(launch):
    """A cast can't move a pointer between device and constant (MSL 4; casting
    between address spaces is a compile error). MLX puts inputs of fewer than
    8 elements in `constant`, so a body may cast an input only to a pointer
    whose address space is the one MLX gives that input at that size."""
    casts = list(_casts_of_parameters(launch))
    if launch.name in POINTED_INTO:  # it points into them by casts, which must be found
        assert {parameter for _, parameter, _ in casts} & set(POINTED_INTO[launch.name]), \
            f"no cast of {POINTED_INTO[launch.name]} found in {launch.name}"
    for spaces, parameter, location in casts:
        cast = f"({' '.join(sorted(spaces))} ...*){parameter}"
        assert spaces == {location}, f"{cast}, but {parameter} is {location}"


@launch_params
def test_inputs_pointed_into_are_device_buffers(launch):
    for parameter in POINTED_INTO.get(launch.name, ()):
        assert launch.location(parameter) == "device", \
            f"{launch.name}: {parameter} of {launch.inputs} is passed as constant"


@pytest.mark.parametrize("name", BODIES)
def test_threadgroup_arrays_at_kernel_scope(name):
    """Threadgroup variables are allocated by a kernel function (MSL 4.4): each
    is declared at the top level of the body, without an initializer."""
    body = _body(name)
    arrays = list(_threadgroup_arrays(body))
    # Each other `threadgroup` of a body declares a variable (the pattern finds
    # them all) or is a pointer's address space (`threadgroup uint4*`).
    pointers = re.findall(r"\bthreadgroup\s+\w+\s*\*", body)
    assert len(arrays) + len(pointers) == len(re.findall(r"\bthreadgroup\b", body))
    for type_name, var, _, depth, initialized in arrays:
        assert depth == 0, f"threadgroup {var} declared inside a block"
        assert not initialized, f"threadgroup {var} has an initializer"


@launch_params
def test_threadgroup_memory_fits(launch):
    """All threadgroup variables together fit in 32 KiB (Metal's threadgroup
    memory), sized from the template constants the launch uses (the expert
    limit, MAX_EXPERTS = 1024, for the plan kernel)."""
    constants = {name: int(value) for name, value in launch.template if isinstance(value, int)}
    total = 0
    for type_name, var, dims, _, _ in _threadgroup_arrays(_body(launch)):
        count = 1
        for dim in dims:
            expr = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: str(constants[m.group(0)]), dim)
            count *= eval(expr.replace("/", "//"), {"__builtins__": {}})
        total += TYPE_BYTES[type_name] * count
    assert total <= THREADGROUP_MEMORY, f"{total} bytes of threadgroup memory"
    if launch.name.startswith("plan"):
        assert constants["MAX_EXPERTS"] == MAX_EXPERTS


# --- atomics and barriers (MSL 2.6, 6.9.1, 6.15) ----------------------------------------


@pytest.mark.parametrize("name", BODIES)
def test_shared_atomics_are_relaxed_atomic_uint(name):
    """Shared atomics are `atomic_uint` (MSL 2.6) used through the `_explicit`
    functions with memory_order_relaxed, the only order they take (MSL 6.15.1)."""
    body = _body(name)
    for type_name, var, _, _, _ in _threadgroup_arrays(body):
        if "atomic" in type_name:
            assert type_name == "atomic_uint", var
    text = _strip_comments(kernels.prelude("metal", name)) + body
    assert set(re.findall(r"\bmemory_order_\w+", text)) <= {"memory_order_relaxed"}
    for call in re.findall(r"\b(atomic_\w+)\s*\(", text):
        assert call.endswith("_explicit"), call


def test_barrier_is_a_threadgroup_barrier():
    """BARRIER() orders threadgroup memory among the group's threads (MSL 6.9.1)."""
    macros = re.findall(r"#\s*define\s+BARRIER\(\)\s*(.*)", kernels.prelude("metal"))
    assert [m.strip() for m in macros] == ["threadgroup_barrier(mem_flags::mem_threadgroup)"]


@pytest.mark.parametrize("name", BODIES)
def test_barriers_in_uniform_control_flow(name):
    """Every thread of the group must reach each barrier (MSL 6.9.1): a
    BARRIER() may sit at the top level or in a bare block, in `for` loops whose header does not
    depend on the thread (no LOCAL_ID), or under an `if` on template
    constants alone (upper-case names and numbers: the same in every
    thread), never under any other if/else/while; but for code under `if
    (0)` or `if (... && 0)`, which never runs: grouped_qmm_roles.h's roles
    apart (`ROLES_APART`, 0 in Metal's prelude, whose threads take every
    role)."""
    body = _body(name)
    for m in re.finditer(r"\bBARRIER\s*\(", body):
        depth, headers = 0, []
        for position in range(m.start() - 1, -1, -1):  # walk out through the enclosing blocks
            char = body[position]
            if char == "}":
                depth += 1
            elif char == "{" and depth:
                depth -= 1
            elif char == "{":
                headers.append(_block_header(body, position))
        if any(re.fullmatch(r"if \((.*&& )?0\)", header) for header in headers):
            continue
        for header in headers:
            if header.startswith("if "):
                assert re.fullmatch(r"if \(([A-Z_][A-Z0-9_]*|\d+|[\s<>=!&|()+*/-])*\)",
                                    header), header
            elif header.strip():  # else a bare block: a scope, every thread's
                assert header.startswith("for") and "LOCAL_ID" not in header, header


def _block_header(text: str, brace: int) -> str:
    """`for (...)`, `if (...)`, `else`, ... : what opens the block at `brace`."""
    end = len(text[:brace].rstrip())
    start = end
    if text[end - 1] == ")":  # back to the matching "("
        depth = 0
        for start in range(end - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(text[start], 0)
            if depth == 0:
                break
    keyword = re.search(r"(\w*)\s*$", text[:start]).group(1)
    return keyword + " " + text[start:end]


# --- threads (MSL 5.2.3.6) ----------------------------------------------------------------


@launch_params
def test_groups_fit_and_are_full(launch):
    """Group sizes are within 1024 threads and every group is full, which the
    plan kernel assumes (GROUP_SIZE == BLOCK, which divides MAX_EXPERTS)."""
    size = launch.threadgroup[0] * launch.threadgroup[1] * launch.threadgroup[2]
    assert 0 < size <= MAX_THREADS
    assert all(g % t == 0 for g, t in zip(launch.grid, launch.threadgroup))
    template = dict(launch.template)
    if launch.name == "plan":
        assert launch.threadgroup[0] == template["BLOCK"]
        assert template["BLOCK"] % 128 == 0
        assert template["MAX_EXPERTS"] % template["BLOCK"] == 0


@launch_params
def test_thread_attributes_are_declared(launch):
    """MLX declares an attribute when its name occurs in the body text: the
    attributes the body uses are exactly the ones the signature declares
    (none missing, none added by a substring in a comment or a longer name)."""
    body = kernels.body(launch.name, "metal")
    code = _strip_comments(body)
    used = {attr for attr, _ in THREAD_ATTRIBUTES if re.search(rf"\b{attr}\b", code)}
    signature = "\n".join(_signature(launch.source()))
    declared = set(re.findall(r"\[\[(\w+)\]\],?$", signature, flags=re.M))
    assert used == declared
    assert used >= set(re.findall(r"=\s*(\w+)", kernels.text("prologue_metal")))


# --- names ---------------------------------------------------------------------------------

FOREIGN_TOKENS = [  # CUDA, OpenCL C, or C++ that MSL lacks (MSL 1.5.4, 2.1, 5.3)
    r"__syncthreads", r"__shared__", r"__device__", r"__global__", r"__forceinline__",
    r"\batomicAdd\b", r"\bthreadIdx\b", r"\bblockIdx\b", r"\bblockDim\b", r"\bgridDim\b",
    r"__fmul_rn", r"__fadd_rn", r"\bmake_uint4\b", r"__restrict__", r"\b__global\b", r"\b__local\b",
    r"\b__constant\b", r"\b__kernel\b", r"\b__private\b", r"\bget_local_id\b", r"\bget_group_id\b",
    r"\bget_local_size\b", r"\bget_num_groups\b", r"\bget_global_id\b", r"(?<!_)\bbarrier\s*\(",
    r"CLK_LOCAL_MEM_FENCE", r"\bvload_half\b", r"\bvstore_half", r"\bas_float\b", r"\bas_uint\b",
    r"#pragma\s+OPENCL", r"\blong\s+long\b", r"\bdouble\b", r"\bstatic\b", r"\bgoto\b",
    r"\bprintf\b", r"\bvolatile\b",
]


@launch_params
def test_no_foreign_tokens(launch):
    text = _strip_comments(launch.source())
    for token in FOREIGN_TOKENS:
        assert not re.search(token, text), token


# Address-space and function qualifiers (MSL 4, 5.1), which can't name variables.
MSL_KEYWORDS = {"device", "constant", "thread", "threadgroup", "threadgroup_imageblock",
                "ray_data", "object_data", "kernel", "vertex", "fragment"}


def _mlx_utils_macros() -> set[str]:
    """Macro names of the MLX utils.h chain MLX puts before our header, where shipped."""
    root = Path(mx.__file__).parent / "include" / "mlx" / "backend" / "metal" / "kernels"
    names = set()
    for header in ("utils.h", "bf16.h", "bf16_math.h", "complex.h", "defines.h", "logging.h"):
        if (root / header).exists():
            text = (root / header).read_text()
            names |= set(re.findall(r"^\s*#\s*define\s+(\w+)", text, flags=re.M))
    return names


@launch_params
def test_declared_names_are_free(launch):
    """Variables the body declares are not MSL keywords, kernel parameters
    (inputs, outputs, thread attributes), template parameters, or macros of
    MLX's utils.h."""
    body = _body(launch)
    typenames = [name for name, value in launch.template if isinstance(value, mx.Dtype)]
    types = "|".join(["unsigned", "int", "bool", "float", "uint4", "i64", "atomic_uint",
                      *typenames])
    declared = set(re.findall(rf"\b(?:{types})\s*\*?\s+(\w+)\s*[=;\[,)]", body))
    assert declared, "no declaration found: every body declares variables"
    signature = "\n".join(_signature(launch.source()))
    parameters = set(re.findall(r"(\w+)\s+\[\[", signature))
    taken = MSL_KEYWORDS | parameters | {name for name, _ in launch.template} | _mlx_utils_macros()
    assert not declared & taken


@pytest.mark.parametrize("backend", kernels.BACKENDS)
def test_preludes_define_the_dialect(backend):
    prelude = _strip_comments(kernels.prelude(backend))
    defined = set(re.findall(r"^\s*#\s*define\s+(\w+)", prelude, flags=re.M))
    defined |= set(re.findall(r"\btypedef\b[^;]*?\b(\w+)\s*;", prelude))
    # A prelude's own helper macros, undefined once used, are not the dialect's.
    defined -= set(re.findall(r"^\s*#\s*undef\s+(\w+)", prelude, flags=re.M))
    assert defined == set(kernels.DIALECT_NAMES)


@pytest.mark.parametrize("backend", kernels.BACKENDS)
def test_prologues_declare_the_thread_names(backend):
    prologue = _strip_comments(kernels.text(f"prologue_{backend}"))
    assert re.findall(r"\bconst\s+unsigned\s+(\w+)\s*=", prologue) == list(kernels.THREAD_NAMES)


KERNEL_FILES = [*kernels.BODIES, *(f"{kind}_{backend}" for kind in ("prelude", "prologue")
                                   for backend in kernels.BACKENDS)]


def _tokens(text: str) -> list[str]:
    return re.findall(r"\w+|[^\s\w]", text)


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_compact_text_keeps_every_token_and_line_start(name):
    """What the backends compile is the file without comments and layout:
    the same tokens, and each preprocessor directive still starts a line."""
    written = _strip_comments(kernels.source(name))
    compacted = kernels.compact(name)
    assert _tokens(compacted) == _tokens(written)
    directives = re.findall(r"^\s*#.*$", written, flags=re.M)
    assert [d.strip() for d in directives] == re.findall(r"^#.*$", compacted, flags=re.M)


@pytest.mark.parametrize("text", ["int a/* x */b;", "#define A 1 \\\n  + 2", "// a \\\nb;",
                                  'int s = "\\"//";', "char c = 'a';", 'asm("a\n  b");'])
def test_compact_refuses_what_it_cannot_strip(text, monkeypatch):
    monkeypatch.setattr(kernels, "text", lambda name: text)
    with pytest.raises(ValueError, match="kernels.compact takes no"):
        kernels.compact.__wrapped__("odd")


def test_included_texts_take_the_place_of_their_line(monkeypatch):
    """`// include: NAME` alone on a line is NAME.h's text, its own includes in
    place; a name not in kernels.INCLUDED is an error, not a silent comment."""
    texts = {"body": "a;\n  // include: qmm_fields\nb; // include: qmm_fields\n",
             "qmm_fields": "c;\n", "other": "x;\n  // include: missing\n",
             "outer": "d;\n// include: tiles_products\n",
             "tiles_products": "// include: qmm_fields\n"}
    monkeypatch.setattr(kernels, "text", lambda name: texts[name])
    assert kernels.source("body") == "a;\nc;\n\nb; // include: qmm_fields\n"
    assert kernels.source("outer") == "d;\nc;\n\n\n"  # an included text's own, in turn
    texts.update(qmm_fields="// include: tiles_products\n")  # each includes the other
    with pytest.raises(ValueError, match="outer -> tiles_products -> qmm_fields -> "
                                         "tiles_products includes tiles_products.h within"):
        kernels.source("outer")
    with pytest.raises(ValueError, match="no kernel text named missing"):
        kernels.source("other")


@pytest.mark.parametrize("name, included, times", [
    ("grouped_qmm", "qmm_fields", 1), ("tiles_products", "qmm_fields", 2),
    ("grouped_qmm", "qmm_params", 1), ("tiles_setup", "qmm_params", 1),
    ("grouped_qmm", "qmm_store", 1), ("tiles_end", "qmm_store", 1),
    ("grouped_qmm_tiles", "tiles_setup", 1), ("grouped_qmm_roles", "tiles_setup", 1),
    ("grouped_qmm_tiles", "tiles_run", 1), ("grouped_qmm_roles", "tiles_run", 3),
    ("tiles_run", "tiles_products", 2),
    ("tiles_run", "tiles_weights", 2), ("tiles_run", "tiles_begin", 2),
    ("tiles_run", "tiles_end", 1),
    ("tiles_weights", "qmm_fields", 1),
    ("plan", "group_scan", 1), ("grouped_qmm", "group_scan", 1),
    ("tiles_setup", "group_scan", 1)])
def test_bodies_include_their_shared_texts(name, included, times):
    assert kernels.text(name).count(f"// include: {included}") == times
    # the included text's longest line: its last may be a brace every text has
    assert max(kernels.text(included).splitlines(), key=len) in kernels.source(name)


def test_block_tiles_products_twice_with_their_fields():
    """grouped_qmm_tiles.h's run (tiles_run.h) multiplies all its row tiles
    or half of them: the products' text twice, each with the field pairs it
    includes (once for the warpgroup's multiply-adds, once for the warps'
    own), and twice more where the group makes a stage's weights in shared
    memory (SHARED_WEIGHTS: before the stage's multiply-adds, or with
    WEIGHTS_AHEAD a step before)."""
    source = kernels.source("tiles_run")
    assert source.count(kernels.text("qmm_fields")) == 6
    assert source.count("const int product_row_tiles = ROW_TILES;") == 1
    assert source.count("const int product_row_tiles = ROW_TILES / 2;") == 1


def test_compact_keeps_strings(monkeypatch):
    """CUDA's inline PTX is string literals: kept whole, `//` inside them too."""
    monkeypatch.setattr(kernels, "text", lambda name: 'asm("mma // x"); // "a comment"\n')
    assert kernels.compact.__wrapped__("odd") == 'asm("mma // x");\n'


def test_metal_contraction_is_off():
    """The prelude turns floating-point contraction off at file scope (MSL
    1.6.3): MLX's default math mode, safe, leaves it on within a statement, and
    combine's ADD_RN(acc, MUL_RN(w, x)) is one statement."""
    prelude = _strip_comments(kernels.prelude("metal"))
    off = r"METAL\s+fp\s+contract\s*\(\s*off\s*\)|STDC\s+FP_CONTRACT\s+OFF"
    pragma = re.search(rf"^\s*#pragma\s+({off})", prelude, flags=re.M)
    assert pragma and _depth_at(prelude, pragma.start()) == 0


# --- compiling (macOS only) ----------------------------------------------------------------


def _metal_compiler() -> bool:
    if shutil.which("xcrun") is None:
        return False
    found = subprocess.run(["xcrun", "-sdk", "macosx", "-f", "metal"], capture_output=True)
    return found.returncode == 0


@pytest.mark.skipif(not _metal_compiler(), reason="Apple's Metal compiler (xcrun) is macOS-only")
@launch_params
def test_xcrun_compiles(launch, tmp_path):
    """Compiles the source as MLX does: after MLX's utils.h, MSL 3.1 (the
    oldest MLX asks for), safe math."""
    path = tmp_path / "kernel.metal"
    path.write_text(launch.source(utils=True))
    include = Path(mx.__file__).parent / "include"
    result = subprocess.run(
        ["xcrun", "-sdk", "macosx", "metal", "-std=metal3.1", "-fno-fast-math", f"-I{include}",
         "-c", str(path), "-o", str(tmp_path / "kernel.air")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_type_names_cover_the_row_dtypes():
    assert {TYPE_NAMES[d] for d in ROW_DTYPES} == {"float", "float16_t", "bfloat16_t"}


@pytest.mark.parametrize("backend", kernels.BACKENDS)
def test_prelude_sections_are_the_prelude(backend):
    """The prelude's sections, joined, are the whole prelude; each names what it
    defines, and each dialect name is defined in the head or one section."""
    sections = kernels.prelude_sections(backend)
    assert "".join(text for _, text in sections) == kernels.compact(f"prelude_{backend}")
    assert kernels.prelude(backend) == kernels.compact(f"prelude_{backend}")
    assert len(sections) > 1 and all(names for names, _ in sections[1:])
    for name in kernels.DIALECT_NAMES:
        where = [i for i, (_, text) in enumerate(sections)
                 if re.search(rf"^\s*(#\s*define\s+{name}\b|typedef\b[^;]*\b{name}\s*;)", text,
                              flags=re.M)]
        assert len(where) == 1, (name, where)
        assert where == [0] or name in sections[where[0]][0], (name, where)


@pytest.mark.parametrize("backend", kernels.BACKENDS)
@pytest.mark.parametrize("name", BODIES)
def test_a_bodys_prelude_defines_what_it_uses(backend, name):
    """The prelude a body is compiled with (its head and the sections it uses)
    defines every dialect name the body uses, and leaves out the warps'
    multiply-adds where the body has none, and the warpgroup's likewise."""
    prelude = kernels.prelude(backend, name)
    used = set(re.findall(r"[A-Za-z_]\w*", kernels.body(name, backend)))
    for dialect_name in set(kernels.DIALECT_NAMES) & used:
        assert re.search(rf"^\s*(#\s*define\s+{dialect_name}\b|typedef\b[^;]*\b{dialect_name}"
                         r"\s*;)", prelude, flags=re.M), dialect_name
    for macro in ("MMA_16x8x16", "WARPGROUP_MMA"):
        assert (re.search(rf"#\s*define\s+{macro}\b", prelude) is not None) == (macro in used)


@pytest.mark.parametrize("backend", kernels.BACKENDS)
def test_prelude_sections_name_what_others_use(backend):
    """A name a section defines (a macro it keeps, a helper function) that a
    body or another section uses is one of the names its `// defines:` lines
    list: else a body could take the user without it, which only that
    backend's compiler would notice (Metal's, not run here)."""
    sections = kernels.prelude_sections(backend)
    bodies = "".join(kernels.body(name, backend) for name in BODIES)
    for index, (names, text) in enumerate(sections[1:], start=1):
        defined = set(re.findall(r"^#\s*define\s+(\w+)", text, flags=re.M))
        defined -= set(re.findall(r"^#\s*undef\s+(\w+)", text, flags=re.M))
        defined |= set(re.findall(r"^(?:inline|__device__)\b[^(\n]*?\b(\w+)\s*\(", text,
                                  flags=re.M))
        others = bodies + "".join(other for i, (_, other) in enumerate(sections) if i != index)
        used_elsewhere = defined & set(re.findall(r"[A-Za-z_]\w*", others))
        assert used_elsewhere <= names, (backend, sorted(used_elsewhere - names))
