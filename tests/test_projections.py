"""Dense quantized projections taking a decoding batch's rows as one matrix.

`projections.take_rows` (`patch_model(dense_rows=True)`) and the rule that
decides it, `rules.dense_as_rows`. The rule says no on the CPU, so the
patched models here compute what mlx-lm's do, bit for bit; the `rows_always`
fixture stands in for a backend where it says yes, so the reshaped GEMM runs
on any device, and on a GPU (`tests/gpu_suite.sh`, step `nn`) these tests
check MLX's GEMM of rows against its B GEMMs of one row.
"""

from __future__ import annotations

import copy
import gc

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm")

from mlx_lm.generate import batch_generate  # noqa: E402
from mlx_lm.utils import load  # noqa: E402

import conftest  # noqa: E402
import lm_fixtures  # noqa: E402
from conftest import as_float32, mlx_multiplies_rows  # noqa: E402
from mlx_moe_plan import _backend, _compiled, projections, reference, rules  # noqa: E402
from mlx_moe_plan.nn import SwitchGLU, patch_model  # noqa: E402
from mlx_moe_plan.projections import RowsProjection, take_rows  # noqa: E402

MOE_MODELS = ("qwen3_moe", "mixtral", "gpt_oss")


@pytest.fixture
def rows_always(monkeypatch):
    """The rule saying yes to every decoding batch of more than one row, as
    on a CUDA stream (the MoE layers keep the CPU's formulations). The
    compiled blocks' traces, which hold the rule's answers, are dropped before
    and after: another answer for the same shapes needs traces of its own."""
    monkeypatch.setattr(projections, "dense_as_rows", lambda *args, **kwargs: True)
    monkeypatch.setattr(projections, "dense_from_rows", lambda out_dims: 1)
    monkeypatch.setattr(projections, "on_cuda", lambda stream=None: True)
    _compiled._SHARED_FORWARDS.clear()
    yield
    _compiled._SHARED_FORWARDS.clear()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict:
    """Small mlx-lm model directories: 4-bit, and Qwen3-MoE with a tied lm_head."""
    root = tmp_path_factory.mktemp("projection_models")
    dirs = {name: lm_fixtures.write_model(root / name, name, bits=4) for name in MOE_MODELS}
    tied = dict(lm_fixtures.CONFIGS["qwen3_moe"], tie_word_embeddings=True)
    dirs["qwen3_moe-tied"] = lm_fixtures.write_model(root / "qwen3_moe-tied", "qwen3_moe",
                                                     bits=4, config=tied)
    return dirs


def skip_where_mlx_multiplies_wrong() -> None:
    """The small models' projections take `lm_fixtures.HIDDEN_SIZE` values:
    where MLX's own quantized_matmul cannot be trusted with such rows on this
    device (`conftest.mlx_multiplies_rows`), mlx-lm's model, the reference of
    the test that calls this, is wrong too, and so are the patched model's
    projections that MLX computes: the test skips."""
    if not mlx_multiplies_rows(lm_fixtures.HIDDEN_SIZE, lm_fixtures.GROUP_SIZE):
        pytest.skip(f"MLX {mx.__version__}'s quantized_matmul on {mx.default_device()} gets "
                    f"rows of {lm_fixtures.HIDDEN_SIZE} values wrong, so mlx-lm's model too")


def loaded(path, dtype=mx.bfloat16):
    model, tokenizer = load(str(path))
    model.set_dtype(dtype)  # the float weights and scales; the packed words stay
    return model, tokenizer


# ------------------------------------------------------------------ the rule


@pytest.mark.parametrize("out_dims, rows, bits, dtype_bits, mode, want", [
    (4096, 8, 4, 16, "affine", True),      # queries: from 8 rows
    (151936, 8, 4, 16, "affine", True),    # an lm_head
    (151936, 8, 8, 16, "affine", True),    # 8 bits, as 4
    (2048, 8, 8, 16, "affine", False),
    (2048, 16, 8, 16, "affine", True),
    (2048, 16, 4, 16, "affine", True),     # the attention's output: from 16 rows
    (2048, 8, 4, 16, "affine", False),
    (2880, 16, 4, 16, "affine", True),     # columns not a multiple of 128
    (151936, 7, 4, 16, "affine", False),   # matrix-vector products either way
    (512, 64, 4, 16, "affine", False),     # keys and values: narrow
    (128, 64, 8, 16, "affine", False),     # a router
    (4096, 32, 3, 16, "affine", False),    # not measured
    (4096, 32, 6, 16, "affine", False),
    (4096, 32, 4, 32, "affine", False),
    (4096, 32, 4, 16, "mxfp4", False),
])
def test_rule_on_cuda(out_dims, rows, bits, dtype_bits, mode, want):
    assert rules.dense_as_rows(out_dims, 2048, rows, bits, dtype_bits, mode, cuda=True) is want
    # Elsewhere never: what mlx-lm computes.
    assert rules.dense_as_rows(out_dims, 2048, rows, bits, dtype_bits, mode, cuda=False) is False


@pytest.mark.parametrize("sizes_say, on_cuda, want", [
    (True, True, True), (True, False, False), (False, True, False)])
def test_rows_need_the_sizes_and_a_cuda_stream(monkeypatch, sizes_say, on_cuda, want):
    """The layer asks the rule with its sizes and the rows' bits, and takes
    rows only on a CUDA stream (stood in for on any machine)."""
    asked = []
    monkeypatch.setattr(projections, "dense_as_rows",
                        lambda *args, cuda: asked.append((args, cuda)) or sizes_say)
    monkeypatch.setattr(projections, "on_cuda", lambda stream=None: on_cuda)
    layer = nn.QuantizedLinear(64, 256, group_size=32, bits=8)
    take_rows(layer)
    x = mx.random.normal((8, 1, 64)).astype(mx.float16)
    assert projections._as_rows(layer, x) is want
    assert asked == [((256, 64, 8, 8, 16, "affine"), True)]


def test_the_route_is_asked_once_a_shape_and_dtype(monkeypatch):
    """A layer asks its rules once for each shape and dtype of its input and
    dtype of its scales and keeps the answer, outside its structure as a
    compiled trace sees it; a copy of it starts with no answers."""
    asked = []
    monkeypatch.setattr(projections, "dense_as_rows",
                        lambda *args, cuda: asked.append(args) or True)
    monkeypatch.setattr(projections, "on_cuda", lambda stream=None: True)
    monkeypatch.setattr(projections, "dense_from_rows", lambda out_dims: 1)
    layer = nn.QuantizedLinear(64, 256, group_size=32, bits=8)
    plain = nn.QuantizedLinear(64, 256, group_size=32, bits=8)
    plain.update(layer.parameters())
    take_rows(layer)
    structure = _compiled._structure(layer)
    rng = np.random.default_rng(3)
    step = mx.array(rng.standard_normal((8, 1, 64)).astype(np.float32))
    for _ in range(3):
        np.testing.assert_allclose(np.array(layer(step)), np.array(plain(step)),
                                   rtol=1e-5, atol=1e-5)
    assert len(asked) == 1
    layer(step[:4])
    assert len(asked) == 2
    layer.set_dtype(mx.float16)
    layer(step.astype(mx.float16))
    assert [args[4] for args in asked] == [32, 32, 16]
    assert _compiled._structure(layer) == structure
    copied = copy.deepcopy(layer)
    assert not copied.__dict__.get("_projection_routes")
    copied(step.astype(mx.float16))
    assert len(asked) == 4
    # More rows than compile (a prefill's): asked at every call, nothing kept.
    kept = len(layer._projection_routes)
    routes = []
    asked_route = projections._asked_route
    monkeypatch.setattr(projections, "_asked_route",
                        lambda *args: routes.append(asked_route(*args)) or routes[-1])
    prefill = mx.array(rng.standard_normal((1, _compiled.COMPILE_MAX_TOKENS + 1, 64))
                       .astype(np.float16))
    layer(prefill)
    layer(prefill)
    assert routes == ["plain", "plain"] and len(layer._projection_routes) == kept
    # Requantized in place (another width of group): asked anew.
    layer.update(dict(zip(("weight", "scales", "biases"),
                          mx.quantize(mx.array(rng.standard_normal((256, 64)).astype(np.float16)),
                                      group_size=64, bits=8))))
    layer.group_size = 64
    layer(step.astype(mx.float16))
    assert len(routes) == 3
    # Forgotten (a benchmark changing the rules): every kept answer dropped,
    # and the next call asks again.
    assert layer._projection_routes
    _compiled.forget(layer)
    assert not layer._projection_routes
    layer(step.astype(mx.float16))
    assert len(routes) == 4 and len(layer._projection_routes) == 1


# ------------------------------------------------------------------ the layers


class OwnCall(nn.QuantizedLinear):
    """A subclass computing otherwise: left as it is."""

    def __call__(self, x):
        return super().__call__(x) * 2


def small_tree() -> nn.Module:
    tree = nn.Module()
    tree.linear = nn.QuantizedLinear(64, 256, bias=True, group_size=32, bits=4)
    tree.embedding = nn.QuantizedEmbedding(256, 64, group_size=32, bits=4)
    tree.plain = nn.Linear(64, 64)
    tree.own = OwnCall(64, 128, group_size=32, bits=4)
    return tree


def test_take_rows_keeps_classes_and_parameters():
    tree = small_tree()
    before = tree_flatten(tree.parameters())
    assert take_rows(tree) == 2
    assert take_rows(tree) == 0  # once
    assert isinstance(tree.linear, nn.QuantizedLinear) and isinstance(tree.linear, RowsProjection)
    assert isinstance(tree.embedding, nn.QuantizedEmbedding)
    assert isinstance(tree.embedding, RowsProjection)
    assert not isinstance(tree.plain, RowsProjection) and not isinstance(tree.own, RowsProjection)
    after = tree_flatten(tree.parameters())
    assert [k for k, _ in after] == [k for k, _ in before]
    assert all(a is b for (_, a), (_, b) in zip(after, before))
    # Weights load into it by the same names.
    fresh = small_tree()
    take_rows(fresh)
    fresh.load_weights(before)
    assert all(mx.array_equal(a, b) for (_, a), (_, b) in
               zip(tree_flatten(fresh.parameters()), before))


@pytest.mark.parametrize("shape, as_rows", [
    ((8, 1, 64), True), ((2, 3, 1, 64), True), ((1, 1, 64), False), ((4, 2, 64), False),
    ((5, 64), False),
    pytest.param((0, 1, 64), False, marks=pytest.mark.skipif(
        mx.default_device().type == mx.gpu,
        reason="MLX's CUDA quantized_matmul fails to launch on no rows, patched or not")),
])
def test_rows_call_computes_the_batched_call(rows_always, monkeypatch, shape, as_rows):
    tree = small_tree()
    x = mx.array(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    want_linear = tree.linear(x)
    want_tied = tree.embedding.as_linear(x)
    seen = []
    original = mx.quantized_matmul

    def spy(x, *args, **kwargs):
        seen.append(x.shape)
        return original(x, *args, **kwargs)

    take_rows(tree)
    monkeypatch.setattr(mx, "quantized_matmul", spy)
    got_linear = tree.linear(x)
    got_tied = tree.embedding.as_linear(x)
    rows = (x.size // 64, 64) if as_rows else shape
    assert seen == [rows, rows]
    for got, want in ((got_linear, want_linear), (got_tied, want_tied)):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ siblings


@pytest.mark.parametrize("in_dims, rows, bits, dtype_bits, mode, cuda, want", [
    (2048, rules.SIBLINGS_FROM_ROWS, 4, 16, "affine", True, True),
    (2048, 64, 4, 16, "affine", True, True),
    (2048, rules.SIBLINGS_FROM_ROWS - 1, 4, 16, "affine", True, False),  # a vector's product
    (rules.SIBLINGS_BELOW_IN_DIMS, 8, 4, 16, "affine", True, False),     # gpt-oss-20b's
    (2048, 8, 8, 16, "affine", True, False),     # 8 bits: not measured
    (2048, 8, 4, 32, "affine", True, False),     # float32 rows
    (2048, 8, 4, 16, "mxfp4", True, False),
    (2000, 8, 4, 16, "affine", True, False),     # not whole groups of 64
    (2048, 8, 4, 16, "affine", False, False),    # the CPU, Metal
])
def test_dense_joins_siblings_rule(in_dims, rows, bits, dtype_bits, mode, cuda, want):
    assert rules.dense_joins_siblings(in_dims, rows, bits, dtype_bits, mode, cuda=cuda) is want


class Attention(nn.Module):
    """Queries, keys and values on one input, as mlx-lm's attention calls them."""

    def __init__(self, bias: bool = False, key_bits: int = 4):
        super().__init__()
        self.q_proj = nn.QuantizedLinear(128, 256, bias=bias, group_size=64, bits=4)
        self.k_proj = nn.QuantizedLinear(128, 64, bias=bias, group_size=64, bits=key_bits)
        self.v_proj = nn.QuantizedLinear(128, 64, bias=bias, group_size=64, bits=4)
        if bias:  # not zeros, so that a bias stacked out of order shows
            for name in ("q_proj", "k_proj", "v_proj"):
                self[name].bias = mx.random.normal((self[name].weight.shape[0],))

    def __call__(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


@pytest.fixture
def joined(rows_always, monkeypatch):
    """The siblings' rule saying yes wherever the rows' rule does (on CUDA,
    stood in)."""
    monkeypatch.setattr(projections, "dense_joins_siblings", lambda *args, **kwargs: True)


def gemm_spy(monkeypatch) -> list:
    """The output rows of the weights of every `quantized_matmul` from now on."""
    seen = []
    original = mx.quantized_matmul

    def spy(x, w, *args, **kwargs):
        seen.append(w.shape[0])
        return original(x, w, *args, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", spy)
    return seen


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 128), (8, 1, 128), (2, 3, 1, 128)])
def test_siblings_compute_one_gemm(joined, monkeypatch, bias, shape):
    """A decoding step's queries, keys and values by one GEMM of the stacked
    matrices, each its own part, bit for bit the members' own on the CPU;
    the members keep their parameters' names, values and dtypes."""
    attention = Attention(bias)
    attention.set_dtype(mx.bfloat16)
    unjoined = copy.deepcopy(attention)
    before = tree_flatten(attention.parameters())
    x = mx.random.normal(shape).astype(mx.bfloat16)
    want = unjoined(x)
    assert take_rows(attention) == 3
    assert all(isinstance(m.__dict__.get("_siblings"), projections._Membership)
               for m in (attention.q_proj, attention.k_proj, attention.v_proj))
    after = tree_flatten(attention.parameters())
    assert [k for k, _ in after] == [k for k, _ in before]
    assert all(a.dtype == b.dtype and mx.array_equal(a, b).item()
               for (_, a), (_, b) in zip(after, before))
    seen = gemm_spy(monkeypatch)
    got = attention(x)
    assert seen == [384]
    for part, wanted in zip(got, want):
        assert part.shape == wanted.shape and mx.array_equal(part, wanted).item()
    # The next step again: one GEMM.
    attention(x + 1)
    assert seen == [384, 384]
    # Forgotten (a benchmark changing the rules): the members' routes and the
    # stacked layer's, which lies outside the model's tree, asked anew.
    stacked = attention.q_proj._siblings.siblings.stacked
    assert stacked._projection_routes and attention.q_proj._projection_routes
    _compiled.forget(attention)
    assert not stacked._projection_routes and not attention.q_proj._projection_routes


@st.composite
def sibling_sets(draw):
    """Two or three projections alike but in their output rows, the order a
    forward calls them in, and a decoding step's input (no rows included,
    off the GPU: MLX's CUDA quantized_matmul does not launch on none)."""
    on_cpu = mx.default_device().type == mx.cpu
    group_size = draw(st.sampled_from([32, 64, 128]))
    bits = draw(st.sampled_from([2, 3, 4, 6, 8] if on_cpu else [4, 8]))
    in_dims = group_size * draw(st.integers(1, 3))
    outs = draw(st.lists(st.integers(1, 80), min_size=2, max_size=3))
    order = draw(st.permutations(range(len(outs))))
    least = 0 if on_cpu else 1
    lead = draw(st.sampled_from([(draw(st.integers(least, 9)),), (2, draw(st.integers(1, 3)))]))
    return dict(group_size=group_size, bits=bits, in_dims=in_dims, outs=outs, order=order,
                shape=(*lead, 1, in_dims), bias=draw(st.booleans()),
                dtype=draw(st.sampled_from([mx.float32, mx.float16, mx.bfloat16])),
                seed=draw(st.integers(0, 2**16)))


@given(case=sibling_sets())
def test_siblings_against_their_members(case):
    """Any siblings, called in any order: each member's output what its own
    GEMM gives (the stacked matrix holds its rows unchanged), bit for bit on
    the CPU; on a GPU, where MLX picks its kernel by the columns too, within
    the rounding of another order of summation."""
    # The joined GEMM multiplies the rows as one matrix: where MLX's own
    # kernel gets such rows wrong on this device, the case would test MLX.
    assume(mlx_multiplies_rows(case["in_dims"], case["group_size"]))
    mx.random.seed(case["seed"])
    module = nn.Module()
    names = projections.SIBLING_NAMES[len(case["outs"]) == 2]  # q, k, v; or gate, up
    for name, out_dims in zip(names, case["outs"]):
        module[name] = nn.QuantizedLinear(case["in_dims"], out_dims, bias=case["bias"],
                                          group_size=case["group_size"], bits=case["bits"])
        if case["bias"]:
            module[name].bias = mx.random.normal((out_dims,))
    module.set_dtype(case["dtype"])
    x = mx.random.normal(case["shape"]).astype(case["dtype"])
    want = {name: nn.QuantizedLinear.__call__(module[name], x) for name in names}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(projections, "on_cuda", lambda stream=None: True)
        patch.setattr(projections, "dense_as_rows", lambda *args, **kwargs: True)
        patch.setattr(projections, "dense_joins_siblings", lambda *args, **kwargs: True)
        patch.setattr(projections, "dense_from_rows", lambda out_dims: 1)
        take_rows(module)
        assert all(module[name]._siblings.index == i for i, name in enumerate(names))
        got = {names[i]: module[names[i]](x) for i in case["order"]}
    for name in names:
        assert got[name].shape == want[name].shape, name
        if mx.default_device().type == mx.cpu:
            assert mx.array_equal(got[name], want[name]).item(), name
        elif want[name].size:
            tolerance = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}[case["dtype"]]
            error = relative_error(got[name].astype(mx.float32), want[name].astype(mx.float32))
            assert error < tolerance, (name, error, exact_errors(module[name], x, got[name],
                                                                 want[name]))


def exact_errors(linear: nn.QuantizedLinear, x: mx.array, got: mx.array,
                 want: mx.array) -> str:
    """How far the members' output (`got`) and MLX's own GEMM's (`want`) lie
    from the exact product of the dequantized weights, in float64: where the
    two disagree, which of them is off."""
    weights = reference.dequantize(np.array(linear.weight), as_float32(linear.scales),
                                   as_float32(linear.biases), linear.bits, linear.group_size)
    exact = as_float32(x).astype(np.float64) @ weights.T
    if "bias" in linear:
        exact = exact + np.array(linear.bias.astype(mx.float32))
    norm = np.linalg.norm(exact)
    errors = [np.linalg.norm(np.array(out.astype(mx.float32)) - exact) / norm
              for out in (got, want)]
    return f"from the exact product: the members' {errors[0]:.3g}, MLX's own {errors[1]:.3g}"


def test_siblings_keep_the_memory(monkeypatch):
    """The members' arrays are views of the stacked ones: once evaluated, the
    modules hold no more bytes than before (within the allocator's rounding),
    not twice them."""
    monkeypatch.setattr(projections, "on_cuda", lambda stream=None: True)
    modules = [Attention() for _ in range(8)]
    mx.eval([m.parameters() for m in modules])
    held = sum(a.nbytes for m in modules for _, a in tree_flatten(m.parameters()))
    # MLX's CUDA allocator rounds a buffer up to a power of two below 16 KB
    # and to whole 16 KB pages above: the stacked words, 24 KB a module, take
    # 32, and its scales and biases 4 KB each for 3, a third more than the
    # members' arrays, a power of two each, took. Twice the bytes would add
    # all of `held`.
    slack = held / 8 if mx.default_device().type == mx.cpu else held / 2
    gc.collect()
    before = mx.get_active_memory()
    for module in modules:
        assert take_rows(module) == 3
    mx.eval([m.parameters() for m in modules])
    gc.collect()
    assert all("_siblings" in m.q_proj.__dict__ for m in modules)
    # Bounded above only, here and below: an evaluation can free other tests'
    # arrays too (after some of the benchmarks' tests MLX's count fell by 31 to
    # 42 KB here), and a doubling adds all of `held`, twice the slack or more,
    # which no such freeing hides.
    assert mx.get_active_memory() - before < slack
    # Weights loaded since, before any call: the stacked arrays go with the
    # views they replaced, as the weights are set (half the modules by
    # `load_weights`, half by assigning each member's weight).
    for index, module in enumerate(modules):
        fresh = Attention()
        if index % 2:
            module.load_weights(tree_flatten(fresh.parameters()))
        else:
            for name in ("q_proj", "k_proj", "v_proj"):
                module[name].weight = fresh[name].weight
        mx.eval(module.parameters())
        assert module.q_proj._siblings.siblings.ended
    gc.collect()
    assert mx.get_active_memory() - before < slack
    for module in modules:
        module(mx.random.normal((1, 1, 128)))  # each member alone, on its own arrays


def test_mlx_products_are_trusted_by_the_shape(monkeypatch):
    """The rule that skips tests where MLX's own quantized_matmul is wrong
    (`conftest.mlx_multiplies_rows`): off CUDA always trusted; on CUDA, in
    the MLX releases it names, not below MLX_SHORT_ROWS values nor for rows
    of one quantization group, trusted from that width in two groups or
    more; in any newer release trusted (whose tests then show whether the
    fault is gone)."""
    models = (lm_fixtures.HIDDEN_SIZE, lm_fixtures.GROUP_SIZE)
    if not _backend.on_cuda():
        assert mlx_multiplies_rows(*models)
    monkeypatch.setattr(_backend, "on_cuda", lambda stream=None: True)
    short = conftest.MLX_SHORT_ROWS
    for version, newer in (("0.32.4", False), ("0.32.3", False), ("0.31.10", False),
                           ("0.32.5", True), ("0.32.10", True), ("1.0.0", True),
                           ("0.33.0.dev20261201", True)):
        monkeypatch.setattr(mx, "__version__", version)
        for in_dims, group_size in (models, (short - 32, 32), (short, short), (2 * short, 256)):
            assert mlx_multiplies_rows(in_dims, group_size) is newer, (version, in_dims)
        for in_dims, group_size in ((short, 64), (short, 32), (2 * short, 128), (3 * 64, 64)):
            assert mlx_multiplies_rows(in_dims, group_size), (version, in_dims, group_size)


def test_siblings_on_other_inputs_and_after_new_weights(joined, monkeypatch):
    """A member called on another input than the first member's joins anew
    for it; a prefill's rows, a deep copy: each member computes alone; a
    member's weights replaced end the siblings, until joined anew; every
    member computes with the arrays it holds."""
    attention = Attention()
    take_rows(attention)
    seen = gemm_spy(monkeypatch)
    x, other = mx.random.normal((4, 1, 128)), mx.random.normal((4, 1, 128))
    queries = attention.q_proj(x)
    keys = attention.k_proj(other)
    assert seen == [384, 384]
    assert mx.allclose(keys, nn.QuantizedLinear.__call__(attention.k_proj, other)).item()
    assert mx.allclose(queries, nn.QuantizedLinear.__call__(attention.q_proj, x)).item()
    seen.clear()
    attention(mx.random.normal((1, 5, 128)))  # a prefill: not a decoding step
    assert seen == [256, 64, 64]
    copied = copy.deepcopy(attention)
    assert all(copied[name].__dict__.get("_siblings") is None
               for name in ("q_proj", "k_proj", "v_proj"))
    seen.clear()
    copied(x)
    assert seen == [256, 64, 64]
    # The keys' weights replaced: the siblings end as they are set, before
    # any call, and every member computes alone.
    fresh = Attention()
    want = (attention.q_proj(x), fresh.k_proj(x), attention.v_proj(x))
    siblings = attention.q_proj._siblings.siblings
    attention.k_proj.update(fresh.k_proj.parameters())
    assert siblings.ended
    seen.clear()
    got = attention(x)
    assert seen == [256, 64, 64]
    for part, wanted in zip(got, want):
        assert mx.array_equal(part, wanted).item()
    seen.clear()
    attention(x)
    assert seen == [256, 64, 64]
    # Joined anew, then every member's weights loaded: each alone, the
    # stacked arrays dropped.
    assert projections.join_siblings(attention) == 1
    seen.clear()
    attention(x)
    assert seen == [384]
    siblings = attention.q_proj._siblings.siblings
    attention.load_weights(tree_flatten(fresh.parameters()))
    seen.clear()
    got = attention(x)
    assert seen == [256, 64, 64] and siblings.stacked is None
    for part, wanted in zip(got, fresh(x)):
        assert mx.array_equal(part, wanted).item()
    _compiled.forget(attention)  # an ended member keeps no module beside it


def test_siblings_from_threads(joined):
    """Threads calling the same model on inputs of their own, as a stress
    test: each member takes the parts of its own thread's join, never
    another's (shapes tell them apart: each thread's batch is its own)."""
    import threading

    attention = Attention()
    take_rows(attention)
    wrong = []

    def forward(batch: int):
        x = mx.random.normal((batch, 1, 128))
        for _ in range(1000):
            shapes = [y.shape for y in attention(x)]
            if shapes != [(batch, 1, 256), (batch, 1, 64), (batch, 1, 64)]:
                wrong.append(shapes)

    threads = [threading.Thread(target=forward, args=(batch,)) for batch in (2, 3, 4, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong


def test_siblings_under_compile_and_grad(joined, monkeypatch):
    """Differentiated (one GEMM), compiled with the arrays captured (one
    GEMM), and compiled with the model's arrays as inputs (the members then
    hold tracers: the siblings end, and each computes alone): the members'
    values and the input's gradient."""
    attention = Attention()
    take_rows(attention)
    plain = Attention()
    plain.update(attention.parameters())
    x = mx.random.normal((4, 1, 128))

    def loss(module, x):
        q, k, v = module(x)
        return (q.sum() * 2 + (k * v).sum())

    seen = gemm_spy(monkeypatch)
    got = mx.grad(lambda x: loss(attention, x))(x)
    assert seen == [384]
    want = mx.grad(lambda x: loss(plain, x))(x)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
    seen.clear()
    captured = mx.compile(lambda x: loss(attention, x))
    assert mx.allclose(captured(x), loss(plain, x), rtol=1e-5, atol=1e-4).item()
    assert seen[0] == 384
    compiled = mx.compile(lambda x: loss(attention, x), inputs=attention.state)
    assert mx.allclose(compiled(x), loss(plain, x), rtol=1e-5, atol=1e-4).item()
    assert attention.q_proj._siblings.siblings.ended


def test_siblings_only_alike_and_on_cuda(monkeypatch):
    """Members alike in all but their output rows, and only on CUDA: keys of
    other bits are left alone; off CUDA nothing is joined."""
    monkeypatch.setattr(projections, "on_cuda", lambda stream=None: False)
    attention = Attention()
    take_rows(attention)
    assert "_siblings" not in attention.q_proj.__dict__
    monkeypatch.setattr(projections, "on_cuda", lambda stream=None: True)
    mixed = Attention(key_bits=8)
    take_rows(mixed)
    assert all("_siblings" not in mixed[name].__dict__ for name in ("q_proj", "k_proj"))
    mlp = nn.Module()
    mlp.gate_proj = nn.QuantizedLinear(128, 256, bias=False, group_size=64, bits=4)
    mlp.up_proj = nn.QuantizedLinear(128, 256, bias=False, group_size=64, bits=4)
    take_rows(mlp)
    assert mlp.gate_proj._siblings.index == 0 and mlp.up_proj._siblings.index == 1
    assert projections.join_siblings(mlp) == 0  # once


@pytest.mark.parametrize("out_dims, rows, bits, dtype_bits, mode, cuda, want", [
    (151936, 512, 4, 16, "affine", True, True),
    (rules.DENSE_EXPERT_FROM_OUT_DIMS, rules.DENSE_EXPERT_FROM_ROWS, 4, 16, "affine", True,
     True),
    (151936, rules.DENSE_EXPERT_FROM_ROWS - 1, 4, 16, "affine", True, False),
    (rules.DENSE_EXPERT_FROM_OUT_DIMS - 1, 8192, 4, 16, "affine", True, False),
    (151936, 8192, 8, 16, "affine", True, False),
    (151936, 8192, 4, 32, "affine", True, False),
    (151936, 8192, 4, 16, "mxfp4", True, False),
    (151936, 8192, 4, 16, "affine", False, False),
])
def test_dense_as_expert_rule(out_dims, rows, bits, dtype_bits, mode, cuda, want):
    assert rules.dense_as_expert(out_dims, 2048, rows, bits, dtype_bits, mode,
                                 cuda=cuda) is want


class OneExpertBackend:
    """A grouped kernel made of MLX's GEMM, recording its calls: the glue of
    `projections._one_expert` on any device (the kernel itself is tested on
    its own)."""

    def __init__(self):
        self.calls = []

    def grouped_qmm_computes(self, *, bits, group_size, dtype):
        return True

    def grouped_qmm(self, rows, weight, scales, biases, expert_offsets, row_experts, *,
                    bits, group_size, stream, bias=None, dense=False):
        assert dense  # a dense projection's launch (launch.grouped_qmm_launch's `dense`)
        self.calls.append((rows.shape, weight.shape, expert_offsets.tolist(),
                           row_experts.tolist(), None if bias is None else bias.shape))
        out = mx.quantized_matmul(rows, weight[0], scales[0], biases[0], transpose=True,
                                  group_size=group_size, bits=bits)
        return out if bias is None else out + bias[row_experts]


@pytest.fixture
def fresh_traces():
    """No compiled forward from before, none left after: a trace holds the
    answers of the rules and the backend it was made with."""
    _compiled._SHARED_FORWARDS.clear()
    yield
    _compiled._SHARED_FORWARDS.clear()


@pytest.mark.parametrize("expert", [True, False])
def test_rows_take_the_grouped_kernel_as_one_expert(monkeypatch, fresh_traces, expert):
    """With `expert` (patch_model's `dense`), a prefill's rows go to the
    grouped kernel as one expert spanning them all where `dense_as_expert`
    says so (here from 6 rows), the layer's own bias added, and a decoding
    step's `[B, 1, D]` where `dense_decoding_expert` does (here from 2 rows),
    its plan made once a batch size; a batch of one does not; without it
    nothing goes there. Small batches run compiled: traced once, replayed,
    the trace shared by a layer alike with weights of its own."""
    backend = OneExpertBackend()
    monkeypatch.setattr(projections, "dense_as_expert",
                        lambda out_dims, in_dims, rows, *args, cuda: rows >= 6)
    monkeypatch.setattr(projections, "dense_decoding_expert",
                        lambda out_dims, in_dims, rows, *args, cuda: rows >= 2)
    monkeypatch.setattr(projections, "dense_as_rows", lambda *args, **kwargs: False)
    monkeypatch.setattr(projections, "dense_from_rows", lambda out_dims: 1)
    monkeypatch.setattr(projections, "on_cuda", lambda stream=None: True)
    monkeypatch.setattr(projections._backend, "implementation", lambda stream: backend)
    tree = small_tree()
    x = mx.array(np.random.default_rng(1).standard_normal((2, 3, 64)).astype(np.float32))
    step = mx.array(np.random.default_rng(2).standard_normal((3, 1, 64)).astype(np.float32))
    single = step[:1]
    calls = [lambda: tree.linear(x), lambda: tree.embedding.as_linear(x),
             lambda: tree.linear(step), lambda: tree.embedding.as_linear(step),
             lambda: tree.linear(single)]
    want = [call() for call in calls]
    take_rows(tree, expert=expert)
    got = [call() for call in calls]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)
    # The linear layer's bias goes to the kernel (float32, as the rows);
    # the embedding has none.
    prefill = ((6, 64), (1, 256, 8), [0, 6], [0] * 6)
    decoding = ((3, 64), (1, 256, 8), [0, 3], [0] * 3)
    assert backend.calls == ([(*prefill, (1, 256)), (*prefill, None), (*decoding, (1, 256)),
                              (*decoding, None)] if expert else [])
    if not expert:
        return
    # streams alike, each a new object, find the same plan
    resolve = projections._backend.resolve_stream
    offsets, row_experts = projections._one_expert_plan(3, resolve(None))
    assert projections._one_expert_plan(3, resolve(None))[0] is offsets
    assert (offsets.dtype, offsets.tolist(), row_experts.tolist()) == (mx.int32, [0, 3], [0] * 3)
    # replayed: the same sums, no new trace
    again = [call() for call in calls]
    assert len(backend.calls) == 4
    for g, w in zip(again, want):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)
    other = small_tree()  # new weights, the same structure
    other_want = other.linear(step)
    take_rows(other, expert=True)
    np.testing.assert_allclose(np.array(other.linear(step)), np.array(other_want),
                               rtol=1e-5, atol=1e-5)
    assert len(backend.calls) == 4 and not np.allclose(np.array(other_want), np.array(want[2]))


@pytest.mark.parametrize("out_dims, in_dims, rows, bits, dtype_bits, mode, cuda, want", [
    # lm_heads: from 2 rows below 8, and from 64; one row MLX's
    (151936, 2048, 1, 4, 16, "affine", True, False),
    (151936, 2048, rules.DENSE_DECODING_WIDE_LEAST_ROWS, 4, 16, "affine", True, True),
    (rules.DENSE_DECODING_WIDE_OUT_DIMS, 2048, rules.DENSE_DECODING_WIDE_BELOW_ROWS - 1, 4, 16,
     "affine", True, True),
    (151936, 2048, rules.DENSE_DECODING_WIDE_BELOW_ROWS, 4, 16, "affine", True, False),
    (151936, 2048, 32, 4, 16, "affine", True, False),
    (201088, 2880, rules.DENSE_DECODING_WIDE_FROM_ROWS, 4, 16, "affine", True, True),
    # others: long inputs from 8 rows, the longest from 32
    (4096, 2048, 4, 4, 16, "affine", True, False),
    (4096, 2048, 8, 4, 16, "affine", True, False),
    (512, rules.DENSE_DECODING_FROM_IN_DIMS, rules.DENSE_DECODING_FROM_ROWS, 4, 16, "affine", True,
     True),
    (4096, 2880, rules.DENSE_DECODING_FROM_ROWS - 1, 4, 16, "affine", True, False),
    (4096, 2880, rules.DENSE_DECODING_TILES_FROM_ROWS, 4, 16, "affine", True, False),
    (2048, rules.DENSE_DECODING_TILES_FROM_IN_DIMS, rules.DENSE_DECODING_TILES_FROM_ROWS, 4, 16,
     "affine", True, True),
    (2048, 4096, 64, 4, 16, "affine", True, True),
    # what was not measured
    (2048, 4096, 16, 8, 16, "affine", True, False),
    (2048, 4096, 16, 4, 32, "affine", True, False),
    (2048, 4096, 16, 4, 16, "mxfp4", True, False),
    (2048, 4096, 16, 4, 16, "affine", False, False),
])
def test_dense_decoding_expert_rule(out_dims, in_dims, rows, bits, dtype_bits, mode, cuda,
                                   want):
    assert rules.dense_decoding_expert(out_dims, in_dims, rows, bits, dtype_bits, mode,
                                       cuda=cuda) is want


@given(out_dims=st.sampled_from([1, 128, 512, 2048, 4096, rules.DENSE_DECODING_WIDE_OUT_DIMS - 1,
                                 rules.DENSE_DECODING_WIDE_OUT_DIMS, 151936, 201088]),
       in_dims=st.sampled_from([64, 2048, 2880, 4096, 7168, 1 << 16]),
       rows=st.integers(1, 1024), bits=st.sampled_from([2, 3, 4, 5, 6, 8]),
       dtype_bits=st.sampled_from([16, 32]), mode=st.sampled_from(["affine", "mxfp4"]),
       cuda=st.booleans())
def test_no_rule_takes_fewer_rows_than_the_floor(out_dims, in_dims, rows, bits, dtype_bits,
                                                 mode, cuda):
    """`dense_from_rows` bounds every dense rule from below, a decoding
    step's and a prefill's, so a projection may skip asking them for an input
    of fewer rows."""
    sizes = (in_dims, rows, bits, dtype_bits, mode)
    takes = (rules.dense_as_rows(out_dims, *sizes, cuda=cuda)
             or rules.dense_decoding_expert(out_dims, *sizes, cuda=cuda)
             or rules.dense_joins_siblings(*sizes, cuda=cuda)
             or rules.dense_as_expert(out_dims, *sizes, cuda=cuda))
    if takes:
        assert rows >= rules.dense_from_rows(out_dims)


@pytest.mark.parametrize("out_dims, in_dims, rows", [
    (4096, 2048, rules.DENSE_ROWS_FROM_ROWS),  # as rows and joined, from the same count
    (151936, 2048, rules.DENSE_DECODING_WIDE_LEAST_ROWS),  # an lm_head through the grouped kernel
])
def test_the_floor_is_where_a_rule_takes(out_dims, in_dims, rows):
    """The floor is the fewest rows a rule takes, not merely below them."""
    assert rules.dense_from_rows(out_dims) == rows
    sizes = (in_dims, rows, 4, 16, "affine")
    assert (rules.dense_as_rows(out_dims, *sizes, cuda=True)
            or rules.dense_decoding_expert(out_dims, *sizes, cuda=True))


@pytest.fixture
def asked_routes(monkeypatch) -> list[tuple[int, ...]]:
    """The shape of each input whose route a layer asks (`_route`), as on a
    CUDA stream (stood in)."""
    monkeypatch.setattr(projections, "on_cuda", lambda stream=None: True)
    asked = []
    route = projections._route
    monkeypatch.setattr(projections, "_route", lambda *args, **kwargs: asked.append(args[1].shape)
                        or route(*args, **kwargs))
    return asked


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_an_input_below_the_floor_asks_no_route(asked_routes, bits):
    """An input of fewer rows than any rule takes, a decoding step's or a
    prefill's, computes the layer's own call at once, bit for bit, without
    building a route's key; from the floor the route is asked. An lm_head's
    floor is lower, an embedding's `as_linear` as a linear layer's."""
    layer = nn.QuantizedLinear(64, 256, group_size=32, bits=bits)
    plain = nn.QuantizedLinear(64, 256, group_size=32, bits=bits)
    plain.update(layer.parameters())
    tied = nn.QuantizedEmbedding(256, 64, group_size=32, bits=bits)
    tied_plain = nn.QuantizedEmbedding(256, 64, group_size=32, bits=bits)
    tied_plain.update(tied.parameters())
    head = nn.QuantizedEmbedding(rules.DENSE_DECODING_WIDE_OUT_DIMS, 64, group_size=32, bits=bits)
    for module in (layer, tied, head):
        take_rows(module, expert=True)
    floor = rules.dense_from_rows(256)
    head_floor = rules.dense_from_rows(rules.DENSE_DECODING_WIDE_OUT_DIMS)
    assert floor > head_floor == rules.DENSE_DECODING_WIDE_LEAST_ROWS
    rng = np.random.default_rng(4)
    below = [(1, 1, 64), (floor - 1, 1, 64), (2, 3, 1, 64), (1, floor - 1, 64), (floor - 1, 64)]
    for shape in below:
        x = mx.array(rng.standard_normal(shape).astype(np.float32))
        assert mx.array_equal(layer(x), plain(x)).item()
        assert mx.array_equal(tied.as_linear(x), tied_plain.as_linear(x)).item()
    assert asked_routes == []
    at_floor = [(floor, 1, 64), (1, floor, 64), (floor, 64)]
    for shape in at_floor:
        x = mx.array(rng.standard_normal(shape).astype(np.float32))
        layer(x)
        tied.as_linear(x)
    assert asked_routes == [shape for shape in at_floor for _ in range(2)]
    asked = len(asked_routes)
    for rows in (head_floor - 1, head_floor):
        head.as_linear(mx.array(rng.standard_normal((rows, 1, 64)).astype(np.float32)))
    assert asked_routes[asked:] == [(head_floor, 1, 64)]


def test_floors_read_anew(asked_routes, monkeypatch):
    """A patched layer keeps the floor of the rules it was patched under
    until `read_floors` reads them anew (a benchmark's variant of the rules'
    constants); a layer the patch left as it was has none."""
    tree = small_tree()
    take_rows(tree)
    assert tree.linear.plain_below_size == rules.dense_from_rows(256) * 64
    step = mx.array(np.random.default_rng(6).standard_normal((2, 1, 64)).astype(np.float32))
    tree.linear(step)
    assert asked_routes == []
    monkeypatch.setattr(projections, "dense_from_rows", lambda out_dims: 2)
    tree.linear(step)
    assert asked_routes == []
    projections.read_floors(tree)
    assert (tree.linear.plain_below_size, tree.embedding.plain_below_size) == (2 * 64, 2 * 64)
    tree.linear(step)
    assert asked_routes == [(2, 1, 64)]
    assert "plain_below_size" not in vars(tree.plain)


# ------------------------------------------------------------------ whole models


def decode_logits(model, batch: int, vocab: int) -> mx.array:
    """The logits of one decoding step of `batch` sequences after 3 tokens."""
    from mlx_lm.models.cache import make_prompt_cache

    rng = np.random.default_rng(batch)
    tokens = mx.array(rng.integers(0, vocab, (batch, 4)).astype(np.int32))
    cache = make_prompt_cache(model)
    model(tokens[:, :3], cache=cache)
    return model(tokens[:, 3:], cache=cache).astype(mx.float32)


def relative_error(got: mx.array, want: mx.array) -> float:
    return float(mx.linalg.norm(got - want) / mx.linalg.norm(want))


@pytest.mark.parametrize("name", [*MOE_MODELS, "qwen3_moe-tied"])
def test_rows_keep_the_logits(model_dirs, joined, monkeypatch, name):
    """bfloat16 activations, the rows call on every projection and the
    attention's projections joined: against the same model patched without
    them (the only change the projections' order of summation), within
    bfloat16's rounding; against a float32 run of the same weights, no
    further than mlx-lm's unpatched model is."""
    skip_where_mlx_multiplies_wrong()
    model, _ = loaded(model_dirs[name])
    without, _ = loaded(model_dirs[name])
    assert patch_model(without, dense_rows=False, dense=False) == 2
    patched, _ = loaded(model_dirs[name])
    assert patch_model(patched) == 2
    assert sum(isinstance(m, RowsProjection) for _, m in patched.named_modules()) > 0
    # The attention's projections joined (the rule's bfloat16 rows, on CUDA stood in).
    assert any("_siblings" in m.__dict__ for _, m in patched.named_modules())
    if name.endswith("-tied"):
        assert isinstance(patched.model.embed_tokens, RowsProjection)
    exact, _ = loaded(model_dirs[name], mx.float32)
    vocab = lm_fixtures.VOCAB_SIZE
    shapes = []
    original = mx.quantized_matmul

    def spy(x, *args, **kwargs):
        shapes.append(x.shape)
        return original(x, *args, **kwargs)

    for batch in (1, 4):
        monkeypatch.setattr(mx, "quantized_matmul", spy)
        got = decode_logits(patched, batch, vocab)
        monkeypatch.setattr(mx, "quantized_matmul", original)
        # The step's projections took the batch as rows (the CPU computes
        # both shapes alike, so only the shapes show it).
        assert ((batch, 64) in shapes) is (batch > 1), batch
        float32_logits = decode_logits(exact, batch, vocab)
        mlx_lms = relative_error(decode_logits(model, batch, vocab), float32_logits)
        without_rows = decode_logits(without, batch, vocab)
        # each one's distance from the float32 run, should the two part
        apart = (f"batch {batch}, from the float32 run: {relative_error(got, float32_logits):.3g} "
                 f"with the rows, {relative_error(without_rows, float32_logits):.3g} without, "
                 f"{mlx_lms:.3g} mlx-lm's")
        assert relative_error(got, without_rows) < 1e-2, apart
        assert relative_error(got, float32_logits) <= 1.1 * mlx_lms + 1e-3, apart


@pytest.mark.skipif(mx.default_device().type != mx.cpu,
                    reason="on a GPU the rule takes the rows, whose sums differ in order")
def test_rule_keeps_the_bits_on_the_cpu(model_dirs):
    """Where the rule keeps mlx-lm's shape (everywhere on the CPU), the
    projections compute what they compute unpatched, bit for bit."""
    model, _ = loaded(model_dirs["qwen3_moe"])
    patch_model(model, dense_rows=False, dense=False)
    patched, _ = loaded(model_dirs["qwen3_moe"])
    patch_model(patched)
    assert sum(isinstance(m, RowsProjection) for _, m in patched.named_modules()) > 0
    for batch in (1, 8):
        assert mx.array_equal(decode_logits(patched, batch, lm_fixtures.VOCAB_SIZE),
                              decode_logits(model, batch, lm_fixtures.VOCAB_SIZE))


@pytest.mark.parametrize("rows", ["rule", "always", "joined"])
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_batch_generate_matches_unpatched(model_dirs, request, name, rows):
    if rows != "rule":
        request.getfixturevalue({"always": "rows_always", "joined": "joined"}[rows])
    # Float32 activations, as the command tests run them: bfloat16's
    # rounding of the fused sums can turn a near tie of these random models.
    skip_where_mlx_multiplies_wrong()
    model, tokenizer = loaded(model_dirs[name], mx.float32)
    patched, _ = loaded(model_dirs[name], mx.float32)
    patch_model(patched)
    joined = any("_siblings" in m.__dict__ for _, m in patched.named_modules())
    assert joined is (rows != "rule" or projections.on_cuda())
    words = lm_fixtures.WORDS
    prompts = [tokenizer.encode(" ".join(words[i: i + length]))
               for i, length in ((0, 3), (5, 9), (11, 2), (20, 6))]
    want = batch_generate(model, tokenizer, prompts, max_tokens=8).texts
    got = batch_generate(patched, tokenizer, prompts, max_tokens=8).texts
    assert any(want), "nothing generated"
    assert got == want, first_difference(model, patched, tokenizer, prompts, want, got)


def first_difference(model, patched, tokenizer, prompts, want, got) -> str:
    """Where greedy texts differ: each differing prompt's first differing
    token, mlx-lm's margin between its best two logits there and the largest
    gap between the two models' logits, each model run on the prompt and
    mlx-lm's text as one sequence (no batch, no padding): a near tie that
    a different summation order turns, or a gap that says more."""
    lines = []
    for prompt, wanted, generated in zip(prompts, want, got):
        if wanted == generated:
            continue
        tokens = prompt + tokenizer.encode(wanted, add_special_tokens=False)
        others = tokenizer.encode(generated, add_special_tokens=False)
        at = next((i for i, (a, b) in enumerate(zip(tokens[len(prompt):], others)) if a != b),
                  min(len(tokens) - len(prompt), len(others)))
        position = len(prompt) - 1 + at  # the logits that chose generated token `at`
        sequence = mx.array(tokens)[None]
        theirs = np.array(model(sequence)[0, position].astype(mx.float32))
        ours = np.array(patched(sequence)[0, position].astype(mx.float32))
        best, second = np.sort(theirs)[::-1][:2]
        lines.append(f"{wanted!r} against {generated!r}: token {at}, mlx-lm's margin "
                     f"{best - second:.3g} of {best:.3g}, logits apart by at most "
                     f"{np.abs(ours - theirs).max():.3g}, argmax {theirs.argmax()} and "
                     f"{ours.argmax()}")
        if mx.default_device().type != mx.cpu:  # a third opinion: which side lies off it
            with mx.stream(mx.cpu):
                on_cpu = np.array(model(sequence)[0, position].astype(mx.float32))
            lines[-1] += (f", from mlx-lm's on the CPU by {np.abs(theirs - on_cpu).max():.3g} "
                          f"(mlx-lm's) and {np.abs(ours - on_cpu).max():.3g} (patched)")
    return "; ".join(lines)


def test_dense_rows_off_and_models_without_moe(model_dirs):
    patched, _ = loaded(model_dirs["mixtral"])
    patch_model(patched, dense_rows=False, dense=False)
    assert any(isinstance(m, SwitchGLU) for _, m in patched.named_modules())
    assert not any(isinstance(m, RowsProjection) for _, m in patched.named_modules())
    dense = nn.Sequential(nn.QuantizedLinear(64, 256, group_size=32, bits=4))
    assert patch_model(dense) == 0
    assert not isinstance(dense.layers[0], RowsProjection)


def test_dense_prefill_keeps_the_bits_of_narrow_projections(model_dirs):
    """patch_model marks the projections for the grouped kernel by default
    (and dense_rows=False keeps decoding's shape); off CUDA the rule says no,
    and on it for projections this narrow, so a prefill's logits are the model
    patched without it, bit for bit."""
    skip_where_mlx_multiplies_wrong()
    without, _ = loaded(model_dirs["qwen3_moe"])
    patch_model(without, dense=False)
    patched, _ = loaded(model_dirs["qwen3_moe"])
    patch_model(patched, dense_rows=False)
    marked = [m for _, m in patched.named_modules() if isinstance(m, RowsProjection)]
    assert marked and all(m.dense_expert and not m.decoding_rows for m in marked)
    assert not any(m.dense_expert for _, m in without.named_modules()
                   if isinstance(m, RowsProjection))
    tokens = mx.array(np.random.default_rng(2).integers(0, lm_fixtures.VOCAB_SIZE, (1, 512))
                      .astype(np.int32))
    assert mx.array_equal(patched(tokens), without(tokens))
