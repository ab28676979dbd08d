"""The fused model (`mlx_moe_plan.fused_model`): Qwen3-MoE's residual adds and
the RMS norms after them, each pair in one launch of kernels/add_rms_norm.h.

On the CPU the launch is stood in for by its gradient's formula, MLX's own
ops (`_gpu.add_rms_norm_by_ops`, what the kernel computes within its
rounding), so the fused forward and the GPU glue's custom function run
anywhere, bit for bit against the model's own call; the kernel body itself
is tested on PoCL (tests/test_kernels_pocl.py) and, on a GPU
(`tests/gpu_suite.sh`, step `add-norm`), against MLX's ops and in
whole-model decoding.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import (assert_logits_close, check_add_rms_norm, glue_launched_by,
                      gpu_glue_on_the_cpu, recording_calls)

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (the test extra brings it)")

import lm_fixtures  # noqa: E402
from mlx_lm.generate import batch_generate  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from test_fused_attention import caches, decode, make_model, patched_fused  # noqa: E402
from test_fused_attention import launch_stood_in as attention_launch_stood_in  # noqa: E402, F401
from test_nn import CONFIGS  # noqa: E402

from mlx_moe_plan import _backend, _compiled, _gpu, fused_blocks, fused_model  # noqa: E402
from mlx_moe_plan import rules  # noqa: E402
from mlx_moe_plan import reference as ref  # noqa: E402
from mlx_moe_plan.fused_model import FusedModel  # noqa: E402
from mlx_moe_plan.nn import patch_model  # noqa: E402

# The launch runs where the rule takes it, CUDA: Metal is not measured.
on_cuda = pytest.mark.skipif(_backend.gpu_backend() != "cuda", reason="needs CUDA MLX")

LAYERS = CONFIGS["qwen3_moe"]["num_hidden_layers"]


# ------------------------------------------------------------------ the rule


def test_rule_is_off_until_measured():
    for rows in (1, 8, 64, 4096):
        assert rules.fuses_add_rms_norm(rows, cuda=True) is False
        assert rules.fuses_add_rms_norm(rows, cuda=False) is False


@pytest.mark.parametrize("rows, cuda, want", [(8, True, True), (7, True, False),
                                              (64, True, True), (64, False, False)])
def test_rule_from_its_rows_on_cuda(monkeypatch, rows, cuda, want):
    monkeypatch.setattr(rules, "ADD_RMS_NORM_FROM_ROWS", 8)
    assert rules.fuses_add_rms_norm(rows, cuda=cuda) is want


# ------------------------------------------------------------- the registry


@pytest.mark.parametrize("name", sorted(fused_model.FUSED_MODELS))
def test_fused_model_matches_mlx_lm(name):
    # The fused forward mirrors the model's __call__ and its decoder layers':
    # when mlx-lm's code changes, the model silently keeps its own call. Say
    # which, and its new digest, so the forward can be checked against it.
    entry = fused_model.FUSED_MODELS[name]
    for class_name, want in ((name, entry.model_digest), (entry.layer_class, entry.layer_digest)):
        digest = fused_blocks.source_digest(fused_blocks.load_class(class_name).__call__)
        assert digest == want, (
            f"{class_name}.__call__ is not the code fused_model._forward mirrors: its source "
            f"digest is now {digest!r}; compare the forward with the new code, then update "
            "FUSED_MODELS in mlx_moe_plan/fused_model.py")


@pytest.mark.parametrize("name, fused", [("qwen3_moe", True), ("mixtral", False),
                                         ("gpt_oss", False)])
def test_patch_model_fuses_the_registered_model(name, fused):
    model, models = patched_fused(name, FusedModel)
    assert len(models) == int(fused)
    assert not fused or models[0] is model.model


# ------------------------------------------------ the fused forward, on the CPU


@pytest.fixture
def launch_stood_in(monkeypatch, on_the_cpu):
    """The rule saying yes from one row, as on CUDA (stood in), and the CPU
    backend given the GPU glue's `add_rms_norm` (its checks and custom
    function) with the launch computed by MLX's ops. Yields each launch's
    rows' shape."""
    launches = []

    def by_ops(backend, shape, eps, dtype, poison, stream):
        def launched(residual, update, weight):
            launches.append(residual.shape)
            return _gpu.add_rms_norm_by_ops(residual, update, weight, eps, stream=stream)

        return launched

    gpu_glue_on_the_cpu(monkeypatch, "add_rms_norm", by_ops, module=fused_model,
                        rule="ADD_RMS_NORM_FROM_ROWS", from_rows=1)
    yield launches


@pytest.fixture(params=[False, True], ids=["attention", "fused-attention"])
def attention_fused(request):
    """The attentions' own norms and rotations (None), or theirs in one launch
    as well (`fused_attention`, its rule and launch stood in by MLX's ops as
    its own tests stand them in: the list of those launches)."""
    return request.getfixturevalue("attention_launch_stood_in") if request.param else None


def unfused_logits(model, prompt, steps: int, cache=None):
    """`decode` with the rule off (the model's own call)."""
    with pytest.MonkeyPatch.context() as off:
        off.setattr(rules, "ADD_RMS_NORM_FROM_ROWS", 1 << 30)
        return decode(model, prompt, steps, cache)


@pytest.mark.parametrize("batch, per_sequence", [(1, False), (3, False), (3, True)])
def test_fused_forward_is_the_model_op_for_op(launch_stood_in, attention_fused, batch,
                                              per_sequence):
    """Decoding steps through the fused forward give the logits of the same
    patched model without it, bit for bit: the forward is the model's and its
    layers' code but for the launches, whose stand-in computes with the same
    ops; two a layer, the last with the model's final norm; with a batch
    cache too (its mask). The prompt (rows of more than one position) keeps
    the model's own call."""
    model = make_model()
    patch_model(model)
    plain = copy.deepcopy(model)  # decoded with the rule off, its model's own call
    prompt = mx.array(np.random.default_rng(batch).integers(0, 40, (batch, 6)))
    want = unfused_logits(plain, prompt, 3, caches(plain, batch, per_sequence))
    got = decode(model, prompt, 3, caches(model, batch, per_sequence))
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()
    assert launch_stood_in == [(batch, 1, CONFIGS["qwen3_moe"]["hidden_size"])] * 2 * LAYERS * 3
    # Both models' attentions, 3 steps each, where they are fused too.
    assert attention_fused is None or len(attention_fused) == 2 * 3 * LAYERS


def test_batch_generate_through_the_fused_forward(launch_stood_in, tmp_path):
    """mlx-lm's batch generation (its batch cache, prompts of different
    lengths) gives the same texts through the fused forward as without it."""
    from mlx_lm import load

    model, tokenizer = load(str(lm_fixtures.write_model(tmp_path / "qwen3_moe", "qwen3_moe",
                                                        bits=4)))
    patch_model(model)
    prompts = [tokenizer.encode(text) for text in
               ("the router of the experts", "a token", "sum the rows of a tile")]
    got = batch_generate(model, tokenizer, prompts, max_tokens=6).texts
    assert any(shape[0] == 3 for shape in launch_stood_in)
    with pytest.MonkeyPatch.context() as off:
        off.setattr(rules, "ADD_RMS_NORM_FROM_ROWS", 1 << 30)
        _compiled.forget(model)  # the model's routes, asked anew
        want = batch_generate(model, tokenizer, prompts, max_tokens=6).texts
    assert got == want and all(want)


def float32_block(block: nn.Module) -> None:
    """Make `block`'s output float32, in place."""
    block_class = type(block)
    block.__class__ = type("Float32Block", (block_class,), {
        "__call__": lambda self, x: block_class.__call__(self, x).astype(mx.float32)})


@pytest.mark.parametrize("layer", range(LAYERS))
def test_a_block_of_another_dtype_takes_the_layers_ops(launch_stood_in, layer):
    """A MoE block whose output is float32 (on bfloat16 rows) makes the sum
    float32, as the layer's own add does, and every pair from there on the
    layer's ops, the bfloat16 norms' included: the logits of the model's own
    call, the launches only before that block's output."""
    model = make_model()
    patch_model(model)
    plain = copy.deepcopy(model)
    for each in (model, plain):
        float32_block(each.model.layers[layer].mlp)
    prompt = mx.array(np.random.default_rng(4).integers(0, 40, (2, 5)))
    got = decode(model, prompt, 2)
    want = unfused_logits(plain, prompt, 2)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and mx.array_equal(g, w).item()
    # Per step: the layers' before it, two each, and its own first.
    assert len(launch_stood_in) == (2 * layer + 1) * 2


@pytest.mark.parametrize("change", ["float32-norm", "other-layer"])
def test_the_route_keeps_the_models_call(launch_stood_in, change):
    """A norm of another dtype than the rows, or a decoder layer of other
    code than the entry's: the model's own call, no launch."""
    model = make_model()
    patch_model(model)
    if change == "float32-norm":
        norm = model.model.layers[1].post_attention_layernorm
        norm.weight = norm.weight.astype(mx.float32)
    else:
        layer = model.model.layers[0]
        layer_class = type(layer)
        layer.__class__ = type("OtherLayer", (layer_class,), {
            "__call__": lambda self, x, mask=None, cache=None:
                layer_class.__call__(self, x, mask, cache)})
    prompt = mx.array(np.random.default_rng(5).integers(0, 40, (2, 5)))
    got = decode(model, prompt, 2)
    assert launch_stood_in == []
    want = unfused_logits(model, prompt, 2)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()


def test_a_step_of_embeddings(launch_stood_in):
    """A decoding step given as embeddings (`input_embeddings`, `[B, 1, D]`)
    takes the launches as one of tokens does, the same logits as the model's
    own call."""
    model = make_model()
    patch_model(model)
    plain = copy.deepcopy(model)
    prompt = mx.array(np.random.default_rng(6).integers(0, 40, (2, 5)))
    logits = []
    for each, rule in ((plain, 1 << 30), (model, 1)):
        with pytest.MonkeyPatch.context() as rule_set:
            rule_set.setattr(rules, "ADD_RMS_NORM_FROM_ROWS", rule)
            cache = make_prompt_cache(each)
            each(prompt, cache=cache)
            step = each.model.embed_tokens(mx.array([[7], [9]]))
            logits.append(each(None, cache=cache, input_embeddings=step))
    assert mx.array_equal(*logits).item()
    assert launch_stood_in == [(2, 1, CONFIGS["qwen3_moe"]["hidden_size"])] * 2 * LAYERS


@pytest.mark.parametrize("caches_given", ["none", "fewer"])
def test_a_step_without_a_cache_a_layer_keeps_the_models_call(launch_stood_in, caches_given):
    """A one-token call without a cache, or with fewer caches than layers (the
    model's loop stops at the shorter): the model's own call, no launch."""
    model = make_model()
    patch_model(model)
    tokens = mx.array([[3], [5]])

    def caches():
        return None if caches_given == "none" else make_prompt_cache(model)[:-1]

    got = model(tokens, cache=caches())
    assert launch_stood_in == []
    with pytest.MonkeyPatch.context() as off:
        off.setattr(rules, "ADD_RMS_NORM_FROM_ROWS", 1 << 30)
        want = model(tokens, cache=caches())
    assert mx.array_equal(got, want).item()


def test_the_route_refuses_a_pipeline_rank(launch_stood_in):
    """A model split among pipeline ranks (mlx-lm's `pipeline`) keeps its own
    call, which sends and receives between the ranks."""
    model = make_model()
    patch_model(model)
    step = mx.zeros((2, 1, CONFIGS["qwen3_moe"]["hidden_size"]), mx.bfloat16)
    entry = fused_model.FUSED_MODELS["mlx_lm.models.qwen3_moe.Qwen3MoeModel"]
    assert fused_model._asked_route(model.model, step, entry) is True
    model.model.pipeline_size = 2
    assert fused_model._asked_route(model.model, step, entry) is False


# ------------------------------------------------------------- the reference


def test_add_rms_norm_reference_is_mlx_ops():
    """The reference computes what a decoder layer does with MLX's own add and
    `mx.fast.rms_norm` (on the CPU): the sums bit for bit, the norm within
    the tolerance."""
    rng = np.random.default_rng(46)
    for name, dtype in (("bfloat16", mx.bfloat16), ("float16", mx.float16)):
        residual, update = (mx.array(rng.standard_normal((6, 2048)) * 3, dtype)
                            for _ in range(2))
        weight = mx.array(rng.standard_normal(2048) + 1, dtype)
        sums = residual + update
        made = (sums, mx.fast.rms_norm(sums, weight, 1e-6))
        expected = ref.add_rms_norm(ref.to_numpy(residual), ref.to_numpy(update),
                                    ref.to_numpy(weight), 1e-6, name)
        check_add_rms_norm(made, expected, name)


# ------------------------------------------------------- the GPU glue, on the CPU


def glue_case(rng, shape=(3, 1, 96)):
    residual, update = (mx.array(rng.standard_normal(shape) * 2, mx.bfloat16) for _ in range(2))
    weight = mx.array(rng.standard_normal(shape[-1]) + 1, mx.bfloat16)
    return residual, update, weight


def test_glue_forward_and_gradient(launch_stood_in):
    """`GpuBackend.add_rms_norm`'s custom function: its outputs as the launch
    gives them, and its gradient MLX's ops'."""
    residual, update, weight = glue_case(np.random.default_rng(5))
    glue = _gpu.GpuBackend("cuda")
    stream = mx.default_stream(mx.cpu)

    def by_ops(residual, update, weight):
        return _gpu.add_rms_norm_by_ops(residual, update, weight, 1e-5)

    def through_glue(residual, update, weight):
        return glue.add_rms_norm(residual, update, weight, eps=1e-5, stream=stream)

    arrays = [residual, update, weight]
    for got, want in zip(through_glue(*arrays), by_ops(*arrays)):
        assert mx.array_equal(got, want).item() and got.shape == want.shape
    assert launch_stood_in == [residual.shape]
    cotangents = [mx.array(np.random.default_rng(6).standard_normal(o.shape), mx.bfloat16)
                  for o in by_ops(*arrays)]

    def loss(function):
        return lambda *args: sum((o * c).astype(mx.float32).sum()
                                 for o, c in zip(function(*args), cotangents))

    got = mx.grad(loss(through_glue), argnums=[0, 1, 2])(*arrays)
    want = mx.grad(loss(by_ops), argnums=[0, 1, 2])(*arrays)
    for g, w in zip(got, want):
        assert mx.abs(w).max().item() > 0
        assert mx.array_equal(g, w).item()


def test_glue_of_no_rows():
    """No rows: empty sums and norm of the rows' shape and dtype, no launch
    (none could run on this CPU stream)."""
    residual, update, weight = glue_case(np.random.default_rng(7), shape=(0, 1, 32))
    outputs = _gpu.GpuBackend("cuda").add_rms_norm(residual, update, weight, eps=1e-6,
                                                   stream=mx.default_stream(mx.cpu))
    for output in outputs:
        assert output.shape == (0, 1, 32) and output.dtype == mx.bfloat16


@pytest.mark.parametrize("change, argument", [
    (dict(residual=mx.zeros((3, 1, 96), mx.int32)), "residual"),
    (dict(residual=mx.zeros((), mx.bfloat16)), "residual"),
    (dict(update=mx.zeros((3, 1, 95), mx.bfloat16)), "update"),
    (dict(update=mx.zeros((3, 1, 96), mx.float16)), "update"),
    (dict(weight=mx.zeros((95,), mx.bfloat16)), "weight"),
    (dict(weight=mx.zeros((96,), mx.float32)), "weight"),
    (dict(weight=mx.zeros((1, 96), mx.bfloat16)), "weight"),
])
def test_glue_names_the_bad_argument(change, argument):
    residual, update, weight = glue_case(np.random.default_rng(8))
    arguments = dict(residual=residual, update=update, weight=weight)
    arguments.update(change)
    with pytest.raises(ValueError, match=f"^{argument}"):
        _gpu.GpuBackend("cuda").add_rms_norm(**arguments, eps=1e-6,
                                             stream=mx.default_stream(mx.cpu))


# ------------------------------------------------------------------ on a GPU


@on_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("shape", [(8, 1, 2048), (64, 1, 2880), (3, 1, 7), (0, 1, 64)])
def test_kernel_against_reference_and_mlx_ops(dtype, shape):
    """The launch on the GPU, and MLX's own ops there where there are rows,
    each against the reference: the sums bit for bit, the norm within the
    tolerance; a decoding step of Qwen3-30B-A3B's and gpt-oss-20b's widths, a
    row narrower than a warp, no rows."""
    rng = np.random.default_rng(9)
    residual, update = (mx.array(rng.standard_normal(shape) * 3, dtype) for _ in range(2))
    weight = mx.array(rng.standard_normal(shape[-1]) + 1, dtype)
    stream = mx.default_stream(mx.gpu)
    got = _gpu.GpuBackend(_backend.gpu_backend()).add_rms_norm(residual, update, weight,
                                                               eps=1e-6, stream=stream)
    mlx_ops = _gpu.add_rms_norm_by_ops(residual, update, weight, 1e-6, stream=stream)
    name = str(dtype).rsplit(".", 1)[-1]
    expected = ref.add_rms_norm(ref.to_numpy(residual), ref.to_numpy(update),
                                ref.to_numpy(weight), 1e-6, name)
    check_add_rms_norm(got, expected, name)
    if shape[0]:  # MLX's CUDA rms_norm fails on no rows (cudaGraphAddKernelNode: invalid argument)
        check_add_rms_norm(mlx_ops, expected, name)


@on_cuda
@pytest.mark.gpu
def test_decoding_on_the_gpu_within_rounding(monkeypatch):
    """Whole-model decoding through the launches on the GPU against the same
    patched model without them: logits within bfloat16's rounding of another
    summation order, two launches a layer."""
    model = make_model()
    patch_model(model)
    plain = copy.deepcopy(model)
    monkeypatch.setattr(rules, "ADD_RMS_NORM_FROM_ROWS", 1)
    launches = []
    glue_launched_by(monkeypatch, "add_rms_norm", recording_calls(
        _gpu._add_rms_norm_launched, lambda residual, *_: residual.shape, launches))
    prompt = mx.array(np.random.default_rng(10).integers(0, 40, (8, 6)))
    got = decode(model, prompt, 4)
    assert launches == [(8, 1, CONFIGS["qwen3_moe"]["hidden_size"])] * 2 * LAYERS * 4
    want = unfused_logits(plain, prompt, 4)
    assert_logits_close(got, want)
