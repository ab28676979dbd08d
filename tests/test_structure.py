# How the package is put together: what it imports at run time. The semantics
# are tested against the NumPy reference elsewhere; these tests keep the parts
# apart that docs/DESIGN.md describes as apart.

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run_python(code: str) -> None:
    """Runs `code` in a fresh interpreter, which must exit cleanly."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_ops_run_without_numpy_or_the_reference():
    # The NumPy reference is the tests' oracle, not a dependency of the ops:
    # plan, gather, combine and unsort, and a gradient, import neither.
    _run_python("""
        import sys
        import mlx.core as mx
        import mlx_moe_plan as moe

        indices = mx.array([[0, 2], [1, -1], [2, 5]])
        plan = moe.moe_plan(indices, 3, weights=mx.ones(indices.shape), tile_m=2,
                            stream=mx.cpu)
        x = mx.ones((3, 4))
        rows = moe.moe_gather(x, plan, stream=mx.cpu)
        grad = mx.grad(lambda x: moe.moe_combine(moe.moe_gather(x, plan, stream=mx.cpu), plan,
                                                 stream=mx.cpu).sum())(x)
        mx.eval(plan.outputs, rows, moe.moe_unsort(rows, plan, stream=mx.cpu), grad)
        loaded = [name for name in ("numpy", "mlx_moe_plan.reference") if name in sys.modules]
        assert not loaded, f"loaded at run time: {loaded}"
    """)
