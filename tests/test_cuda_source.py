# The CUDA text of every kernel launch _gpu.py makes, compiled by nvcc for the
# H200's sm_90a (as MLX compiles custom kernels from compute capability 9: the
# `a` features, wgmma among them) where nvcc is installed, without a GPU: a
# CUDA or PTX error in a body or the prelude shows on every commit, not first
# on a lent GPU.
#
# The launches are test_metal_source's, recorded from the GPU backend itself,
# for Metal and for CUDA (whose block tiles take larger stages and blocks).
# The source is built as MLX 0.32.4's `mx.fast.cuda_kernel` builds it
# (mlx/backend/cuda/custom_kernel.cpp, `build_kernel`): the header (the
# prelude), then in namespace mlx::core::cu a `__global__ void` of the
# inputs (`const T* name`, each followed by its `name_shape`, `name_strides`
# and `name_ndim` where the body mentions them) and outputs (`T* name`),
# whose body opens with the template arguments (`constexpr int NAME =
# value;`, `using NAME = type;`).
# MLX's own header, mlx/backend/cuda/device/utils.cuh, is not here: the
# CUDA headers it brings that the prelude relies on are included instead.
# MLX compiles with NVRTC at run time; nvcc's front end is the same compiler.

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from unittest import mock

import mlx.core as mx
import pytest
from conftest import OTHER_MADE_WEIGHTS_ROW_TILES
from test_metal_source import LAUNCHES, record_launches, recording, unique_launches

from mlx_moe_plan import _gpu, kernels
from mlx_moe_plan.kernels.launch import (INPUTS_OUTPUTS, SHARED_WEIGHTS_ROW_TILES,
                                         WARPGROUP_ROW_TILES, grouped_qmm_tiling)

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")

CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
              mx.bool_: "bool", mx.int32: "int32_t", mx.uint32: "uint32_t",
              mx.uint16: "uint16_t"}
HEADER = ("#include <cstdint>\n#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"
          "#include <cooperative_groups.h>\n#include <cuda/std/array>\n")
# The types of an input's shape and strides, as MLX's device/utils.cuh
# declares them in its namespace (MAX_NDIM 10).
VIEW_TYPES = ("using Shape = cuda::std::array<int32_t, 10>;\n"
              "using Strides = cuda::std::array<int64_t, 10>;\n")
VIEW_ARGUMENTS = (("_shape", "const __grid_constant__ Shape"),
                  ("_strides", "const __grid_constant__ Strides"),
                  ("_ndim", "const __grid_constant__ int"))


def _template_line(name: str, value) -> str:
    if isinstance(value, bool):
        return f"  constexpr bool {name} = {str(value).lower()};"
    if isinstance(value, int):
        return f"  constexpr int {name} = {value};"
    return f"  using {name} = {CUDA_TYPES[value]};"


def cuda_function(launch, function_name: str) -> str:
    """One launch's `__global__` function, as MLX's cuda_kernel writes it."""
    inputs, outputs = INPUTS_OUTPUTS[launch.name]
    body = kernels.body(launch.name, "cuda")
    arguments = []
    for name, (dtype, shape) in zip(inputs, launch.inputs):
        arguments.append(f"    const {CUDA_TYPES[dtype]}* {name}")
        arguments += [f"    {kind} {name}{suffix}" for suffix, kind in VIEW_ARGUMENTS
                      if shape and name + suffix in body]
    arguments += [f"    {CUDA_TYPES[dtype]}* {name}"
                  for name, dtype in zip(outputs, launch.output_dtypes)]
    return "\n".join([f"__global__ void {function_name}(", ",\n".join(arguments) + ") {",
                      *(_template_line(name, value) for name, value in launch.template),
                      body, "}"])


def assert_nvcc_compiles(functions: list[str], path, *, suppress: tuple[str, ...] = (),
                         body_name: str | None = None, header: str = "",
                         flags: tuple[str, ...] = ()) -> str:
    """`functions` on the CUDA prelude (the sections body `body_name` takes, as
    `_gpu.py` gives it; else all of it) and `header` after it, in MLX's
    namespace as its cuda_kernel puts them, written to `path` and compiled by
    nvcc for sm_90a with `flags`: no error and, but the `suppress`ed
    diagnostics, no warning. Returns nvcc's messages."""
    path.write_text(HEADER + kernels.prelude("cuda", body_name) + header
                    + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
                    + VIEW_TYPES + "\n".join(functions) + "\n}  // namespace mlx::core::cu\n")
    suppressed = [flag for number in suppress for flag in ("-diag-suppress", number)]
    result = subprocess.run(
        [NVCC, "-arch=sm_90a", "-std=c++17", *suppressed, *flags, "-c", str(path),
         "-o", str(path.with_suffix(".o"))], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    assert "warning" not in result.stderr.lower(), result.stderr[-6000:]
    return result.stderr


@cache
def _cuda_launches() -> list:
    return record_launches("cuda")


@cache
def _every_launch() -> list:
    return unique_launches(LAUNCHES + _cuda_launches())


@pytest.mark.parametrize("name", INPUTS_OUTPUTS)
def test_nvcc_compiles_every_launch(name, tmp_path):
    # One file a body: each recorded launch of it (its template arguments and
    # input dtypes) as a function of its own.
    launches = [launch for launch in _every_launch() if launch.name == name]
    assert launches, f"no launch of {name} was recorded"
    functions = [cuda_function(launch, f"custom_kernel_moe_{name}_{i}")
                 for i, launch in enumerate(launches)]
    # Every warning but #177, declared but never referenced: the prologue
    # declares every thread index, and grouped_qmm.h the exchange buffer that
    # only the OpenCL prelude's emulated multiply-add uses.
    assert_nvcc_compiles(functions, tmp_path / f"{name}.cu", suppress=("177",), body_name=name)


def test_launch_bounds_hold_the_registers(tmp_path):
    """The warps' own block compiled for 3 groups an SM (`block_min_groups`,
    which the glue puts in MLX's header as `kernels.launch_bounds`), at the
    fitted block of Qwen3-30B-A3B's fused gate and up at 32 rows an expert
    (5 row tiles, 4 bits): nvcc takes the `__global__` it redefines, and
    gives a thread no more registers than the groups of the launch's threads
    leave of an SM's 65536, allocated 8 at a time."""
    bounded = [launch for launch in _cuda_launches() if launch.launch_bounds is not None]
    assert bounded, "no launch was recorded with launch bounds"
    launch = next(launch for launch in bounded
                  if {key: value for key, value in launch.template
                      if key in ("BITS", "ROW_TILES", "GATED")}
                  == {"BITS": 4, "ROW_TILES": 5, "GATED": True})
    threads, groups = launch.launch_bounds
    assert (threads, groups) == (launch.threadgroup[0], 3)

    def registers(header: str) -> int:
        messages = assert_nvcc_compiles(
            [cuda_function(launch, "custom_kernel_moe_bounded")], tmp_path / "bounded.cu",
            suppress=("177",), body_name=launch.name, header=header, flags=("-Xptxas", "-v"))
        return int(re.search(r"Used (\d+) registers", messages).group(1))

    def most(groups: int) -> int:
        return 65536 // (groups * threads) // 8 * 8

    assert registers(kernels.launch_bounds(threads, groups)) <= most(groups)
    # and a bound below what the compiler takes unbounded holds as well
    assert registers(kernels.launch_bounds(threads, 4)) <= most(4) < registers("")



def test_nvcc_compiles_the_specialized_block(tmp_path):
    """The made weights with a warpgroup that only copies and makes them
    (`block_specialized`), at Qwen3-30B-A3B's T = 8192: its fused gate and up
    and its down projection in the rule's blocks of 192 rows, and the fused
    ones in 128. Compiled for one group of 384 threads an SM (the launch's
    bounds, as the glue asks), a thread takes at most 168 registers at
    launch; where the multiplying warps' sums need more (the gated 192 rows),
    each role's warps take their own (setmaxnreg: MMA_REGISTERS,
    MAKING_REGISTERS), and nowhere else."""
    experts, in_dims, out_dims, capacity, tokens = 128, 2048, 768, 65536, 8192
    matrices = [(mx.zeros((experts, rows, columns * 4 // 32), mx.uint32),
                 mx.zeros((experts, rows, columns // 64), mx.bfloat16),
                 mx.zeros((experts, rows, columns // 64), mx.bfloat16))
                for rows, columns in ((out_dims, in_dims), (in_dims, out_dims))]
    plan_arrays = (mx.zeros((experts + 1,), mx.int32), mx.zeros((capacity,), mx.int32))
    launches = []
    gpu = _gpu.GpuBackend("cuda")
    with recording(launches), mock.patch.object(_gpu, "warpgroup_mma", lambda: True):
        for tiling in (dict(block_specialized=1),
                       dict(block_specialized=1, block_shared_row_tiles=16)):
            with grouped_qmm_tiling(**tiling):
                gpu.grouped_qmm(mx.zeros((tokens, in_dims), mx.bfloat16), *matrices[0],
                                *plan_arrays, bits=4, group_size=64, stream=None,
                                row_tokens=mx.zeros((capacity,), mx.int32), up=matrices[0])
                if len(launches) == 1:
                    gpu.grouped_qmm(mx.zeros((capacity, out_dims), mx.bfloat16), *matrices[1],
                                    *plan_arrays, bits=4, group_size=64, stream=None)
    forms = [(dict(launch.template), launch) for launch in launches]
    assert [(t["GATED"], t["BLOCK_ROWS"], t["PRODUCER_WARPGROUPS"], bool(t["MMA_REGISTERS"]),
             launch.launch_bounds) for t, launch in forms] == [
        (True, 192, 1, True, (384, 1)), (False, 192, 1, False, (384, 1)),
        (True, 128, 1, False, (384, 1))]
    for i, (template, launch) in enumerate(forms):
        path = tmp_path / f"specialized_{i}.cu"
        messages = assert_nvcc_compiles(
            [cuda_function(launch, f"custom_kernel_moe_specialized_{i}")], path,
            suppress=("177",), body_name=launch.name, header=kernels.launch_bounds(384, 1),
            flags=("-Xptxas", "-v", "-keep", "-keep-dir", str(tmp_path)))
        # exactly the launch's 168: the roles' split (`_role_registers`) counts on
        # them, and setmaxnreg.inc would wait for ever for registers never given
        assert int(re.search(r"Used (\d+) registers", messages).group(1)) == 168
        ptx = (tmp_path / f"specialized_{i}.compute_90a.ptx").read_text()
        assert ptx.count("setmaxnreg") == (2 if template["MMA_REGISTERS"] else 0)

def test_nvcc_compiles_every_warpgroup_width(tmp_path):
    """Each wgmma width the CUDA prelude spells (`WGMMA_BY_N`: N = 8 * row
    tiles), in both forms (A from registers, from shared memory) and both
    16-bit formats, through ptxas, each call its own width's instruction: a
    width no launch takes (the register form's past WARPGROUP_ROW_TILES) is
    otherwise never assembled. And every width a launch may take is one it
    spells."""
    prelude = kernels.prelude("cuda", "grouped_qmm_tiles")
    by_n = re.search(r"#define WGMMA_BY_N\(FORM\)(.*)", prelude).group(1)
    widths = [int(n) for n in re.findall(r"ROW_TILES_N == (\d+)", by_n)]
    assert set(WARPGROUP_ROW_TILES) | set(SHARED_WEIGHTS_ROW_TILES) <= set(widths)
    calls = [f"  warpgroup_mma<{kind}, {row_tiles}>(d, a, b, 64, 256);\n"
             f"  warpgroup_mma_ss<{kind}, {row_tiles}>(d, b, 0, b, 1024);"
             for kind in (1, 2) for row_tiles in widths]
    sums = 4 * max(widths)  # a thread's N / 2 sums
    function = "\n".join([
        "__global__ void warpgroup_widths(const uint32_t* in, float* out) {",
        "  __shared__ __align__(1024) unsigned b[8192];",
        "  unsigned a[4] = {in[0], in[1], in[2], in[3]};",
        f"  float d[{sums}] = {{}};", *calls, f"  warpgroup_wait<0>(d, {sums});",
        f"  for (int i = 0; i < {sums}; ++i) out[i] = d[i];", "}"])
    path = tmp_path / "warpgroup_widths.cu"
    assert_nvcc_compiles([function], path, body_name="grouped_qmm_tiles")
    result = subprocess.run([NVCC, "-arch=sm_90a", "-std=c++17", "-ptx", str(path), "-o",
                             str(path.with_suffix(".ptx"))], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    ptx = path.with_suffix(".ptx").read_text()
    for row_tiles in widths:
        for types in ("f16.f16", "bf16.bf16"):
            shape = f"wgmma.mma_async.sync.aligned.m64n{8 * row_tiles}k16.f32.{types}"
            assert ptx.count(shape) == 2, shape  # the register form's and the shared one's


def test_cuda_launches_include_their_own_blocks():
    """CUDA's block tiles differ from Metal's (99 KB of stages against 32, the
    gated launch's tall blocks), so the compiled launches hold CUDA's own."""
    templates = [dict(launch.template) for launch in _every_launch()
                 if launch.name == "grouped_qmm_tiles"]
    assert any(t["GATED"] and t["BLOCK_ROWS"] == 128 for t in templates)
    # the warps' own stages of 128 values (2 groups of 64), past Metal's memory
    assert any(t["STAGES"] == 2 and t["STAGE_GROUPS"] == 2 and not t["WARPGROUP"]
               for t in templates)
    # and the warpgroup's multiply-adds (wgmma's text), in blocks of 64 rows and 128,
    # of the weights made in shared memory too (both operands there), and in
    # their blocks of every other width, one projection and gated
    assert {t["ROW_TILES"] for t in templates if t["WARPGROUP"]} \
        == set(SHARED_WEIGHTS_ROW_TILES) | set(WARPGROUP_ROW_TILES)
    for row_tiles in OTHER_MADE_WEIGHTS_ROW_TILES:
        assert {t["GATED"] for t in templates
                if t["SHARED_WEIGHTS"] and t["ROW_TILES"] == row_tiles} == {False, True}
    # and the weights made a step ahead of their multiply-adds (WEIGHTS_AHEAD),
    # and a group's items one run of stages (ACROSS_ITEMS)
    assert {t["GATED"] for t in templates if t["WEIGHTS_AHEAD"]} == {False, True}
    assert {t["GATED"] for t in templates if t["ACROSS_ITEMS"]} == {False, True}


def test_nvcc_compiles_the_load_patterns(tmp_path):
    # benchmarks.load_patterns' kernels, CUDA text of their own on the prelude,
    # as its `mx.fast.cuda_kernel` calls make them: each pattern a function.
    from benchmarks.load_patterns import PATTERNS, ROW_BYTES

    functions = []
    for i, (_, source, constants, _, _) in enumerate(PATTERNS):
        lines = [_template_line(name, value)
                 for name, value in [("ROW", ROW_BYTES), *constants.items()]]
        functions.append("\n".join([f"__global__ void load_pattern_{i}(const uint32_t* weights, "
                                    "const int32_t* regions, uint32_t* out) {", *lines,
                                    source, "}"]))
    assert_nvcc_compiles(functions, tmp_path / "load_patterns.cu")
