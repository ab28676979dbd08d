# How the package is put together: what it imports at run time. The semantics
# are tested against the NumPy reference elsewhere; these tests keep the parts
# apart that docs/DESIGN.md describes as apart.

from __future__ import annotations

import ast
import functools
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


def test_dispatch_returns_a_backend():
    from mlx_moe_plan import _backend, _cpu

    assert _backend.implementation(mx.default_stream(mx.cpu)) is _cpu.CPU


# --- the plan's fields: one order in Python, C++ and the plan kernel ------------------


def test_cpu_primitive_names_its_outputs_in_plan_fields_order():
    from mlx_moe_plan import _ext, _sizes

    assert tuple(_ext.plan_outputs) == _sizes.PLAN_FIELDS


@pytest.mark.parametrize("with_weights", [False, True])
def test_cpu_primitive_outputs_have_the_fields_sizes(with_weights):
    # Each output of the C++ primitive is the size and dtype of the field its
    # name says: what output_shapes lays out agrees with _sizes.field_sizes.
    from mlx_moe_plan import _ext, _sizes

    num_experts, tile_m, top_k = 4, 4, 3
    ids = mx.array([0, 4, 4, -1, 2, 9, 1, 1, 3], mx.int32)  # 5 routed, 1 skipped, 3 invalid
    weights = mx.ones(ids.shape, mx.float32) if with_weights else None
    outputs = _ext.plan(ids, weights, num_experts, tile_m, top_k, stream=mx.cpu)
    sizes = _sizes.field_sizes(ids.size, num_experts, tile_m)
    # capacity 24, tiles 6, entries 9, experts 4 and 5: a swap of two shows.
    assert len({sizes[name] for name in ("row_tokens", "tile_experts", "positions",
                                         "expert_counts", "expert_offsets")}) == 5
    names = _sizes.PLAN_FIELDS if with_weights else _sizes.PLAN_FIELDS[:-1]
    assert len(outputs) == len(names)
    for name, output in zip(names, outputs):
        assert output.size == sizes[name], name
        assert output.dtype == (mx.float32 if name == _sizes.WEIGHT_FIELD else mx.int32), name
        assert output.ndim == (0 if name.startswith("num_") else 1), name
    by_name = dict(zip(names, outputs))
    # Four experts of 1 or 2 entries, padded to 4 rows each: 16 rows, 4 tiles.
    counts = {name: by_name[name].item() for name in ("num_rows", "num_tiles", "num_invalid")}
    assert counts == {"num_rows": 16, "num_tiles": 4, "num_invalid": 3}


def _plan_kernel_offsets(sizes: dict[str, int]) -> dict[str, int]:
    """Each field's offset in plan_data, as kernels/plan.h computes it.

    plan.h points a name at each field (`GLOBAL int* positions = tile_experts
    + max_tiles;`) and writes the last three through `totals[i]`; evaluated
    here with the given sizes, so that any reordering there shows.
    """
    from mlx_moe_plan import kernels

    body = kernels.compact("plan")
    values = {"plan_data": 0, "capacity": sizes["row_tokens"],
              "max_tiles": sizes["tile_experts"], "num_entries": sizes["positions"],
              "num_experts": sizes["expert_counts"]}
    pointers = re.findall(r"^GLOBAL int\* (\w+) = ([\w\s*+]+);$", body, flags=re.M)
    assert pointers, "plan.h: no `GLOBAL int* name = ...;` lines"
    offsets = {}
    for name, expression in pointers:
        offsets[name] = values[name] = eval(expression, {"__builtins__": {}}, dict(values))
    totals = offsets.pop("totals")
    written = re.findall(r"^totals\[(\d)\] = (.+);$", body, flags=re.M)
    assert len(written) == 3
    for index, value in written:
        # totals[0] = num_rows; ... totals[2] = (int)ATOMIC_LOAD(&invalid_total[0]);
        name = next(n for n in ("num_rows", "num_tiles", "num_invalid")
                    if n.removeprefix("num_") in value)
        offsets[name] = totals + int(index)
    return offsets


@pytest.mark.parametrize("num_entries, num_experts, tile_m", [(9, 5, 4), (1000, 37, 16),
                                                              (7, 1024, 1)])
def test_plan_kernel_writes_the_layout_launch_gives(num_entries, num_experts, tile_m):
    from mlx_moe_plan import _sizes
    from mlx_moe_plan.kernels import launch

    layout, data_size = launch.plan_layout(num_entries, num_experts, tile_m)
    assert tuple(layout) == launch.PLAN_DATA_FIELDS
    assert launch.PLAN_DATA_FIELDS + (_sizes.WEIGHT_FIELD,) == _sizes.PLAN_FIELDS
    offsets = _plan_kernel_offsets(_sizes.field_sizes(num_entries, num_experts, tile_m))
    assert offsets == {name: offset for name, (offset, _) in layout.items()}
    assert data_size == max(offset + size for offset, size in layout.values())


def test_plan_fields_are_the_plans_attributes():
    # Every field is a MoEPlan attribute of the size _sizes gives it.
    from mlx_moe_plan import _sizes

    indices = mx.array([[0, 4], [4, -1], [2, 9]], mx.int32)
    plan = mlx_moe_plan.moe_plan(indices, 5, weights=mx.ones(indices.shape), tile_m=4,
                                 stream=mx.cpu)
    sizes = _sizes.field_sizes(indices.size, 5, 4)
    for name in _sizes.PLAN_FIELDS:
        assert getattr(plan, name).size == sizes[name], name


# --- kernel parameters: named once, in kernels/launch.py --------------------------------


@pytest.mark.parametrize("name", ["plan", "gather", "combine", "grouped_qmm",
                                  "grouped_qmm_tiles", "grouped_qmm_roles"])
def test_bodies_read_params_in_launch_order(name):
    # A body reads its `params` array by position, each value into a constant
    # named as launch.py names it: `const int hidden = params[1];`. Those lines
    # are the whole of a body's use of params.
    from mlx_moe_plan import kernels
    from mlx_moe_plan.kernels import launch

    body = kernels.compact(name)
    reads = re.findall(r"^const (?:int|i64) (\w+) = params\[(\d+)\];$", body, flags=re.M)
    assert reads == [(field, str(i)) for i, field in enumerate(launch.PARAMS[name]._fields)]
    assert body.count("params") == len(reads)
    assert launch.INPUTS_OUTPUTS[name][0][-1] == "params"


def test_launches_carry_their_bodys_params():
    from mlx_moe_plan.kernels import launch

    launches = {"plan": launch.plan_launch(1000, 37, 4, 2, True),
                "gather": launch.gather_launch(10, 8, 20, "float16", "float16"),
                "combine": launch.combine_launch(20, 8, 10, 2, True, "float16", "float32"),
                "grouped_qmm": launch.grouped_qmm_launch(4, 64, 24, 9, 4, 32, "bfloat16",
                                                         backend="cuda"),
                "grouped_qmm_tiles": launch.grouped_qmm_launch(4, 64, 24, 900, 4, 32, "bfloat16",
                                                               backend="cuda"),
                "argsort_slice": launch.argsort_slice_launch(3, 128, 120, 8, "bfloat16"),
                "head_norm_rope": launch.head_norm_rope_launch(8, 1, 32, 4, 128, 5120, 0, 5120,
                                                               4096, False, 1e-6, 1e6, 1.0,
                                                               "bfloat16"),
                "add_rms_norm": launch.add_rms_norm_launch(8, 2048, 1e-6, "bfloat16")}
    launches["decode_attention"], launches["decode_attention_merge"] = \
        launch.decode_attention_launches(8, 32, 4, 128, False, 128 ** -0.5, "bfloat16")
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_specialized=1,
                                   **launch.SHARED_WEIGHTS_TILING):
        launches["grouped_qmm_roles"] = launch.grouped_qmm_launch(
            4, 64, 24, 900, 4, 64, "bfloat16", backend="cuda", warpgroup=True)
    assert set(launches) == set(launch.PARAMS) == set(launch.INPUTS_OUTPUTS)
    for name, kernel_launch in launches.items():
        assert kernel_launch.body == name
        assert type(kernel_launch.params) is launch.PARAMS[name]
    plan_params = launches["plan"].params
    assert (plan_params.num_entries, plan_params.tile_m, plan_params.top_k) == (1000, 4, 2)


def test_launch_calls_are_cached_by_the_streams_text_and_bounded():
    # Every call of a launch asks for its bound kernel and params
    # (_gpu._launch_call): one entry a launch and stream, however many Stream
    # objects name it, and the oldest dropped past the bound.
    from mlx_moe_plan import _gpu

    made = []
    cached = _gpu.cache_by_stream(lambda value, stream: made.append(value) or value, maxsize=2)
    for _ in range(3):
        assert cached(1, mx.default_stream(mx.cpu)) == 1
    assert made == [1]
    cached(2, mx.cpu)
    cached(3, mx.cpu)
    cached(1, mx.default_stream(mx.cpu))
    assert made == [1, 2, 3, 1]
    cached.cache_clear()
    cached(3, mx.cpu)
    assert made == [1, 2, 3, 1, 3]


def test_launch_bounds_reach_the_cuda_header(monkeypatch):
    """A launch's `min_groups` reaches the header MLX compiles on CUDA, after
    the prelude (`kernels.launch_bounds`); none without it, none on Metal."""
    from mlx_moe_plan import _gpu, kernels

    headers = {}

    def recorder(backend):
        return lambda **arguments: headers.__setitem__(backend, arguments["header"])

    monkeypatch.setattr(mx.fast, "cuda_kernel", recorder("cuda"))
    monkeypatch.setattr(mx.fast, "metal_kernel", recorder("metal"))
    prelude = kernels.prelude("cuda", "grouped_qmm_tiles")
    _gpu._kernel.__wrapped__("cuda", "grouped_qmm_tiles", 1024, (128, 3))
    assert headers["cuda"] == prelude + kernels.launch_bounds(128, 3)
    assert "__launch_bounds__(128, 3)" in headers["cuda"]
    _gpu._kernel.__wrapped__("cuda", "grouped_qmm_tiles", 1024, None)
    assert headers["cuda"] == prelude
    _gpu._kernel.__wrapped__("metal", "grouped_qmm_tiles", 0, (128, 3))
    assert headers["metal"] == kernels.prelude("metal", "grouped_qmm_tiles")


def test_grouped_qmm_tilings_are_checked():
    from mlx_moe_plan.kernels import launch

    for bad in (dict(threads=48), dict(threads=96), dict(tiles=0), dict(gated_tiles=0),
                dict(steps=0), dict(row_tiles=0), dict(tiles_from_rows=-1),
                dict(block_stages=1), dict(block_shared_stages=2), dict(block_shared_stages=0),
                dict(block_row_warps=3),
                dict(block_row_tiles=0), dict(block_min_groups=-1), dict(block_min_groups=17),
                dict(block_min_groups_up_to_rows=-1), dict(block_min_groups_up_to_in_dims=-1)):
        with pytest.raises(ValueError, match="grouped_qmm tiling"):
            with launch.grouped_qmm_tiling(**bad):
                pass
    default = launch.grouped_qmm_launch(8, 64, 40, 9, 4, 32, "bfloat16", backend="cuda")
    with launch.grouped_qmm_tiling(steps=1, max_groups=2) as tiling:
        assert tiling.steps == 1
        changed = launch.grouped_qmm_launch(8, 64, 40, 9, 4, 32, "bfloat16", backend="cuda")
    assert dict(changed.template)["STEPS"] == 1 and changed.groups == 2
    assert launch.grouped_qmm_launch(8, 64, 40, 9, 4, 32, "bfloat16", backend="cuda") == default
    # The block tiles from tiles_from_rows rows an expert, in the backend's shared memory.
    with launch.grouped_qmm_tiling(tiles_from_rows=4):
        tiles = launch.grouped_qmm_launch(8, 64, 40, 32, 4, 32, "bfloat16", backend="cuda")
        small = launch.grouped_qmm_launch(8, 64, 40, 31, 4, 32, "bfloat16", backend="cuda")
        metal = launch.grouped_qmm_launch(8, 64, 40, 32, 4, 32, "bfloat16", backend="metal")
    assert (tiles.body, small.body) == ("grouped_qmm_tiles", "grouped_qmm")
    assert dict(metal.template)["STAGES"] <= dict(tiles.template)["STAGES"]


# --- docs/DESIGN.md cites what the repository holds ------------------------------------

REPOSITORY = PACKAGE_DIR.parent
DESIGN = REPOSITORY / "docs" / "DESIGN.md"


@pytest.mark.skipif(not DESIGN.exists(), reason="not a source checkout")
def test_design_doc_cites_what_exists():
    # Every repository path the design cites exists, and in `path::name`, each
    # part of the name occurs in that file as a word.
    text = DESIGN.read_text()
    cited = re.findall(r"(?<![\w./])((?:\.ci|docs|mlx_moe_plan|src|tests|benchmarks)/[\w./]*)"
                       r"((?:::[\w.:]+)?)", text)
    assert len(cited) > 50
    for path, name in cited:
        path = path.rstrip(".")
        assert (REPOSITORY / path).exists(), path
        if name:
            source = (REPOSITORY / path).read_text()
            for part in re.split(r"::|\.", name.strip(":.")):
                assert re.search(rf"\b{re.escape(part)}\b", source), f"{path}{name}: {part}"


# --- the docs' links reach their headings ------------------------------------------

DOCS = [REPOSITORY / "README.md", DESIGN, REPOSITORY / "benchmarks" / "RESULTS.md",
        REPOSITORY / "benchmarks" / "HISTORY.md"]


@functools.cache  # every link asks its file's anchors: each file read once
def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives `path`'s headings: lower case, all but word
    characters, hyphens and spaces dropped, spaces as hyphens, a repeated
    heading's anchor suffixed -1, -2, ... (fenced code is not headings)."""
    anchors, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{anchor}-{seen[anchor]}" if anchor in seen else anchor)
            seen[anchor] = seen.get(anchor, 0) + 1
    return anchors


@pytest.mark.skipif(not DESIGN.exists(), reason="not a source checkout")
def test_doc_links_reach_their_headings():
    # The README's figures link to RESULTS' entries, and RESULTS to HISTORY's:
    # a renamed heading or a moved file must take its links along.
    links = [(doc, target, anchor) for doc in DOCS for target, anchor in
             re.findall(r"\]\((?!https?:)([^)#\s]*)(?:#([^)\s]+))?\)", doc.read_text())]
    assert len(links) > 100
    for doc, target, anchor in links:
        linked = (doc.parent / target).resolve() if target else doc
        assert linked.exists(), f"{doc.name}: {target}"
        assert not anchor or anchor in heading_anchors(linked), f"{doc.name}: {target}#{anchor}"
    assert heading_anchors(REPOSITORY / "benchmarks" / "RESULTS.md") >= {
        "tests-on-the-gpu", "whole-models-on-one-gpu"}
