"""The C++ extension (`src/`), imported once and checked against the MLX it
runs with: the CPU backend's primitives (`_cpu`), and what MLX's transforms
are doing (`_tracing`).
"""

from __future__ import annotations

try:
    from . import _ext
except ImportError as error:  # a missing build, not a missing symbol deep inside
    raise ImportError(
        "mlx_moe_plan's C++ extension is not built. Install the package with "
        "`pip install --no-build-isolation .` next to the MLX it will run with "
        "(see the README)."
    ) from error

import mlx.core as mx

REBUILD = "`pip install --no-build-isolation --force-reinstall --no-deps .`"

if _ext.built_with_mlx != mx.__version__:
    raise ImportError(
        f"mlx_moe_plan's C++ extension was built against MLX {_ext.built_with_mlx} but "
        f"MLX {mx.__version__} is installed: rebuild it with {REBUILD}"
    )
# An extension built from an older tree for the same MLX lacks what the GPU
# glue asks (`_tracing`): the same rebuild mends it.
if not hasattr(_ext, "transforming"):
    raise ImportError(
        f"mlx_moe_plan's C++ extension was built from an older version of the package: "
        f"rebuild it with {REBUILD}"
    )
