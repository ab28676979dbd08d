"""Kernel texts: one body per kernel, one prelude and prologue per backend.

A body is plain C in a small dialect whose names every prelude defines
(`DIALECT_NAMES`); the prologue declares the thread indices at the top of the
body (Metal's signature gains a thread attribute only when the body names it).

| body            | Metal, CUDA (`mlx_moe_plan/_gpu.py`) | OpenCL on PoCL (tests) |
|-----------------|--------------------------------------|------------------------|
| `plan.h`        | `moe_plan`: hist, scan, place phases | `tests/test_kernels_pocl.py` |
| `gather.h`      | `moe_gather`, `moe_unsort`, grads    | same                   |
| `combine.h`     | `moe_combine`, grads                 | same                   |

`launch.py` gives each body's grid, group size, sizes and template constants,
for every instantiation alike.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

BACKENDS = ("metal", "cuda", "opencl")
BODIES = ("plan", "gather", "combine")

# Every prelude defines these; the prologues declare the last four.
DIALECT_NAMES = (
    "i64", "GLOBAL", "SHARED", "BARRIER", "SHARED_ATOMIC_UINT", "ATOMIC_ADD", "ATOMIC_LOAD",
    "ATOMIC_STORE", "LOAD_IN", "STORE_OUT", "BITS_TO_FLOAT", "HALF_BITS_TO_FLOAT", "MUL_RN", "ADD_RN", "ZERO_VEC16", "IS_ALIGNED16",
)
THREAD_NAMES = ("LOCAL_ID", "GROUP_ID", "GROUP_SIZE", "NUM_GROUPS")

_HERE = Path(__file__).parent


@cache
def text(name: str) -> str:
    """A kernel file as written, comments included."""
    return (_HERE / f"{name}.h").read_text()


@cache
def compact(name: str) -> str:
    """A kernel file without comments, indentation or blank lines.

    What the backends compile. MLX's CUDA backend rebuilds and hashes a custom
    kernel's whole source on every call (`python -m benchmarks.dispatch`
    measures the cost per kilobyte), so the comments, half of `plan.h`, would
    cost time on every call. Lines stay lines, so preprocessor directives keep
    working; a compiler's line numbers are those of `body(name, backend)`.

    Only `//` comments are stripped, which is exact for texts without block
    comments, line continuations and quotes: any of those raises ValueError.
    """
    source = text(name)
    if "/*" in source or re.search(r"\\[ \t]*$", source, flags=re.M):
        raise ValueError(f"{name}.h: kernels.compact takes no /* */ comments and no "
                         "backslash line continuations")
    code = re.sub(r"//[^\n]*", "", source)
    if '"' in code or "'" in code:
        raise ValueError(f"{name}.h: kernels.compact takes no string or character literals")
    return "".join(line.strip() + "\n" for line in code.splitlines() if line.strip())


def prelude(backend: str) -> str:
    return compact(f"prelude_{backend}")


def body(name: str, backend: str) -> str:
    """The kernel body as a backend compiles it: prologue, then the body."""
    return compact(f"prologue_{backend}") + compact(name)
