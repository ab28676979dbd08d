"""Kernel texts: one body per kernel, one prelude and prologue per backend.

A body is plain C in a small dialect whose names every prelude defines
(`DIALECT_NAMES`); the prologue declares the thread indices at the top of the
body (Metal's signature gains a thread attribute only when the body names it).
Metal and CUDA compile `prelude(backend, name)` (the prelude's sections the
body uses) and `body(name, backend)` through MLX
(`mlx_moe_plan/_gpu.py`); the tests compile the OpenCL ones on PoCL
(`tests/opencl_harness.py`). `launch.py` says how each body is run (arguments,
run-time sizes, groups, template constants), for every instantiation alike.

Each body, where it is launched, wrapped, mirrored on the CPU, differentiated
and tested (paths from the repository root; docs/DESIGN.md has the full map):

`plan.h` -- `moe_plan` (`mlx_moe_plan/plan.py`)
    launch:   `launch.plan_launch`, `launch.plan_layout`, `launch.PlanParams`
    GPU glue: `_gpu.GpuBackend.plan`
    C++:      `src/plan.cpp`: `plan`, `Plan` (outputs: `kPlanOutputs` in
              `src/primitives.h`)
    gradient: none (`Plan::vjp` gives zeros; the GPU stops the weights')
    tests:    `tests/test_plan.py`, `tests/test_kernels_pocl.py` (plan)

`gather.h` -- `moe_gather` and `moe_unsort` (`mlx_moe_plan/gather.py`)
    launch:   `launch.gather_launch`, `launch.GatherParams`
    GPU glue: `_gpu.GpuBackend.gather_rows`, `_gpu._gather_function`, `_gpu._gather`
    C++:      `src/gather.cpp`: `gather_rows`, `GatherRows`
    gradient: `_gradients.gather_rows_vjp` on the GPU (runs `combine.h`),
              `GatherRows::vjp` in `src/gather.cpp` on the CPU
    tests:    `tests/test_gather.py`, `tests/test_kernels_pocl.py` (gather),
              `tests/test_compile_grad.py`, `tests/test_gradients.py`

`combine.h` -- `moe_combine` (`mlx_moe_plan/combine.py`)
    launch:   `launch.combine_launch`, `launch.CombineParams`
    GPU glue: `_gpu.GpuBackend.combine_rows`, `_gpu._combine_function`, `_gpu._combine`
    C++:      `src/combine.cpp`: `combine_rows`, `CombineRows`
    gradient: `_gradients.combine_rows_vjp` on the GPU (runs `gather.h`),
              `CombineRows::vjp` in `src/combine.cpp` on the CPU
    tests:    `tests/test_combine.py`, `tests/test_kernels_pocl.py` (combine),
              `tests/test_compile_grad.py`, `tests/test_gradients.py`

`grouped_qmm.h` -- the layer's expert GEMM, `SwitchGLU`'s GROUPED formulation
    (`mlx_moe_plan/nn.py`); not a public op
    launch:   `launch.grouped_qmm_launch`, `launch.GroupedQmmParams`
    GPU glue: `_gpu.GpuBackend.grouped_qmm`, `_gpu._grouped_qmm_function`,
              `_gpu._grouped_qmm`
    C++:      none (the CPU runs sorted rows through MLX's `gather_qmm`)
    gradient: d rows through MLX's `gather_qmm`; the fused forms (rows from
              the tokens, gate and up, the projections' biases): d rows and d
              biases through the MLX ops of what they fuse
              (`_gpu.gated_activation`), in `_gpu._grouped_qmm_function`
    tests:    `tests/test_grouped_qmm.py`, `tests/test_kernels_pocl.py`
              (grouped_qmm, fused too, within float tolerance), `tests/test_nn.py`

`grouped_qmm_tiles.h` -- the same GEMM in block tiles staged in shared memory,
    for many rows an expert (prefill); `launch.grouped_qmm_launch` picks it
    (`launch.grouped_qmm_body`), the rest as `grouped_qmm.h`'s above; where
    its blocks are few, its input split among groups, whose float sums
    `combine.h` adds (`launch._input_splits`, `_gpu._input_split_index`)
    tests:    `tests/test_grouped_qmm.py`, `tests/test_kernels_pocl.py`
              (grouped_qmm_tiles, fused too, within float tolerance)

`qmm_params.h`, `qmm_fields.h`, `qmm_store.h` -- not bodies: the params and
    a warp's lanes, a packed word's fields as 16-bit pairs, and a warp's sums
    stored (the fused activation), the texts both grouped GEMM bodies include
    (`INCLUDED`)

`tiles_products.h` -- not a body: a stage's multiply-adds in the block tiles,
    the warps' own or, with WARPGROUP, a warpgroup's (Hopper's wgmma,
    `launch.GroupedQmmTiling.block_warpgroup`: A from the warps' registers,
    opt-in, or with SHARED_WEIGHTS both operands from group memory, where
    `launch._shared_weights_tiling` takes it), which grouped_qmm_tiles.h
    includes twice, over all of a warp's row tiles and over half (`INCLUDED`)

`grouped_qmm_roles.h` -- grouped_qmm_tiles.h's made weights' block with a
    warpgroup that only copies and makes the weights
    (`launch.GroupedQmmTiling.block_specialized`, PRODUCER_WARPGROUPS), the
    launch's body there (`Launch.body`), the rest as grouped_qmm_tiles.h's

`tiles_setup.h`, `tiles_run.h` -- not bodies: the block tiles' constants,
    group memory, scan and copies' places, and a group's run over its items
    (each a row block by a column block over the stages) in the roles the
    including place gives (copying and making the weights, multiplying,
    storing): grouped_qmm_tiles.h includes both, the run once for all roles;
    grouped_qmm_roles.h the run once for all (the lock-step emulations) and
    once a role (CUDA) (`INCLUDED`)

`tiles_weights.h` -- not a body: with SHARED_WEIGHTS, a stage's weights made
    16-bit by the whole group into group memory, which grouped_qmm_tiles.h
    includes before the stage's multiply-adds or, with WEIGHTS_AHEAD
    (`launch.GroupedQmmTiling.block_weights_ahead`), a step before (`INCLUDED`)

`group_scan.h` -- not a body: a group's inclusive scan of one count a
    thread, the text plan.h and both grouped GEMM bodies include (`INCLUDED`)

`argsort_slice.h` -- a router's top k on a GPU (`mlx_moe_plan/routing.py`);
    not a public op
    launch:   `launch.argsort_slice_launch`, `launch.ArgsortSliceParams`
    GPU glue: `_gpu.GpuBackend.argsort_slice`
    C++:      none (the CPU runs MLX's `argpartition`, as mlx-lm's routers do)
    gradient: the values beside the indices: `take_along_axis`'s
              (`_gpu._argsort_slice_function`); the indices: none
    tests:    `tests/test_routing.py`, `tests/test_kernels_pocl.py` (argsort_slice)

`head_norm_rope.h` -- a Qwen3 attention's queries and keys, each head
    RMS-normalized and rotated (`mlx_moe_plan/fused_attention.py`); not a
    public op
    launch:   `launch.head_norm_rope_launch`, `launch.HeadNormRopeParams`
    GPU glue: `_gpu.GpuBackend.head_norm_rope`, `_gpu._head_norm_rope_launched`,
              `_gpu._head_norm_rope_step`
    C++:      none (the CPU runs the attention's own `mx.fast.rms_norm` and
              `mx.fast.rope`)
    gradient: those ops' (`_gpu.head_norm_rope_by_ops`)
    tests:    `tests/test_fused_attention.py`, `tests/test_kernels_pocl.py`
              (head_norm_rope, within float tolerance)

`decode_attention.h`, `decode_attention_merge.h` -- a decoding step's
    attention, the keys split among groups, then the splits merged
    (`mlx_moe_plan/fused_attention.py`); not a public op
    launch:   `launch.decode_attention_launches`, `launch.decode_attention_splits`,
              `launch.DecodeAttentionParams`
    GPU glue: `_gpu.GpuBackend.decode_attention`, `_gpu._decode_attention_launched`,
              `_gpu._decode_attention_step`
    C++:      none (the CPU runs the attention's own
              `mx.fast.scaled_dot_product_attention`)
    gradient: that op's (`_gpu.decode_attention_by_ops`)
    tests:    `tests/test_fused_attention.py`, `tests/test_kernels_pocl.py`
              (decode_attention, within float tolerance)

`add_rms_norm.h` -- a decoder layer's residual add and the RMS norm after
    it (`mlx_moe_plan/fused_model.py`); not a public op
    launch:   `launch.add_rms_norm_launch`, `launch.AddRmsNormParams`
    GPU glue: `_gpu.GpuBackend.add_rms_norm`, `_gpu._add_rms_norm_launched`,
              `_gpu._add_rms_norm_step`
    C++:      none (the CPU runs the layer's own add and `mx.fast.rms_norm`)
    gradient: those ops' (`_gpu.add_rms_norm_by_ops`)
    tests:    `tests/test_fused_model.py`, `tests/test_kernels_pocl.py`
              (add_rms_norm, within float tolerance)

Every body: `tests/test_metal_source.py` checks its Metal source against MSL
rules; `tests/test_cuda_source.py` compiles its CUDA source with nvcc (where
installed); `tests/test_structure.py` checks its `params` reads against `launch.py`
(and plan.h's output layout against `launch.plan_layout`).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

BACKENDS = ("metal", "cuda", "opencl")
BODIES = ("plan", "gather", "combine", "grouped_qmm", "grouped_qmm_tiles", "grouped_qmm_roles",
          "argsort_slice",
          "head_norm_rope", "decode_attention", "decode_attention_merge", "add_rms_norm")

# Every prelude defines these; the prologues declare the last four.
DIALECT_NAMES = (
    "i64", "GLOBAL", "SHARED", "BARRIER", "SHARED_ATOMIC_UINT", "ATOMIC_ADD", "ATOMIC_LOAD",
    "ATOMIC_STORE", "LOAD_IN", "STORE_OUT", "ROUND_OUT", "BITS_TO_FLOAT", "HALF_BITS_TO_FLOAT",
    "MUL_RN", "ADD_RN", "VEC16", "IS_ALIGNED16", "WARP_UNIFORM", "UNROLL", "MMA_16x8x16",
    "PAIR_SUB", "PAIR_FMA", "PAIR_ROUND", "WARP_XOR", "AND_OR", "LOW_HALVES", "HIGH_HALVES",
    "BYTE_PAIR", "SHARED_SPACE",
    "SHARED_WORDS",
    "ASYNC_COPY16", "ASYNC_COMMIT", "ASYNC_WAIT", "WARP_BARRIER", "WARPGROUP_MMA",
    "WARPGROUP_MMA_SS", "WARPGROUP_FENCE", "WARPGROUP_COMMIT", "WARPGROUP_WAIT",
    "SHARED_PROXY_FENCE", "SWIZZLE128", "SHARED_ALIGN1024", "ROLE_BARRIER", "ROLES_APART",
    "WARP_REGISTERS",
)
THREAD_NAMES = ("LOCAL_ID", "GROUP_ID", "GROUP_SIZE", "NUM_GROUPS")

_HERE = Path(__file__).parent


@cache
def text(name: str) -> str:
    """A kernel file as written, comments included."""
    return (_HERE / f"{name}.h").read_text()


# Texts that bodies share: a body's line `// include: NAME` is replaced by
# NAME.h before compaction, and so are an included text's own (an included
# text reads and declares variables of the body around it, as its own comment
# says).
INCLUDED = ("qmm_params", "qmm_fields", "qmm_store", "group_scan", "tiles_products",
            "tiles_weights", "tiles_begin", "tiles_end", "tiles_run", "tiles_setup")


def source(name: str, _including: tuple[str, ...] = ()) -> str:
    """A kernel file with the texts it includes in place, and theirs in turn,
    comments included."""
    chain = (*_including, name)

    def included(match: re.Match) -> str:
        if match[1] not in INCLUDED:
            raise ValueError(f"{name}.h: no kernel text named {match[1]} to include")
        if match[1] in chain:
            raise ValueError(f"{name}.h: {' -> '.join((*chain, match[1]))} includes "
                             f"{match[1]}.h within itself")
        return source(match[1], chain)

    return re.sub(r"^[ \t]*// include: (\w+)[ \t]*$", included, text(name), flags=re.M)


@cache
def compact(name: str) -> str:
    """A kernel file, the texts it includes in place (`source`), without
    comments, indentation or blank lines.

    What the backends compile. MLX's CUDA backend rebuilds and hashes a custom
    kernel's whole source on every call (`python -m benchmarks.dispatch`
    measures the cost per kilobyte), so the comments, half of `plan.h`, would
    cost time on every call. Lines stay lines, so preprocessor directives keep
    working; a compiler's line numbers are those of `body(name, backend)`.

    Only `//` comments are stripped, which is exact for texts without block
    comments, line continuations, character literals and escapes in string
    literals (CUDA's inline PTX is strings): any of those raises ValueError.
    """
    return _compact_text(source(name), name)


def _compact_text(text_in: str, name: str) -> str:
    """`compact`'s work on a text of the file `name`."""
    if "/*" in text_in or re.search(r"\\[ \t]*$", text_in, flags=re.M):
        raise ValueError(f"{name}.h: kernels.compact takes no /* */ comments and no "
                         "backslash line continuations")
    # A string literal or a comment, whichever starts first: strings are kept.
    code = re.sub(r'"[^"\n]*"|//[^\n]*',
                  lambda match: match[0] if match[0].startswith('"') else "", text_in)
    if "'" in code or "\\" in code or any(line.count('"') % 2 for line in code.splitlines()):
        raise ValueError(f"{name}.h: kernels.compact takes no character literals, escapes "
                         "or strings across lines")
    return "".join(line.strip() + "\n" for line in code.splitlines() if line.strip())


# A prelude is a head, which every body takes, then sections, each opening
# with lines `// defines: NAME ...` that name what it defines (the dialect's
# names, and helpers another section calls). A body takes the sections that
# define a name it uses, and the sections those use in turn: MLX's CUDA
# backend hashes a kernel's whole source at every call, so the plan's 6 KB
# need not carry the warps' multiply-adds and wgmma's spellings (6 KB more).
_SECTION = re.compile(r"((?:^[ \t]*// defines:[^\n]*\n)+)", flags=re.M)


@cache
def prelude_sections(backend: str) -> tuple[tuple[frozenset[str], str], ...]:
    """`backend`'s prelude as (the names a section defines, its compact text):
    the head first, which defines no name of its own here and every body
    takes, then the sections in the file's order."""
    name = f"prelude_{backend}"
    parts = _SECTION.split(text(name))
    return ((frozenset(), _compact_text(parts[0], name)),
            *((frozenset(re.sub(r"// defines:", " ", names).split()),
               _compact_text(section, name))
              for names, section in zip(parts[1::2], parts[2::2])))


def _identifiers(code: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", code))


@cache
def prelude(backend: str, body_name: str | None = None) -> str:
    """`backend`'s prelude as compiled: for the body `body_name`, its head and
    the sections that body uses (`prelude_sections`), in the file's order;
    without one, all of it."""
    sections = prelude_sections(backend)
    if body_name is None:
        return "".join(section for _, section in sections)
    wanted = _identifiers(body(body_name, backend)) | _identifiers(sections[0][1])
    taken = {0}
    grown = True
    while grown:  # a section's own names may call for another's
        grown = False
        for index, (names, section) in enumerate(sections):
            if index not in taken and names & wanted:
                taken.add(index)
                wanted |= _identifiers(section)
                grown = True
    return "".join(section for index, (_, section) in enumerate(sections) if index in taken)


def body(name: str, backend: str) -> str:
    """The kernel body as a backend compiles it: prologue, then the body."""
    return compact(f"prologue_{backend}") + compact(name)


def launch_bounds(threads: int, min_groups: int) -> str:
    """CUDA header lines, after the prelude, that compile the kernel for
    `min_groups` groups of `threads` an SM at once (`__launch_bounds__`, the
    compiler then keeping a thread's registers to what they leave).

    MLX's `cuda_kernel` writes the kernel's signature itself, right after the
    header, and offers no place for the bound: so the header redefines the
    `__global__` that signature opens with, as CUDA's own headers define it
    (`__location__(global)`) with the bound beside it. Nothing after it but
    the kernel is compiled (mlx/backend/cuda/custom_kernel.cpp).
    """
    return (f"#undef __global__\n#define __global__ __location__(global) "
            f"__launch_bounds__({threads}, {min_groups})\n")
