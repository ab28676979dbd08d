"""The fused attention (`mlx_moe_plan.fused_attention`): Qwen3-MoE's queries
and keys normalized and rotated in one launch of kernels/head_norm_rope.h,
and Qwen3-MoE's and gpt-oss's decoding attention in the backend's
`decode_attention` (kernels/decode_attention.h).

On the CPU each launch is stood in for by its gradient's formula, MLX's own
ops (`_gpu.head_norm_rope_by_ops`, `_gpu.decode_attention_by_ops`: what the
kernels compute within their rounding), so the fused forwards, their
reading of one GEMM's output and the GPU glue's custom function run
anywhere, bit for bit against the attention's own call; the head norm's
kernel body itself is tested on PoCL (tests/test_kernels_pocl.py) and, on a
GPU (`tests/gpu_suite.sh`, step `head-norm`), against MLX's ops and in
whole-model decoding, as the attention's launch is in whole-model decoding.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import (assert_logits_close, check_decode_attention, check_head_norm_rope,
                      decode_attention_by_ops_launched, glue_launched_by, gpu_glue_on_the_cpu,
                      recording_calls)
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (the test extra brings it)")

import lm_fixtures  # noqa: E402
from mlx_lm.generate import batch_generate  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlx_moe_plan import _backend, _compiled, _gpu, fused_attention  # noqa: E402
from mlx_moe_plan import fused_blocks, projections, rules  # noqa: E402
from mlx_moe_plan import reference as ref  # noqa: E402
from mlx_moe_plan.fused_attention import FusedAttention  # noqa: E402
from mlx_moe_plan.nn import patch_model  # noqa: E402
from test_nn import CONFIGS  # noqa: E402
from test_nn import make_model as make_mlx_lm_model  # noqa: E402

# The launches run where the rules take them, CUDA: Metal is not measured.
on_cuda = pytest.mark.skipif(_backend.gpu_backend() != "cuda", reason="needs CUDA MLX")

# The attentions of `FUSED_ATTENTION`, by their models' names.
FUSED_MODELS = ["qwen3_moe", "gpt_oss"]

# Those models with heads the attention's kernel takes, Qwen3-30B-A3B's and
# gpt-oss-20b's (the layer tests' heads of 16 values it does not).
KERNEL_HEADS = [
    ("qwen3_moe", dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128)),
    ("gpt_oss", dict(num_attention_heads=64, num_key_value_heads=8, head_dim=64)),
]


def make_model(name: str = "qwen3_moe", **sizes):
    """The layer tests' mlx-lm `name` (random weights, 4 bits in groups of
    32), in bfloat16; `sizes` change its config's."""
    with pytest.MonkeyPatch.context() as config:
        config.setitem(CONFIGS, name, dict(CONFIGS[name], **sizes))
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


def test_attention_rule_as_measured():
    """On CUDA from 8 sequences, with a mask from 32; elsewhere never."""
    for rows in (1, 4, 7, 8, 16, 31, 32, 64, 4096):
        assert rules.decodes_attention(rows, cuda=True) is (rows >= 8)
        assert rules.decodes_attention(rows, cuda=True, masked=True) is (rows >= 32)
        assert rules.decodes_attention(rows, cuda=False) is False
        assert rules.decodes_attention(rows, cuda=False, masked=True) is False


@pytest.mark.parametrize("rows, cuda, want", [(2, True, True), (1, True, False),
                                              (64, False, False)])
def test_attention_rule_from_its_rows(monkeypatch, rows, cuda, want):
    monkeypatch.setattr(rules, "DECODE_ATTENTION_FROM_ROWS", 2)
    assert rules.decodes_attention(rows, cuda=cuda) is want


# ------------------------------------------------------------- the registry


@pytest.mark.parametrize("name", sorted(fused_attention.FUSED_ATTENTION))
def test_fused_attention_matches_mlx_lm(name):
    # The fused forward mirrors the class's __call__: when mlx-lm's code
    # changes, the attention silently keeps its own call. Say which, and its
    # new digest, so the forward can be checked against the new code.
    digest = fused_blocks.source_digest(fused_blocks.load_class(name).__call__)
    entry = fused_attention.FUSED_ATTENTION[name]
    assert digest == entry.digest, (
        f"{name}.__call__ is not the code fused_attention.{entry.forward.__name__} mirrors: "
        f"its source digest is now {digest!r}; compare the forward with the new code, then "
        "update FUSED_ATTENTION in mlx_moe_plan/fused_attention.py")


def test_each_registered_attention_is_tested():
    tested = {fused_blocks.qualified_name(type(make_model(name).model.layers[0].self_attn))
              for name in FUSED_MODELS}
    assert tested == set(fused_attention.FUSED_ATTENTION)


def patched_fused(name: str, fused_type: type) -> tuple[nn.Module, list[nn.Module]]:
    """The layer tests' `name` patched, and the modules of type `fused_type`
    that `patch_model` swapped into it; checked to keep the model's
    parameters (checkpoints load as before), and that `fuse=False` swaps in
    none of them."""
    model = make_model(name)
    patch_model(model)
    unfused = make_model(name)
    patch_model(unfused, fuse=False)
    assert not any(isinstance(m, fused_type) for _, m in unfused.named_modules())
    assert dict(tree_flatten(model.parameters())).keys() == \
        dict(tree_flatten(make_model(name).parameters())).keys()
    return model, [m for _, m in model.named_modules() if isinstance(m, fused_type)]


@pytest.mark.parametrize("name, fused", [("qwen3_moe", True), ("mixtral", False),
                                         ("gpt_oss", True)])
def test_patch_model_fuses_the_registered_attention(name, fused):
    _, attentions = patched_fused(name, FusedAttention)
    assert len(attentions) == (CONFIGS[name]["num_hidden_layers"] if fused else 0)


# ------------------------------------------------ the fused forward, on the CPU


@pytest.fixture
def launch_stood_in(monkeypatch, on_the_cpu):
    """The rule saying yes from one row, as on CUDA (stood in), and the CPU
    backend given the GPU glue's `head_norm_rope` (its checks and custom
    function) with the launch computed by MLX's ops. Yields each launch's
    first query and key columns and its offsets' shape."""
    launches = []

    def by_ops(backend, batch, length, q_heads, k_heads, head_dim, q_row, q_at, k_row, k_at,
               per_sequence, eps, base, scale, dtype, poison, stream):
        sizes = (q_heads, k_heads, q_at, k_at, eps, base, scale)

        def launched(queries_in, keys_in, q_weight, k_weight, offsets):
            launches.append((q_at, k_at, offsets.shape))
            return _gpu.head_norm_rope_by_ops(queries_in, keys_in, q_weight, k_weight, offsets,
                                              *sizes, stream=stream)

        return launched

    gpu_glue_on_the_cpu(monkeypatch, "head_norm_rope", by_ops, module=fused_attention,
                        rule="HEAD_NORM_ROPE_FROM_ROWS", from_rows=1)
    yield launches


@pytest.fixture(params=[False, True], ids=["apart", "joined"])
def joined(request, monkeypatch):
    """The queries', keys' and values' projections apart, or one GEMM
    (`projections.Siblings`, their rule and CUDA stood in)."""
    if request.param:
        monkeypatch.setattr(projections, "on_cuda", lambda stream=None: True)
        monkeypatch.setattr(projections, "dense_joins_siblings", lambda *args, **kwargs: True)
        monkeypatch.setattr(projections, "dense_from_rows", lambda out_dims: 1)
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


@pytest.mark.parametrize("quantized", [True, False])
def test_fused_forward_of_projections_left_as_they_are(launch_stood_in, quantized):
    """Projections the patch leaves as mlx-lm made them (`dense_rows=False`
    and `dense=False`, or a model not quantized): the fused forward calls
    them as they are, the logits those of the same patched model without the
    launch, bit for bit."""
    model = make_mlx_lm_model("qwen3_moe", quantized=quantized)
    if quantized:  # MLX's CPU gathers only float32 matrices
        model.set_dtype(mx.bfloat16)
    patch_model(model, dense_rows=False, dense=False)
    assert not isinstance(model.layers[0].self_attn.q_proj, projections.RowsProjection)
    plain = copy.deepcopy(model)
    prompt = mx.array(np.random.default_rng(5).integers(0, 40, (3, 6)))
    with pytest.MonkeyPatch.context() as off:
        off.setattr(rules, "HEAD_NORM_ROPE_FROM_ROWS", 1 << 30)
        want = decode(plain, prompt, 3)
    got = decode(model, prompt, 3)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()
    assert len(launch_stood_in) == 3 * CONFIGS["qwen3_moe"]["num_hidden_layers"]


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


@pytest.fixture
def attention_stood_in(monkeypatch, on_the_cpu):
    """The attention's rule saying yes as on CUDA (stood in) from 4
    sequences, with a mask or without, and the CPU backend given a decoding
    step's attention computed by MLX's own
    (`_gpu.decode_attention_by_ops`). Yields each call's queries' shape,
    keys' count and whether it had sinks (`calls`), and the sizes the backend
    was asked about (`asked`)."""
    stood_in = SimpleNamespace(calls=[], asked=[], masks=[])

    def by_ops(queries, keys, values, sinks, *, scale, stream, mask=None):
        stood_in.calls.append((queries.shape, keys.shape[2], sinks is not None))
        stood_in.masks.append(None if mask is None else mask.shape)
        return _gpu.decode_attention_by_ops(queries, keys, values, sinks, mask, scale,
                                            stream=stream)

    def computes(**sizes):
        stood_in.asked.append(sizes)
        return True

    # imported here, not above: the GPU suite runs from a tree without the C++ extension
    from mlx_moe_plan import _cpu

    monkeypatch.setattr(rules, "DECODE_ATTENTION_FROM_ROWS", 4)
    monkeypatch.setattr(rules, "DECODE_ATTENTION_MASKED_FROM_ROWS", 4)
    monkeypatch.setattr(fused_attention, "on_cuda", lambda stream=None: True)
    monkeypatch.setattr(_cpu.CPU, "decode_attention", by_ops, raising=False)
    monkeypatch.setattr(_cpu.CPU, "decode_attention_computes", computes, raising=False)
    yield stood_in


@pytest.fixture
def mirrored(monkeypatch):
    """Whether each call of a fused attention's `_forward` gave its output (a
    False: the attention's own call ran after it)."""
    gave = []
    forward = fused_attention._forward

    def recorded(*args):
        y = forward(*args)
        gave.append(y is not None)
        return y

    monkeypatch.setattr(fused_attention, "_forward", recorded)
    return gave


@contextlib.contextmanager
def launches_off():
    """Neither launch's rule saying yes, inside."""
    with pytest.MonkeyPatch.context() as off:
        off.setattr(rules, "HEAD_NORM_ROPE_FROM_ROWS", 1 << 30)
        off.setattr(rules, "DECODE_ATTENTION_FROM_ROWS", 1 << 30)
        off.setattr(rules, "DECODE_ATTENTION_MASKED_FROM_ROWS", 1 << 30)
        yield


def keys_counts(name: str, prompt_length: int, steps: int) -> list[int]:
    """The keys each layer attends to at each decoding step, in call order:
    a sliding layer of gpt-oss (its cache as long as the window) no more
    than the window."""
    config = CONFIGS[name]
    window = config.get("sliding_window")
    layer_types = config.get("layer_types", ["full_attention"] * config["num_hidden_layers"])
    return [min(prompt_length + step, window) if kind == "sliding_attention"
            else prompt_length + step
            for step in range(1, steps + 1) for kind in layer_types]


def assert_decodes_as_without_launches(model, batch: int, steps: int, seed: int) -> None:
    """`model`, patched, decoding `steps` steps of `batch` sequences after a
    random prompt of 6 tokens: its logits bit for bit those of a copy whose
    launches' rules say no (a copy computes alone)."""
    patch_model(model)
    plain = copy.deepcopy(model)
    prompt = mx.array(np.random.default_rng(seed).integers(0, 40, (batch, 6)))
    got = decode(model, prompt, steps)
    with launches_off():
        want = decode(plain, prompt, steps)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()


@pytest.mark.parametrize("batch", [4, 8])
@pytest.mark.parametrize("name", FUSED_MODELS)
def test_decoding_attends_by_the_launch_bit_for_bit(attention_stood_in, name, batch):
    """Decoding steps of 4 sequences or more attend by the backend's launch,
    once a layer a step, its stand-in computing with MLX's attention: the
    logits of the same patched model without it, bit for bit. The prompt
    (rows of more than one position) keeps mlx-lm's attention; the launch
    reads the cache's keys as its update gives them, gpt-oss's sliding
    layer's past the window's end too (its buffer rotated, no mask), and
    gets gpt-oss's sinks."""
    assert_decodes_as_without_launches(make_model(name), batch, 4, seed=batch)
    config = CONFIGS[name]
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    assert attention_stood_in.calls == [((batch, heads, 1, head_dim), keys, name == "gpt_oss")
                                        for keys in keys_counts(name, 6, 4)]
    assert attention_stood_in.asked == [dict(head_dim=head_dim, heads=heads,
                                             kv_heads=config["num_key_value_heads"],
                                             dtype=mx.bfloat16)] * config["num_hidden_layers"]


def test_both_launches_bit_for_bit(launch_stood_in, attention_stood_in, joined):
    """Qwen3-MoE's decoding steps with both launches, its queries' and keys'
    norms and rotations and its attention: the logits of the same patched
    model without them, bit for bit."""
    assert_decodes_as_without_launches(make_model(), 4, 3, seed=10)
    config = CONFIGS["qwen3_moe"]
    q_columns = config["num_attention_heads"] * config["head_dim"]
    layers = config["num_hidden_layers"]
    assert launch_stood_in == [(0, q_columns if joined else 0, (1,))] * 3 * layers
    assert len(attention_stood_in.calls) == 3 * layers


@pytest.mark.parametrize("name, sizes", KERNEL_HEADS)
def test_decoding_through_the_glue_bit_for_bit(monkeypatch, on_the_cpu, name, sizes):
    """The GPU glue's `decode_attention` (its checks and custom function), its
    launches computed by MLX's attention, in decoding steps of heads the
    kernel takes: the fused forwards hand it arrays it accepts (a cache's
    slice; gpt-oss's rotated buffer and sinks), and the logits are the same
    patched model's without it, bit for bit."""
    launches = []

    counted = recording_calls(decode_attention_by_ops_launched,
                              lambda queries, keys, *_: keys.shape[2], launches)
    gpu_glue_on_the_cpu(monkeypatch, "decode_attention", counted, module=fused_attention,
                        rule="DECODE_ATTENTION_FROM_ROWS", from_rows=4)
    assert_decodes_as_without_launches(make_model(name, **sizes), 4, 4, seed=13)
    assert launches == keys_counts(name, 6, 4)


@pytest.mark.parametrize("case", ["quantized cache", "few rows", "prompt"])
def test_attention_launch_refused(attention_stood_in, mirrored, case):
    """No launch where mlx-lm's attention attends over a quantized cache (its
    own attention of quantized keys), for fewer sequences than the rule's,
    or for a prompt: the attention's own call runs (the mirrored forward
    gives nothing), and the logits are the same patched model's without it."""
    batch, steps = (3, 2) if case == "few rows" else (4, 0 if case == "prompt" else 2)
    # Heads of 32: mlx-lm's quantized cache quantizes them in groups of 32.
    model = make_model(**(dict(head_dim=32) if case == "quantized cache" else {}))
    patch_model(model)
    plain = copy.deepcopy(model)

    def cache_of(model):
        if case == "quantized cache":
            return [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]
        return make_prompt_cache(model)

    prompt = mx.array(np.random.default_rng(11).integers(0, 40, (batch, 6)))
    got = decode(model, prompt, steps, cache_of(model))
    with launches_off():
        want = decode(plain, prompt, steps, cache_of(plain))
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()
    assert attention_stood_in.calls == []
    # The rules' rows say no before the forward is asked; the quantized cache
    # once it is.
    asked = 2 * CONFIGS["qwen3_moe"]["num_hidden_layers"] if case == "quantized cache" else 0
    assert mirrored == [False] * asked


def attention_and_its_own_call(mask_of, seed: int) -> tuple[mx.array, mx.array]:
    """A patched Qwen3-MoE attention's decoding step of 4 sequences over 5
    cached keys, with the mask `mask_of(rng)` makes, beside the same step by
    the attention's own call (its class's before the patch), on a cache alike."""
    model = make_model()
    patch_model(model)
    attention = model.layers[0].self_attn
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((4, 1, CONFIGS["qwen3_moe"]["hidden_size"])), mx.bfloat16)
    keys = mx.array(rng.standard_normal((4, attention.n_kv_heads, 5, 16)), mx.bfloat16)
    caches_made = make_prompt_cache(model)[:2]
    for cache in caches_made:
        cache.update_and_fetch(keys, keys)
    mask = mask_of(rng)
    got = attention(x, mask=mask, cache=caches_made[0])
    own_call = type(attention).__mro__[1].__call__
    return got, own_call(attention, x, mask=mask, cache=caches_made[1])


def test_attention_launch_refuses_an_additive_mask(attention_stood_in):
    """A mask the launch does not take (additive) keeps mlx-lm's attention:
    the same bits as the attention's own call, no launch."""
    got, want = attention_and_its_own_call(
        lambda rng: mx.array(rng.standard_normal((4, 1, 1, 6)), mx.bfloat16), seed=17)
    assert attention_stood_in.calls == []
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("from_rows, masked_from_rows, launched",
                         [(4, 4, True), (4, 5, False), (5, 4, True)])
def test_masked_step_launches_from_the_rules_rows(attention_stood_in, mirrored, monkeypatch,
                                                  from_rows, masked_from_rows, launched):
    """A step with a boolean mask takes the launch from the rule's masked
    rows, not its unmasked ones, fewer or more: below them the attention's
    own call runs, the fused forward not even asked, and no launch; either
    way the bits of the attention's own call (the launch's stand-in computes
    with MLX's attention)."""
    monkeypatch.setattr(rules, "DECODE_ATTENTION_FROM_ROWS", from_rows)
    monkeypatch.setattr(rules, "DECODE_ATTENTION_MASKED_FROM_ROWS", masked_from_rows)
    # every sequence keeps its newest key, as a batch cache's left padding does
    got, want = attention_and_its_own_call(
        lambda rng: mx.array((rng.random((4, 1, 1, 6)) < 0.7) | np.eye(1, 6, 5, dtype=bool)),
        seed=19)
    assert attention_stood_in.masks == ([(4, 1, 1, 6)] if launched else [])
    assert mirrored == ([True] if launched else [])
    assert mx.array_equal(got, want).item()


def test_batch_generate_with_the_attention_launch(attention_stood_in, mirrored, tmp_path):
    """mlx-lm's batch generation, four sequences: its batch cache masks the
    left-padded prompts with a boolean mask a sequence, which the launch
    takes (once a layer a decoding step), and the texts are those without
    it."""
    from mlx_lm import load

    model, tokenizer = load(str(lm_fixtures.write_model(tmp_path / "qwen3_moe", "qwen3_moe",
                                                        bits=4)))
    patch_model(model)
    prompts = [tokenizer.encode(text) for text in
               ("the router of the experts", "a token", "sum the rows of a tile", "one")]
    got = batch_generate(model, tokenizer, prompts, max_tokens=6).texts
    assert mirrored and all(mirrored) and attention_stood_in.calls
    assert all(shape is not None and shape[0] == 4 and shape[1:3] == (1, 1)
               for shape in attention_stood_in.masks)
    with launches_off():
        _compiled.forget(model)  # the attentions' routes, asked anew
        want = batch_generate(model, tokenizer, prompts, max_tokens=6).texts
    assert got == want and all(want)


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


def decode_attention_case(rng, batch, heads, kv_heads, head_dim, keys, sinks, dtype):
    """Queries, the first `keys` keys and values of a cache's longer buffer
    (as mlx-lm hands them over), sinks or None."""
    def normal(shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32), dtype)

    length = -(-(keys + 1) // 256) * 256
    key_buffer, value_buffer = (normal((batch, kv_heads, length, head_dim)) for _ in range(2))
    return (normal((batch, heads, 1, head_dim)), key_buffer[:, :, :keys],
            value_buffer[:, :, :keys], normal((heads,)) if sinks else None)


@pytest.mark.parametrize("change, argument", [
    (dict(queries=mx.zeros((2, 8, 2, 64), mx.bfloat16)), "queries"),
    (dict(queries=mx.zeros((2, 8, 1, 32), mx.bfloat16)), "keys"),
    (dict(queries=mx.zeros((2, 8, 1, 64), mx.float32)), "queries"),
    (dict(queries=mx.zeros((2, 5, 1, 64), mx.bfloat16)), "queries"),
    (dict(keys=mx.zeros((2, 2, 0, 64), mx.bfloat16)), "keys"),
    (dict(keys=mx.zeros((2, 2, 5, 64), mx.float16)), "keys"),
    (dict(values=mx.zeros((2, 2, 4, 64), mx.bfloat16)), "values"),
    (dict(sinks=mx.zeros((4,), mx.bfloat16)), "sinks"),
    (dict(sinks=mx.zeros((8,), mx.float32)), "sinks"),
    (dict(mask=mx.ones((2, 1, 1, 4), mx.bool_)), "mask"),
    (dict(mask=mx.ones((2, 3, 1, 5), mx.bool_)), "mask"),
    (dict(mask=mx.zeros((2, 1, 1, 5), mx.float16)), "mask"),
])
def test_decode_attention_glue_names_the_bad_argument(change, argument):
    queries, keys, values, sinks = decode_attention_case(
        np.random.default_rng(3), 2, 8, 2, 64, 5, True, mx.bfloat16)
    arguments = dict(queries=queries, keys=keys, values=values, sinks=sinks)
    arguments.update(change)
    with pytest.raises(ValueError, match=f"^{argument}"):
        _gpu.GpuBackend("cuda").decode_attention(**arguments, scale=0.125,
                                                 stream=mx.default_stream(mx.cpu))


@pytest.mark.parametrize("sequences", [1, 3, 4, 16, 33, 256, 600])
def test_decode_attention_splits_fill_the_groups_none_empty(sequences):
    """The keys' splits the glue takes, at every fifth count of keys to 40
    steps past the most splits: at most the groups' (`DECODE_ATTENTION_GROUPS`
    over the sequences' key-value heads, rounded up), all of them at a
    multiple of that many steps, one a step below it, and none empty as
    decode_attention.h splits the keys (whole steps, the same count in each,
    the last split the rest)."""
    from mlx_moe_plan.kernels import launch

    most_splits = max(1, -(-launch.DECODE_ATTENTION_GROUPS // sequences))
    assert launch.decode_attention_most_splits(sequences, 1) == most_splits
    for keys in range(1, (most_splits + 40) * launch.DECODE_ATTENTION_STEP + 1, 5):
        splits = launch.decode_attention_splits(sequences, 1, keys)
        steps = -(-keys // launch.DECODE_ATTENTION_STEP)
        steps_a_split = -(-steps // splits)  # as the body takes them
        assert 1 <= splits <= most_splits
        assert (splits - 1) * steps_a_split < steps <= splits * steps_a_split
        if steps <= most_splits:
            assert splits == steps
        if steps % most_splits == 0:
            assert splits == most_splits


def test_decode_attention_glue_binds_each_split_count_once(monkeypatch):
    """The glue's launches over a context that grows past several split
    counts, their kernels stood in on the CPU by a recorder: each count's
    launches bound once (the first call that takes it), each call handed its
    count's launches and the params of that count, both launches the same
    params, the inputs in the order the bodies read them."""
    from mlx_moe_plan.kernels import launch

    bound, calls = [], []

    def recorder(backend, kernel_launch, poison, stream):
        bound.append((kernel_launch.body, kernel_launch.params.splits))

        def call(*, inputs):
            calls.append((kernel_launch.body, kernel_launch.params.splits,
                          np.array(inputs[-1]).tolist(), [a.shape for a in inputs[:-1]]))
            return [mx.zeros(shape, getattr(mx, dtype)) for shape, dtype in kernel_launch.outputs]
        return call

    monkeypatch.setattr(_gpu, "_bound_kernel", recorder)
    monkeypatch.setattr(_gpu, "_decode_attention_step", _gpu._decode_attention_step.fresh())
    batch, heads, kv_heads, head_dim = 2, 8, 2, 64
    stream = mx.default_stream(mx.cpu)
    buffer = mx.zeros((batch, kv_heads, 1000, head_dim), mx.bfloat16)
    keys_counts = [1, 64, 65, 300, 301, 129, 960]
    for keys in keys_counts:
        _gpu.GpuBackend("cuda").decode_attention(
            mx.zeros((batch, heads, 1, head_dim), mx.bfloat16), buffer[:, :, :keys],
            buffer[:, :, :keys], None, scale=0.125, stream=stream)
    splits = [launch.decode_attention_splits(batch, kv_heads, keys) for keys in keys_counts]
    assert splits == [1, 1, 2, 5, 5, 3, 15]
    assert bound == [(body, count) for count in dict.fromkeys(splits)
                     for body in ("decode_attention", "decode_attention_merge")]
    parts = [(batch * heads * count, head_dim) for count in splits]
    assert calls == [
        call for keys, count, part in zip(keys_counts, splits, parts) for call in (
            ("decode_attention", count, [batch, heads, kv_heads, count, 0x3E000000],
             [(batch, heads, 1, head_dim), (batch, kv_heads, keys, head_dim),
              (batch, kv_heads, keys, head_dim), (1, 1, 1, 1)]),
            ("decode_attention_merge", count, [batch, heads, kv_heads, count, 0x3E000000],
             [part, part[:1], part[:1], part[:1]]))]


@pytest.mark.parametrize("sinks, masked", [(False, False), (True, False), (False, True)])
def test_decode_attention_glue_gradient(monkeypatch, sinks, masked):
    """The glue's gradient with respect to the queries, keys, values and sinks
    is MLX's attention's (its launches stood in on the CPU by that op), a
    mask's keys taken out."""
    glue_launched_by(monkeypatch, "decode_attention", decode_attention_by_ops_launched)
    arrays = [a for a in decode_attention_case(np.random.default_rng(5), 2, 8, 2, 64, 9, sinks,
                                               mx.float16) if a is not None]
    mask = mx.array(np.arange(9)[None, None, None, :] >= np.array([0, 3])[:, None, None, None]) \
        if masked else None
    stream = mx.default_stream(mx.cpu)

    def through_glue(*arrays):
        sink_logits = arrays[3] if sinks else None
        return _gpu.GpuBackend("cuda").decode_attention(
            *arrays[:3], sink_logits, scale=0.125, stream=stream,
            mask=mask).astype(mx.float32).sum()

    def by_ops(*arrays):
        sink_logits = arrays[3] if sinks else None
        return _gpu.decode_attention_by_ops(*arrays[:3], sink_logits, mask, 0.125,
                                            stream=stream).astype(mx.float32).sum()

    arguments = list(range(len(arrays)))
    got = mx.grad(through_glue, argnums=arguments)(*arrays)
    want = mx.grad(by_ops, argnums=arguments)(*arrays)
    assert len(got) == len(want) == len(arrays)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item() and mx.abs(w).max().item() > 0


# ------------------------------------------------------------------ on a GPU


@on_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim, keys, sinks", [
    (8, 32, 4, 128, 513, False), (64, 32, 4, 128, 2049, False), (8, 64, 8, 64, 513, True),
    (3, 64, 8, 64, 1, True), (1, 4, 4, 128, 70, False)])
def test_decode_attention_kernel_against_reference_and_mlx(
        monkeypatch, dtype, batch, heads, kv_heads, head_dim, keys, sinks):
    """The two launches on the GPU (outputs poisoned first), and MLX's own
    attention there, each within `check_decode_attention` of the reference:
    Qwen3-30B-A3B's heads and gpt-oss-20b's with their sinks, over a cache's
    slice, from one key to a long context."""
    monkeypatch.setattr(_gpu, "POISON", -7777.0)
    queries, key_slice, value_slice, sink_logits = decode_attention_case(
        np.random.default_rng(keys), batch, heads, kv_heads, head_dim, keys, sinks, dtype)
    stream = mx.default_stream(mx.gpu)
    scale = head_dim ** -0.5
    got = _gpu.GpuBackend("cuda").decode_attention(queries, key_slice, value_slice,
                                                   sink_logits, scale=scale, stream=stream)
    by_mlx = _gpu.decode_attention_by_ops(queries, key_slice, value_slice, sink_logits, None,
                                          scale, stream=stream)
    name = str(dtype).rsplit(".", 1)[-1]
    values = ref.to_numpy(value_slice)
    expected = ref.decode_attention(ref.to_numpy(queries), ref.to_numpy(key_slice), values,
                                    None if sink_logits is None else ref.to_numpy(sink_logits),
                                    scale, name)
    check_decode_attention(got, expected, values, name)
    check_decode_attention(by_mlx, expected, values, name)
    # mlx-lm's batch cache's mask: each sequence's left padding taken out.
    padding = np.random.default_rng(1).integers(0, keys, batch)
    mask = mx.array(np.arange(keys)[None, None, None, :] >= padding[:, None, None, None])
    got = _gpu.GpuBackend("cuda").decode_attention(queries, key_slice, value_slice, sink_logits,
                                                   scale=scale, stream=stream, mask=mask)
    expected = ref.decode_attention(ref.to_numpy(queries), ref.to_numpy(key_slice), values,
                                    None if sink_logits is None else ref.to_numpy(sink_logits),
                                    scale, name, np.array(mask))
    check_decode_attention(got, expected, values, name)


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
    monkeypatch.setattr(rules, "DECODE_ATTENTION_FROM_ROWS", 1 << 30)  # the norms' launch alone
    launches = []
    glue_launched_by(monkeypatch, "head_norm_rope", recording_calls(
        _gpu._head_norm_rope_launched, lambda queries_in, keys_in, *_: keys_in.shape[-1],
        launches))
    prompt = mx.array(np.random.default_rng(9).integers(0, 40, (8, 6)))
    got = decode(model, prompt, 4)
    config = CONFIGS["qwen3_moe"]
    joined_width = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) \
        * config["head_dim"]
    assert launches == [joined_width] * 4 * config["num_hidden_layers"]
    with pytest.MonkeyPatch.context() as off:
        off.setattr(rules, "HEAD_NORM_ROPE_FROM_ROWS", 1 << 30)
        want = decode(plain, prompt, 4)
    assert_logits_close(got, want)


@on_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name, sizes", KERNEL_HEADS)
def test_decoding_through_the_attention_launch_on_the_gpu(monkeypatch, name, sizes):
    """Whole-model decoding of 8 sequences attending by the backend's launch
    on the GPU (Qwen3-30B-A3B's and gpt-oss-20b's heads; gpt-oss's sinks, its
    sliding layer's cache past the window's end) against the same patched
    model attending by MLX's: logits within bfloat16's rounding (the launch
    rounds the softmax's weights to bfloat16 before they weigh the values)."""
    model = make_model(name, **sizes)
    patch_model(model)
    plain = copy.deepcopy(model)
    monkeypatch.setattr(rules, "DECODE_ATTENTION_FROM_ROWS", 1)
    monkeypatch.setattr(rules, "HEAD_NORM_ROPE_FROM_ROWS", 1 << 30)  # the attention's alone
    backend = _backend.implementation(mx.default_stream(mx.gpu))
    launches = []
    launched = backend.decode_attention

    def counted(queries, keys, values, sinks, *, scale, stream, mask=None):
        launches.append((queries.shape, keys.shape[2], sinks is not None))
        return launched(queries, keys, values, sinks, scale=scale, stream=stream, mask=mask)

    monkeypatch.setattr(backend, "decode_attention", counted)
    prompt = mx.array(np.random.default_rng(12).integers(0, 40, (8, 6)))
    got = decode(model, prompt, 4)
    heads, head_dim = sizes["num_attention_heads"], sizes["head_dim"]
    assert launches == [((8, heads, 1, head_dim), keys, name == "gpt_oss")
                        for keys in keys_counts(name, 6, 4)]
    with pytest.MonkeyPatch.context() as off:
        off.setattr(rules, "DECODE_ATTENTION_FROM_ROWS", 1 << 30)
        want = decode(plain, prompt, 4)
    assert_logits_close(got, want)
