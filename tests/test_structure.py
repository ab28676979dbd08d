# How the package is put together: what it imports at run time. The semantics
# are tested against the NumPy reference elsewhere; these tests keep the parts
# apart that docs/DESIGN.md describes as apart.

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_moe_plan

PACKAGE_DIR = Path(mlx_moe_plan.__file__).parent


def _module_name(path: Path) -> str:
    parts = ("mlx_moe_plan", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# Every Python module of the package, by dotted name.
MODULES = {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


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


def _executed_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:`, which never run."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(name: str) -> set[str]:
    """The package's modules that module `name` imports, anywhere in its text
    (function-level imports too: a lazy import still closes a circle), but
    for type checkers only."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _executed_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[: len(base) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            # `from .x import y` runs x; `from . import y` runs the submodule y
            # if there is one (the C++ extension _ext is one, but no Python
            # module of the package), else the package that defines y.
            targets = [source] if node.module else []
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:
                    targets.append(submodule)
                elif not node.module and importlib.util.find_spec(submodule) is None:
                    targets.append(source)
        else:
            continue
        found |= {target for target in targets if target in MODULES and target != name}
    return found


def test_module_list_is_complete():
    assert {"mlx_moe_plan", "mlx_moe_plan._backend", "mlx_moe_plan.kernels",
            "mlx_moe_plan.kernels.launch"} <= set(MODULES)


def test_no_import_circles():
    # Each module's imports of the package's own modules form no circle, so a
    # module can be read, and imported, after the ones it names.
    graph = {name: _imports(name) for name in MODULES}
    done, path = set(), []

    def visit(name: str) -> None:
        if name in path:
            circle = path[path.index(name):] + [name]
            raise AssertionError("import circle: " + " -> ".join(circle))
        if name in done:
            return
        path.append(name)
        for imported in sorted(graph[name]):
            visit(imported)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_circle_check_sees_lazy_imports():
    # _backend imports the two backends inside a function: still an edge.
    # _gradients imports _backend for its annotations only: no edge.
    assert {"mlx_moe_plan._cpu", "mlx_moe_plan._gpu"} <= _imports("mlx_moe_plan._backend")
    assert "mlx_moe_plan._backend" not in _imports("mlx_moe_plan._gradients")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_module_imports_alone(name):
    # In a fresh interpreter, first thing: no module relies on another having
    # been imported before it.
    if name == "mlx_moe_plan.nn" and importlib.util.find_spec("mlx_lm") is None:
        pytest.skip("the layer needs mlx-lm, which is not installed")
    _run_python(f"import importlib; importlib.import_module({name!r})")


# --- the backend interface ----------------------------------------------------------


def _backends():
    from mlx_moe_plan import _gpu

    # A GpuBackend only names its kernels' instantiation: building one runs
    # nothing, so its interface is checked on any machine. The CPU backend
    # needs the C++ extension, which a GPU machine may run without.
    try:
        from mlx_moe_plan import _cpu
    except ImportError as error:
        cpu = pytest.param(None, id="cpu", marks=pytest.mark.skip(reason=str(error)))
    else:
        cpu = pytest.param(_cpu.CPU, id="cpu")
    return [cpu, pytest.param(_gpu.GpuBackend("metal"), id="metal"),
            pytest.param(_gpu.GpuBackend("cuda"), id="cuda")]


@pytest.mark.parametrize("backend", _backends())
def test_backends_satisfy_the_protocol(backend):
    from mlx_moe_plan._backend import Backend

    assert isinstance(backend, Backend)
    # moe_plan converts every other dtype to int32: each plan must read it.
    assert mx.int32 in backend.plan_id_dtypes
    for name in ("plan", "gather_rows", "combine_rows", "grouped_qmm_computes",
                 "argsort_slice_computes"):
        declared = inspect.signature(getattr(Backend, name))
        implemented = inspect.signature(getattr(type(backend), name))
        # Names, kinds, defaults and annotations (as written), return included.
        assert implemented == declared, f"{name}{implemented} is not {name}{declared}"


@pytest.mark.parametrize("backend", _backends())
def test_optional_kernels_are_declared(backend):
    # grouped_qmm and argsort_slice: None where a backend lacks them, and then
    # it computes no input with them; else the call the protocol declares.
    from mlx_moe_plan._backend import ArgsortSlice, GroupedQmm

    for name, protocol in (("grouped_qmm", GroupedQmm), ("argsort_slice", ArgsortSlice)):
        kernel = getattr(backend, name)
        if kernel is None:
            continue
        declared = inspect.signature(protocol.__call__)
        declared = declared.replace(parameters=list(declared.parameters.values())[1:])
        assert inspect.signature(kernel) == declared, name
    gpu = backend.grouped_qmm is not None
    assert backend.grouped_qmm_computes(bits=4, group_size=64, dtype=mx.bfloat16) == gpu
    assert not backend.grouped_qmm_computes(bits=4, group_size=64, dtype=mx.float32)
    assert backend.argsort_slice_computes(row_size=128, dtype=mx.float16) == gpu
    assert (backend.argsort_slice is None) == (backend.grouped_qmm is None)


# The MoE layer, its parts and the routers reach GPU kernels through the
# backend's declared capabilities: only the GPU backend imports the kernels.
KERNELS = {name for name in MODULES if name.startswith("mlx_moe_plan.kernels")}


@pytest.mark.parametrize("name", sorted(set(MODULES) - KERNELS - {"mlx_moe_plan._gpu"}))
def test_only_the_gpu_backend_imports_the_kernels(name):
    assert not _imports(name) & KERNELS, f"{name} imports {sorted(_imports(name) & KERNELS)}"


def test_the_kernel_import_check_sees_the_gpu_backend():
    assert "mlx_moe_plan.kernels.launch" in _imports("mlx_moe_plan._gpu")
