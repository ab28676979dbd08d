"""The fused attention (`mlx_moe_plan.fused_attention`): Qwen3-MoE's queries
and keys normalized and rotated in one launch of kernels/head_norm_rope.h.

On the CPU the launch is stood in for by its gradient's formula, MLX's own
ops (`_gpu.head_norm_rope_by_ops`, what the kernel computes within its
rounding), so the fused forward, its reading of one GEMM's output and the
GPU glue's custom function run anywhere, bit for bit against the
attention's own call; the kernel body itself is tested on PoCL
(tests/test_kernels_pocl.py) and, on a GPU (`tests/gpu_suite.sh`, step
`head-norm`), against MLX's ops and in whole-model decoding.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from conftest import check_head_norm_rope
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (the test extra brings it)")

import lm_fixtures  # noqa: E402
from mlx_lm.generate import batch_generate  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

from mlx_moe_plan import _backend, _compiled, _gpu, fused_attention  # noqa: E402
from mlx_moe_plan import fused_blocks, projections, rules  # noqa: E402
from mlx_moe_plan import reference as ref  # noqa: E402
from mlx_moe_plan.fused_attention import FusedAttention  # noqa: E402
from mlx_moe_plan.nn import patch_model  # noqa: E402
from test_nn import CONFIGS  # noqa: E402
from test_nn import make_model as make_mlx_lm_model  # noqa: E402

# The launch runs where the rule takes it, CUDA: Metal is not measured.
on_cuda = pytest.mark.skipif(_backend.gpu_backend() != "cuda", reason="needs CUDA MLX")


def make_model(name: str = "qwen3_moe"):
    """The layer tests' mlx-lm `name` (random weights, 4 bits in groups of
    32), in bfloat16."""
    model = make_mlx_lm_model(name, quantized=True)
    model.set_dtype(mx.bfloat16)
    return model


# ------------------------------------------------------------------ the rule


def test_rule_is_off_until_measured():
    for rows in (1, 8, 64, 4096):
        assert rules.fuses_head_norm_rope(rows, cuda=True) is False
        assert rules.fuses_head_norm_rope(rows, cuda=False) is False


@pytest.mark.parametrize("rows, cuda, want", [(8, True, True), (7, True, False),
                                              (64, True, True), (64, False, False)])
def test_rule_from_its_rows_on_cuda(monkeypatch, rows, cuda, want):
    monkeypatch.setattr(rules, "HEAD_NORM_ROPE_FROM_ROWS", 8)
    assert rules.fuses_head_norm_rope(rows, cuda=cuda) is want


# ------------------------------------------------------------- the registry


@pytest.mark.parametrize("name", sorted(fused_attention.FUSED_ATTENTION))
def test_fused_attention_matches_mlx_lm(name):
    # The fused forward mirrors the class's __call__: when mlx-lm's code
    # changes, the attention silently keeps its own call. Say which, and its
    # new digest, so the forward can be checked against the new code.
    digest = fused_blocks.source_digest(fused_blocks.load_class(name).__call__)
    assert digest == fused_attention.FUSED_ATTENTION[name], (
        f"{name}.__call__ is not the code fused_attention._forward mirrors: its source digest "
        f"is now {digest!r}; compare the forward with the new code, then update "
        "FUSED_ATTENTION in mlx_moe_plan/fused_attention.py")


@pytest.mark.parametrize("name, fused", [("qwen3_moe", True), ("mixtral", False),
                                         ("gpt_oss", False)])
def test_patch_model_fuses_the_registered_attention(name, fused):
    model = make_model(name)
    patch_model(model)
    attentions = [m for _, m in model.named_modules() if isinstance(m, FusedAttention)]
    assert len(attentions) == (CONFIGS[name]["num_hidden_layers"] if fused else 0)
    unfused = make_model(name)
    patch_model(unfused, fuse=False)
    assert not any(isinstance(m, FusedAttention) for _, m in unfused.named_modules())
    # Its parameters are the attention's own: checkpoints load as before.
    assert dict(tree_flatten(model.parameters())).keys() == \
        dict(tree_flatten(make_model(name).parameters())).keys()


# ------------------------------------------------ the fused forward, on the CPU


@pytest.fixture
def launch_stood_in(monkeypatch):
    """The rule saying yes from one row, as on CUDA (stood in), and the CPU
    backend given the GPU glue's `head_norm_rope` (its checks and custom
    function) with the launch computed by MLX's ops. Yields each launch's
    first query and key columns and its offsets' shape."""
    launches = []

    def by_ops(backend, queries_in, keys_in, q_weight, k_weight, offsets, batch, *sizes):
        *sizes, stream = sizes
        launches.append((sizes[2], sizes[3], offsets.shape))
        return _gpu.head_norm_rope_by_ops(queries_in, keys_in, q_weight, k_weight, offsets,
                                          *sizes, stream=stream)

    # imported here, not above: the GPU suite runs from a tree without the C++ extension
    from mlx_moe_plan import _cpu

    gpu = _gpu.GpuBackend("cuda")
    monkeypatch.setattr(rules, "HEAD_NORM_ROPE_FROM_ROWS", 1)
    monkeypatch.setattr(fused_attention, "on_cuda", lambda stream=None: True)
    monkeypatch.setattr(_gpu, "_head_norm_rope", by_ops)
    monkeypatch.setattr(_cpu.CPU, "head_norm_rope", gpu.head_norm_rope, raising=False)
    monkeypatch.setattr(_cpu.CPU, "head_norm_rope_computes", gpu.head_norm_rope_computes,
                        raising=False)
    yield launches


@pytest.fixture(params=[False, True], ids=["apart", "joined"])
def joined(request, monkeypatch):
    """The queries', keys' and values' projections apart, or one GEMM
    (`projections.Siblings`, their rule and CUDA stood in)."""
    if request.param:
        monkeypatch.setattr(projections, "on_cuda", lambda stream=None: True)
        monkeypatch.setattr(projections, "dense_joins_siblings", lambda *args, **kwargs: True)
    return request.param


def decode(model, prompt, steps: int, cache=None):
    """The logits of a prompt's last position and of `steps` greedy steps."""
    cache = make_prompt_cache(model) if cache is None else cache
    logits = [model(prompt, cache=cache)[:, -1:]]
    for _ in range(steps):
        logits.append(model(mx.argmax(logits[-1], axis=-1), cache=cache))
    mx.eval(logits)
    return logits


def caches(model, batch: int, per_sequence: bool) -> list:
    """mlx-lm's caches of one offset (`KVCache`), or of an offset a sequence
    (`BatchKVCache`, as its batch generation makes them: prompts left-padded
    to the longest, sequence b by b positions)."""
    if not per_sequence:
        return make_prompt_cache(model)
    return [BatchKVCache(left_padding=list(range(batch))) for _ in model.layers]


@pytest.mark.parametrize("batch, per_sequence", [(1, False), (3, False), (3, True)])
def test_fused_forward_is_the_attention_op_for_op(launch_stood_in, joined, batch,
                                                  per_sequence):
    """Decoding steps through the fused forward give the logits of the same
    patched model without it, bit for bit: the forward is the attention's
    code but for the launch, whose stand-in computes with the same ops. With
    the projections one GEMM it reads their output whole, the keys after
    the queries; the prompt (rows of more than one position) keeps the
    attention's own call; a batch cache's offsets are a sequence's each."""
    model = make_model()
    patch_model(model)
    plain = copy.deepcopy(model)  # a copy computes alone: its attention's rule says no
    prompt = mx.array(np.random.default_rng(batch).integers(0, 40, (batch, 6)))
    with pytest.MonkeyPatch.context() as off:
        off.setattr(rules, "HEAD_NORM_ROPE_FROM_ROWS", 1 << 30)
        want = decode(plain, prompt, 3, caches(plain, batch, per_sequence))
    got = decode(model, prompt, 3, caches(model, batch, per_sequence))
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()
    q_columns = CONFIGS["qwen3_moe"]["num_attention_heads"] * CONFIGS["qwen3_moe"]["head_dim"]
    layers = CONFIGS["qwen3_moe"]["num_hidden_layers"]
    offsets = (batch,) if per_sequence else (1,)
    assert launch_stood_in == [(0, q_columns if joined else 0, offsets)] * 3 * layers


def test_batch_generate_through_the_fused_forward(launch_stood_in, joined, tmp_path):
    """mlx-lm's batch generation (its batch cache: an offset a sequence,
    prompts of different lengths) gives the same texts through the fused
    forward as without it."""
    from mlx_lm import load

    model, tokenizer = load(str(lm_fixtures.write_model(tmp_path / "qwen3_moe", "qwen3_moe",
                                                        bits=4)))
    patch_model(model)
    prompts = [tokenizer.encode(text) for text in
               ("the router of the experts", "a token", "sum the rows of a tile")]
    got = batch_generate(model, tokenizer, prompts, max_tokens=6).texts
    assert any(offsets == (3,) for *_, offsets in launch_stood_in)
    with pytest.MonkeyPatch.context() as off:
        off.setattr(rules, "HEAD_NORM_ROPE_FROM_ROWS", 1 << 30)
        _compiled.forget(model)  # the attentions' routes, asked anew
        want = batch_generate(model, tokenizer, prompts, max_tokens=6).texts
    assert got == want and all(want)


def test_projections_of_another_dtype_keep_the_attentions_call(launch_stood_in):
    """Projections whose output is not the norms' dtype (float32 scales on
    bfloat16 rows) make the fused attention call its own code: no launch,
    the same logits."""
    model = make_model()
    patch_model(model)
    for layer in model.layers:
        for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            projection.scales = projection.scales.astype(mx.float32)
    plain = copy.deepcopy(model)
    prompt = mx.array(np.random.default_rng(4).integers(0, 40, (2, 5)))
    got = decode(model, prompt, 2)
    assert launch_stood_in == []
    with pytest.MonkeyPatch.context() as off:
        off.setattr(rules, "HEAD_NORM_ROPE_FROM_ROWS", 1 << 30)
        want = decode(plain, prompt, 2)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()


# ------------------------------------------------------------- the reference


def test_head_norm_rope_reference_is_mlx_ops():
    """The reference computes what Qwen3's attention does with MLX's own
    `mx.fast.rms_norm` and `mx.fast.rope` (on the CPU), within the tolerance."""
    rng = np.random.default_rng(44)
    batch, length, q_heads, k_heads, head_dim = 3, 2, 4, 2, 64
    x = rng.standard_normal((batch, length, (q_heads + 2 * k_heads) * head_dim)) * 3
    weights = rng.standard_normal((2, head_dim)) + 1
    offsets = np.array([7, 300, 4000], np.int32)
    x_mx, w_mx = mx.array(x, mx.bfloat16), mx.array(weights, mx.bfloat16)
    made = []
    for at, heads, weight in ((0, q_heads, w_mx[0]), (q_heads * head_dim, k_heads, w_mx[1])):
        part = x_mx[..., at:at + heads * head_dim].reshape(batch, length, heads, head_dim)
        normed = mx.fast.rms_norm(part, weight, 1e-6).transpose(0, 2, 1, 3)
        made.append(ref.to_numpy(mx.fast.rope(normed, head_dim, traditional=False, base=1e6,
                                               scale=1.0, offset=mx.array(offsets))))
    stored = ref.to_numpy(x_mx)
    expected = ref.head_norm_rope(stored, stored, ref.to_numpy(w_mx[0]), ref.to_numpy(w_mx[1]),
                                  offsets, q_heads, k_heads, 0, q_heads * head_dim, 1e-6, 1e6,
                                  1.0, "bfloat16")
    positions = offsets[:, None] + np.arange(length)
    check_head_norm_rope(made, expected, positions, "bfloat16", 1.0)


# ------------------------------------------------------- the GPU glue, on the CPU


def glue_case(rng, joined: bool):
    batch, length, q_heads, k_heads, head_dim = 3, 2, 4, 2, 16
    q_columns, k_columns = q_heads * head_dim, k_heads * head_dim
    width = q_columns + 2 * k_columns
    queries_in = mx.array(rng.standard_normal((batch, length, width)), mx.bfloat16)
    keys_in = queries_in if joined else \
        mx.array(rng.standard_normal((batch, length, k_columns + 5)), mx.bfloat16)
    weights = [mx.array(rng.standard_normal(head_dim) + 1, mx.bfloat16) for _ in range(2)]
    offsets = mx.array([4, 90, 1500], mx.int32)
    sizes = dict(batch=batch, q_heads=q_heads, k_heads=k_heads, q_at=0,
                 k_at=q_columns if joined else 5, eps=1e-6, base=1e6, scale=1.0)
    return queries_in, keys_in, weights, offsets, sizes


@pytest.mark.parametrize("joined", [False, True], ids=["apart", "joined"])
def test_glue_forward_and_gradient(launch_stood_in, joined):
    """`GpuBackend.head_norm_rope`'s custom function: its outputs as the
    launch gives them, and its gradient MLX's ops' (one array for the queries
    and keys gets the sum of both parts' gradients)."""
    queries_in, keys_in, (q_weight, k_weight), offsets, sizes = glue_case(
        np.random.default_rng(5), joined)
    glue = _gpu.GpuBackend("cuda")
    order = ("q_heads", "k_heads", "q_at", "k_at", "eps", "base", "scale")

    def by_ops(queries_in, keys_in, q_weight, k_weight):
        return _gpu.head_norm_rope_by_ops(queries_in, keys_in, q_weight, k_weight, offsets,
                                          *(sizes[key] for key in order))

    def through_glue(queries_in, keys_in, q_weight, k_weight):
        return glue.head_norm_rope(queries_in, keys_in, q_weight, k_weight, offsets,
                                   stream=mx.default_stream(mx.cpu), **sizes)

    arrays = [queries_in, keys_in, q_weight, k_weight]
    for got, want in zip(through_glue(*arrays), by_ops(*arrays)):
        assert mx.array_equal(got, want).item() and got.shape == want.shape
    cotangents = [mx.array(np.random.default_rng(6).standard_normal(o.shape), mx.bfloat16)
                  for o in by_ops(*arrays)]

    def loss(function):
        if joined:  # one array for both, as the fused forward passes it
            return lambda x, q_weight, k_weight: sum(
                (o * c).astype(mx.float32).sum()
                for o, c in zip(function(x, x, q_weight, k_weight), cotangents))
        return lambda *args: sum((o * c).astype(mx.float32).sum()
                                 for o, c in zip(function(*args), cotangents))

    inputs = [queries_in, q_weight, k_weight] if joined else arrays
    argnums = list(range(len(inputs)))
    got = mx.grad(loss(through_glue), argnums=argnums)(*inputs)
    want = mx.grad(loss(by_ops), argnums=argnums)(*inputs)
    for g, w in zip(got, want):
        assert mx.abs(w).max().item() > 0
        assert mx.array_equal(g, w).item()


@pytest.mark.parametrize("change, argument", [
    (dict(queries_in=mx.zeros((3, 2, 10), mx.bfloat16)), "queries_in"),
    (dict(keys_in=mx.zeros((3, 2, 64), mx.float16)), "keys_in"),
    (dict(k_at=60), "keys_in"),
    (dict(q_weight=mx.zeros((8,), mx.bfloat16)), "k_weight"),
    (dict(q_weight=mx.zeros((15,), mx.bfloat16)), "q_weight"),
    (dict(q_weight=mx.zeros((2, 16), mx.bfloat16)), "q_weight"),
    (dict(keys_in=mx.zeros((3, 64), mx.bfloat16)), "keys_in"),
    (dict(k_weight=mx.zeros((16,), mx.float32)), "k_weight"),
    (dict(offsets=mx.zeros((2,), mx.int32)), "offsets"),
    (dict(offsets=mx.zeros((3,), mx.float32)), "offsets"),
    (dict(q_heads=0), "q_heads"),
])
def test_glue_names_the_bad_argument(change, argument):
    queries_in, keys_in, (q_weight, k_weight), offsets, sizes = glue_case(
        np.random.default_rng(7), joined=False)
    arguments = dict(queries_in=queries_in, keys_in=keys_in, q_weight=q_weight,
                     k_weight=k_weight, offsets=offsets, **sizes)
    arguments.update(change)
    with pytest.raises(ValueError, match=f"^{argument}"):
        _gpu.GpuBackend("cuda").head_norm_rope(**arguments, stream=mx.default_stream(mx.cpu))


# ------------------------------------------------------------------ on a GPU


@on_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("joined", [False, True], ids=["apart", "joined"])
def test_kernel_against_reference_and_mlx_ops(dtype, joined):
    """The launch on the GPU, and MLX's own ops there, each within the
    tolerance of the reference: Qwen3-30B-A3B's heads at batch 8."""
    rng = np.random.default_rng(8)
    batch, q_heads, k_heads, head_dim = 8, 32, 4, 128
    width = (q_heads + 2 * k_heads) * head_dim
    queries_in = mx.array(rng.standard_normal((batch, 1, width)) * 3, dtype)
    keys_in = queries_in if joined else mx.array(
        rng.standard_normal((batch, 1, k_heads * head_dim)) * 3, dtype)
    weights = [mx.array(rng.standard_normal(head_dim) + 1, dtype) for _ in range(2)]
    offsets = mx.array(rng.integers(0, 5000, batch), mx.int32)
    sizes = (q_heads, k_heads, 0, q_heads * head_dim if joined else 0, 1e-6, 1e6, 1.0)
    stream = mx.default_stream(mx.gpu)
    got = _gpu.GpuBackend(_backend.gpu_backend()).head_norm_rope(
        queries_in, keys_in, *weights, offsets, batch=batch, q_heads=sizes[0],
        k_heads=sizes[1], q_at=sizes[2], k_at=sizes[3], eps=sizes[4], base=sizes[5],
        scale=sizes[6], stream=stream)
    mlx_ops = _gpu.head_norm_rope_by_ops(queries_in, keys_in, *weights, offsets, *sizes,
                                         stream=stream)
    name = str(dtype).rsplit(".", 1)[-1]
    expected = ref.head_norm_rope(ref.to_numpy(queries_in), ref.to_numpy(keys_in),
                                  *(ref.to_numpy(w) for w in weights), np.array(offsets),
                                  *sizes, name)
    positions = np.array(offsets)[:, None]
    check_head_norm_rope([ref.to_numpy(a) for a in got], expected, positions, name, 1.0)
    check_head_norm_rope([ref.to_numpy(a) for a in mlx_ops], expected, positions, name, 1.0)


@on_cuda
@pytest.mark.gpu
def test_decoding_on_the_gpu_within_rounding(monkeypatch):
    """Whole-model decoding through the launch on the GPU (the projections
    one GEMM, as a patched model's on CUDA from 8 rows) against the same
    patched model without it: logits within bfloat16's rounding of another
    summation order, the same greedy tokens."""
    model = make_model()
    patch_model(model)
    plain = copy.deepcopy(model)
    monkeypatch.setattr(rules, "HEAD_NORM_ROPE_FROM_ROWS", 1)
    monkeypatch.setattr(rules, "SIBLINGS_FROM_ROWS", 1)
    launches = []
    launched = _gpu._head_norm_rope

    def counted(backend, queries_in, keys_in, *args):
        launches.append(keys_in.shape[-1])
        return launched(backend, queries_in, keys_in, *args)

    monkeypatch.setattr(_gpu, "_head_norm_rope", counted)
    prompt = mx.array(np.random.default_rng(9).integers(0, 40, (8, 6)))
    got = decode(model, prompt, 4)
    config = CONFIGS["qwen3_moe"]
    joined_width = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) \
        * config["head_dim"]
    assert launches == [joined_width] * 4 * config["num_hidden_layers"]
    with pytest.MonkeyPatch.context() as off:
        off.setattr(rules, "HEAD_NORM_ROPE_FROM_ROWS", 1 << 30)
        want = decode(plain, prompt, 4)
    for g, w in zip(got, want):
        g, w = np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32))
        np.testing.assert_allclose(g, w, rtol=2 ** -6, atol=2 ** -6 * np.abs(w).max())
