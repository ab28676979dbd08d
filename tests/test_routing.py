# A router's top k (mlx_moe_plan.routing): on every device the indices of
# mlx-lm's own expressions, `mx.argpartition(...)` sliced, index for index,
# on rows with many ties, and at the k largest (smallest) scores as NumPy
# sorts them; on a GPU through kernels/argsort_slice.h, whose
# outputs are poisoned first, and against the NumPy reference too. The PoCL
# tests run the same body as OpenCL C on any machine.

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import _NO_GPU, FLOAT_DTYPES
from hypothesis import given
from hypothesis import strategies as st

from mlx_moe_plan import _backend, routing
from mlx_moe_plan import reference as ref
from mlx_moe_plan.kernels import launch


def _scores(rng, rows: int, experts: int, dtype: mx.Dtype) -> mx.array:
    # Softmax-like scores rounded to a few values: ties in every row.
    values = np.round(rng.random((rows, experts)) * 8) / 8
    return mx.array(values.astype(np.float32)).astype(dtype)


def _assert_picks_the_k_extremes(scores: mx.array, picked: mx.array, k: int,
                                 largest: bool) -> None:
    """Against NumPy: `picked` holds k distinct indices a row, at the row's k
    largest (`largest`) or k smallest values. Which of tied values it picks is
    argpartition's choice, unordered on the CPU: the values are compared sorted."""
    values = np.array(scores.astype(mx.float32))
    indices = np.array(picked).astype(np.int64)
    assert indices.shape == values.shape[:-1] + (k,)
    assert (np.diff(np.sort(indices, axis=-1), axis=-1) > 0).all(), "an index picked twice"
    ordered = np.sort(values, axis=-1)
    want = ordered[..., -k:] if largest else ordered[..., :k]
    got = np.sort(np.take_along_axis(values, indices, axis=-1), axis=-1)
    np.testing.assert_array_equal(got, want)


@given(rows=st.integers(1, 9), experts=st.sampled_from([1, 2, 8, 32, 128, 256, 512,
                                                        launch.ARGSORT_SLICE_MAX_ROW]),
       dtype=st.sampled_from(list(FLOAT_DTYPES)), data=st.data(),
       seed=st.integers(0, 2**32 - 1))
def test_top_k_is_argpartitions_slice(device, rows, experts, dtype, data, seed):
    k = data.draw(st.sampled_from(sorted({1, min(2, experts), min(8, experts), experts})))
    scores = _scores(np.random.default_rng(seed), rows, experts, FLOAT_DTYPES[dtype])
    with mx.stream(device):
        got_top = routing.top_k(scores, k)
        want_top = mx.argpartition(scores, kth=-k, axis=-1)[..., -k:]
        got_bottom = routing.bottom_k(-scores, k)
        want_bottom = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
        mx.eval(got_top, want_top, got_bottom, want_bottom)
    assert got_top.dtype == want_top.dtype == mx.uint32
    np.testing.assert_array_equal(np.array(got_top), np.array(want_top))
    np.testing.assert_array_equal(np.array(got_bottom), np.array(want_bottom))
    _assert_picks_the_k_extremes(scores, got_top, k, largest=True)
    _assert_picks_the_k_extremes(-scores, got_bottom, k, largest=False)
    if device.type == mx.gpu:  # the GPU's sort is stable: the reference's order
        values = np.array(scores.astype(mx.float32))
        np.testing.assert_array_equal(np.array(got_top),
                                      ref.argsort_slice(values, experts - k, k))


def test_top_k_scores_are_take_along_axis(device):
    """The scores beside the indices: take_along_axis's bits, and its gradient."""
    rng = np.random.default_rng(11)
    scores = _scores(rng, 5, 32, mx.bfloat16)
    weights = mx.array(rng.standard_normal((5, 4)).astype(np.float32))
    with mx.stream(device):
        indices, picked = routing.top_k_scores(scores, 4)
        want_indices = mx.argpartition(scores, kth=-4, axis=-1)[..., -4:]
        want = mx.take_along_axis(scores, want_indices, axis=-1)

        def weighted(s):
            return (routing.top_k_scores(s, 4)[1].astype(mx.float32) * weights).sum()

        def weighted_by_take(s):
            return (mx.take_along_axis(s, want_indices, axis=-1).astype(mx.float32)
                    * weights).sum()

        grad, want_grad = mx.grad(weighted)(scores), mx.grad(weighted_by_take)(scores)
        mx.eval(indices, picked, want_indices, want, grad, want_grad)
    np.testing.assert_array_equal(np.array(indices), np.array(want_indices))
    assert picked.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(picked.view(mx.uint16)), np.array(want.view(mx.uint16)))
    assert np.abs(np.array(want_grad.astype(mx.float32))).max() > 0
    np.testing.assert_array_equal(np.array(grad.view(mx.uint16)),
                                  np.array(want_grad.view(mx.uint16)))


def test_normalized_top_k_scores_are_the_ops(device, monkeypatch):
    """normalize=True where the rules leave the division to MLX's ops (on the
    CPU always; on CUDA with rules.TOP_K_NORMALIZES_IN_LAUNCH off, forced
    here): the picked scores by MLX's sum and divide after the launch, bit
    for bit the expression a renormalizing block writes, and its gradient."""
    from mlx_moe_plan import rules

    monkeypatch.setattr(rules, "TOP_K_NORMALIZES_IN_LAUNCH", False)
    rng = np.random.default_rng(13)
    scores = mx.softmax(mx.array(rng.standard_normal((5, 32)).astype(np.float32)),
                        axis=-1).astype(mx.bfloat16)
    weights = mx.array(rng.standard_normal((5, 4)).astype(np.float32))
    with mx.stream(device):
        indices, normalized = routing.top_k_scores(scores, 4, normalize=True)
        want_indices = mx.argpartition(scores, kth=-4, axis=-1)[..., -4:]

        def by_ops(s):
            picked = mx.take_along_axis(s, want_indices, axis=-1)
            return picked / mx.sum(picked, axis=-1, keepdims=True)

        def weighted(s):
            return (routing.top_k_scores(s, 4, normalize=True)[1].astype(mx.float32)
                    * weights).sum()

        want = by_ops(scores)
        grad = mx.grad(weighted)(scores)
        want_grad = mx.grad(lambda s: (by_ops(s).astype(mx.float32) * weights).sum())(scores)
        mx.eval(indices, normalized, want_indices, want, grad, want_grad)
    np.testing.assert_array_equal(np.array(indices), np.array(want_indices))
    assert normalized.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(normalized.view(mx.uint16)),
                                  np.array(want.view(mx.uint16)))
    assert np.abs(np.array(want_grad.astype(mx.float32))).max() > 0
    np.testing.assert_array_equal(np.array(grad.view(mx.uint16)),
                                  np.array(want_grad.view(mx.uint16)))


@pytest.mark.gpu
@pytest.mark.skipif(_backend.gpu_backend() is None, reason=_NO_GPU)
@given(rows=st.integers(1, 9), experts=st.sampled_from([8, 64, 128, 512]),
       k=st.sampled_from([1, 2, 8, 10]), dtype=st.sampled_from(list(FLOAT_DTYPES)),
       seed=st.integers(0, 2**32 - 1))
def test_top_k_normalizes_in_its_launch(rows, experts, k, dtype, seed):
    """`rules.top_k_normalizes` forced: the scores over their sum from the
    top k's own launch (outputs poisoned first), against the reference bit for
    bit, and against MLX's sum and divide within their roundings."""
    from mlx_moe_plan import _gpu, rules

    k = min(k, experts)
    logits = np.random.default_rng(seed).standard_normal((rows, experts)).astype(np.float32)
    with pytest.MonkeyPatch.context() as patch, mx.stream(mx.gpu):
        patch.setattr(rules, "TOP_K_NORMALIZES_IN_LAUNCH", True)
        patch.setattr(_gpu, "POISON", -7777.0)
        scores = mx.softmax(mx.array(logits), axis=-1, precise=True).astype(FLOAT_DTYPES[dtype])
        indices, normalized = routing.top_k_scores(scores, k, normalize=True)
        picked = mx.take_along_axis(scores, indices, axis=-1)
        by_ops = picked / mx.sum(picked, axis=-1, keepdims=True)
        mx.eval(indices, normalized, by_ops)
    values = ref.to_numpy(scores)
    want_indices = ref.argsort_slice(values, experts - k, k, dtype)
    np.testing.assert_array_equal(np.array(indices), want_indices)
    want = ref.normalized(np.take_along_axis(values, want_indices.astype(np.int64), axis=-1),
                          dtype)
    got = ref.to_numpy(normalized)
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))
    # MLX's CUDA sum adds 16-bit values in their own type (a few a thread, then
    # a tree), k roundings at most; the launch's sum is float32's, rounded once.
    # So MLX's quotients may differ from these in their last bits, no more.
    step = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    np.testing.assert_allclose(ref.to_float32(got, dtype),
                               ref.to_float32(ref.to_numpy(by_ops), dtype),
                               rtol=(k + 1) * step, atol=0)


@pytest.mark.parametrize("normalize", [False, True])
def test_gpu_glue_gradient_is_take_along_axis(monkeypatch, normalize):
    """The GPU path's custom function (_gpu.GpuBackend.argsort_slice), its
    kernel stood in for by MLX's own ops on the CPU: the gradient reaches the
    scores as take_along_axis's (then the division by their sum's,
    normalized), and not through the indices."""
    from mlx_moe_plan import _gpu

    def picked_of(values, order):
        picked = mx.take_along_axis(values, order, axis=-1)
        return picked / mx.sum(picked, axis=-1, keepdims=True) if normalize else picked

    def stand_in(backend, values, start, count, stream, normalize_in_launch):
        assert normalize_in_launch == normalize
        order = mx.argsort(values, axis=-1)[..., start:start + count]
        return order, picked_of(values, order)

    monkeypatch.setattr(_gpu, "_argsort_slice", stand_in)
    rng = np.random.default_rng(12)
    scores = mx.array(rng.uniform(0.5, 2.0, (3, 16)).astype(np.float32))
    weights = mx.array(rng.standard_normal((3, 4)).astype(np.float32))
    glue = _gpu.GpuBackend("cuda")
    with mx.stream(mx.cpu):
        def weighted(s):
            return (glue.argsort_slice(s, 12, 4, normalize=normalize,
                                       stream=mx.default_stream(mx.cpu))[1] * weights).sum()

        grad = mx.grad(weighted)(scores)
        order = mx.argsort(scores, axis=-1)[..., 12:]
        want = mx.grad(lambda s: (picked_of(s, order) * weights).sum())(scores)
        mx.eval(grad, want)
    assert np.count_nonzero(np.array(want)) == 12
    np.testing.assert_array_equal(np.array(grad), np.array(want))


def test_no_rows_give_indices_and_scores(device):
    # An empty batch: both outputs, empty, from the GPU glue as from MLX's ops
    # (the glue returns before any launch, so it runs here on any machine).
    from mlx_moe_plan import _gpu

    scores = mx.zeros((2, 0, 16), mx.bfloat16)
    with mx.stream(device):
        indices, picked = routing.top_k_scores(scores, 4)
        glue_indices, glue_picked = _gpu._argsort_slice("cuda", scores, 12, 4,
                                                        mx.default_stream(device))
    for got_indices, got_picked in [(indices, picked), (glue_indices, glue_picked)]:
        assert got_indices.shape == got_picked.shape == (2, 0, 4)
        assert got_indices.dtype == mx.uint32 and got_picked.dtype == mx.bfloat16


def test_top_k_keeps_leading_axes(device):
    scores = _scores(np.random.default_rng(3), 6, 16, mx.bfloat16).reshape(2, 3, 16)
    with mx.stream(device):
        got = routing.top_k(scores, 4)
        want = mx.argpartition(scores, kth=-4, axis=-1)[..., -4:]
        mx.eval(got, want)
    assert got.shape == (2, 3, 4)
    np.testing.assert_array_equal(np.array(got), np.array(want))
    _assert_picks_the_k_extremes(scores, got, 4, largest=True)


def test_rows_longer_than_the_kernel_take_the_k_largest(device):
    # Past ARGSORT_SLICE_MAX_ROW the router's own argpartition runs, on every
    # device: the k largest scores, as NumPy finds them.
    experts = launch.ARGSORT_SLICE_MAX_ROW + 1
    scores = _scores(np.random.default_rng(5), 2, experts, mx.float32)
    with mx.stream(device):
        got = routing.top_k(scores, 8)
        mx.eval(got)
    _assert_picks_the_k_extremes(scores, got, 8, largest=True)


def test_gpt_oss_top_k_is_the_code_its_forward_mirrors():
    # The fused gpt-oss forward takes its top k as mlx_lm's mlx_topk does,
    # through routing.top_k: say so when mlx_topk's code changes.
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.gpt_oss import mlx_topk

    from mlx_moe_plan import fused_blocks

    assert fused_blocks.source_digest(mlx_topk) == fused_blocks.GPT_OSS_TOP_K_DIGEST, (
        "mlx_lm.models.gpt_oss.mlx_topk changed: compare fused_blocks._gpt_oss with its new "
        f"code, then update GPT_OSS_TOP_K_DIGEST to {fused_blocks.source_digest(mlx_topk)!r}")


def test_reference_is_mlx_argsort(device):
    # The reference's order (NumPy's stable argsort: ties by index, NaN of
    # either sign last, the two zeros equal) is MLX's own argsort's, on the
    # CPU and, through the GPU's merge sort, on the GPU.
    rng = np.random.default_rng(9)
    values = rng.choice([-np.inf, -2.5, -0.0, 0.0, 1.0, np.inf, np.nan, -np.nan],
                        (16, 64)).astype(np.float32)
    with mx.stream(device):
        order = mx.argsort(mx.array(values), axis=-1)
        mx.eval(order)
    np.testing.assert_array_equal(np.array(order), ref.argsort_slice(values, 0, 64))
