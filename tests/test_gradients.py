# The gradients of the row operations are written twice: in C++, the CPU
# primitives' vjps (src/gather.cpp, src/combine.cpp), and in Python,
# mlx_moe_plan/_gradients.py, which the GPU backend runs on its kernels. Here
# the two meet on random plans with skipped and invalid entries, weighted and
# not, in every dtype pair:
#   cpu: the Python formulas, run with the CPU backend's row operations,
#        against mx.vjp through the C++ primitives, bit for bit;
#   gpu: mx.vjp through the GPU backend against the same C++ gradients, to
#        float tolerance (MLX may sum the weights' float32 dot products in
#        another order on the GPU).
# The gradients' values against closed forms are tests/test_compile_grad.py's.

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import FLOAT_DTYPES, FLOAT_NAMES, Routing, as_float32, assert_bitwise, routings
from conftest import grouped_qmm_by_mlx_ops, to_numpy
from hypothesis import given
from hypothesis import strategies as st

# Both sides need the C++ extension (a GPU machine may run the package without it).
_ext = pytest.importorskip("mlx_moe_plan._ext", reason="the C++ gradients need the extension")

from mlx_moe_plan import _backend, _cpu, _gradients  # noqa: E402

CPU = mx.default_stream(mx.cpu)

grad_routings = routings(max_tokens=24, max_k=6, max_tile_m=8, weights="never")
dtypes = st.sampled_from(FLOAT_NAMES)
hidden_sizes = st.sampled_from([1, 3, 8])


def _plan_arrays(routing: Routing):
    """The CPU plan's row_tokens, positions `[T, K]` and row_entries."""
    plan = routing.plan(CPU)
    num_tokens = math.prod(routing.token_shape)
    positions = plan.positions.reshape(num_tokens, routing.top_k)
    mx.eval(plan.row_tokens, positions, plan.row_entries)
    return plan.capacity, plan.row_tokens, positions, plan.row_entries


def _random(rng, shape, dtype: str) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(FLOAT_DTYPES[dtype])


def _cpp_vjp(function, primals, cotangent):
    """Gradients through the C++ primitives: their vjps."""
    _, grads = mx.vjp(lambda *args: [function(*args)], primals, [cotangent])
    return grads


def _agree(got, want, what: str, device) -> None:
    if device == mx.Device(mx.cpu):
        assert_bitwise(got, to_numpy(want), what)
        return
    tolerance = 1e-5 if want.dtype == mx.float32 else 1e-2
    np.testing.assert_allclose(as_float32(got), as_float32(want), rtol=tolerance,
                               atol=tolerance, err_msg=what)


def _gpu_backend():
    from mlx_moe_plan import _gpu

    return _gpu.for_backend(_backend.gpu_backend())


def _gather_case(src, index, inverse, dtype, cotangent, device):
    """d src of gather_rows, by C++ and by the other side of `device`."""
    want = _cpp_vjp(lambda s: _ext.gather_rows(s, index, inverse, dtype, stream=CPU), [src],
                    cotangent)[0]
    if device == mx.Device(mx.cpu):
        got = _gradients.gather_rows_vjp(_cpu.CPU, cotangent, src, inverse, stream=CPU)
    else:
        gpu, stream = _gpu_backend(), mx.default_stream(device)
        got = _cpp_vjp(lambda s: gpu.gather_rows(s, index, inverse, dtype=dtype, stream=stream),
                       [src], cotangent)[0]
    return got, want


@given(routing=grad_routings, hidden=hidden_sizes, src_dtype=dtypes, out_dtype=dtypes)
def test_gather_gradients_agree(routing: Routing, hidden, src_dtype, out_dtype, device):
    # moe_gather: tokens to rows by row_tokens; positions list each token's rows.
    rng = np.random.default_rng(routing.seed)
    capacity, row_tokens, positions, _ = _plan_arrays(routing)
    x = _random(rng, (positions.shape[0], hidden), src_dtype)
    d_rows = _random(rng, (capacity, hidden), out_dtype)  # padding rows too: they add nothing
    got, want = _gather_case(x, row_tokens, positions, FLOAT_DTYPES[out_dtype], d_rows, device)
    _agree(got, want, "d x", device)


@given(routing=grad_routings, hidden=hidden_sizes, dtype=dtypes)
def test_unsort_gradients_agree(routing: Routing, hidden, dtype, device):
    # moe_unsort: rows to entries by positions (-1: skipped, zeros); row_entries
    # lists each row's one entry.
    rng = np.random.default_rng(routing.seed)
    capacity, _, positions, row_entries = _plan_arrays(routing)
    rows = _random(rng, (capacity, hidden), dtype)
    d_entries = _random(rng, (positions.size, hidden), dtype)
    got, want = _gather_case(rows, positions.reshape(-1), row_entries.reshape(-1, 1),
                             FLOAT_DTYPES[dtype], d_entries, device)
    _agree(got, want, "d rows", device)


@given(routing=grad_routings, hidden=hidden_sizes, rows_dtype=dtypes, out_dtype=dtypes,
       weighted=st.booleans())
def test_combine_gradients_agree(routing: Routing, hidden, rows_dtype, out_dtype, weighted,
                                 device):
    rng = np.random.default_rng(routing.seed)
    capacity, _, positions, row_entries = _plan_arrays(routing)
    rows = _random(rng, (capacity, hidden), rows_dtype)
    weights = _random(rng, positions.shape, "float32") if weighted else None
    d_out = _random(rng, (positions.shape[0], hidden), out_dtype)
    dtype = FLOAT_DTYPES[out_dtype]

    def combine_cpp(src, *maybe_weights):
        w = maybe_weights[0] if maybe_weights else None
        return _ext.combine_rows(src, positions, w, row_entries, dtype, stream=CPU)

    primals = [rows, weights] if weighted else [rows]
    want = _cpp_vjp(combine_cpp, primals, d_out)
    if device == mx.Device(mx.cpu):
        got = _gradients.combine_rows_vjp(_cpu.CPU, d_out, rows, positions, weights, row_entries,
                                          stream=CPU)
        got = got if weighted else got[:1]
    else:
        gpu, stream = _gpu_backend(), mx.default_stream(device)

        def combine_gpu(src, *maybe_weights):
            w = maybe_weights[0] if maybe_weights else None
            return gpu.combine_rows(src, positions, w, row_entries, dtype=dtype, stream=stream)

        got = _cpp_vjp(combine_gpu, primals, d_out)
    assert len(got) == len(want)
    for name, got_grad, want_grad in zip(("d rows", "d weights"), got, want):
        _agree(got_grad, want_grad, name, device)


@pytest.mark.parametrize("weighted", [False, True])
def test_gradients_agree_with_every_kind_of_entry(weighted, device):
    # Whatever Hypothesis draws: skipped (-1) and invalid entries, an expert
    # twice in a token, padding rows (tile_m 4).
    indices = mx.array([[0, 3], [-1, 2], [7, 2], [2, 2], [1, -1]], mx.int32)
    routing = Routing(indices, np.array(indices), 4, 4, None, None, "contiguous", 5)
    rng = np.random.default_rng(5)
    capacity, row_tokens, positions, row_entries = _plan_arrays(routing)
    assert (np.array(positions) < 0).sum() == 3 and capacity > int((np.array(positions) >= 0).sum())
    x = _random(rng, (5, 8), "float32")
    got, want = _gather_case(x, row_tokens, positions, mx.float16,
                             _random(rng, (capacity, 8), "float16"), device)
    _agree(got, want, "gather: d x", device)
    rows = _random(rng, (capacity, 8), "bfloat16")
    weights = _random(rng, (5, 2), "float32") if weighted else None
    d_out = _random(rng, (5, 8), "float32")
    want = _cpp_vjp(lambda s: _ext.combine_rows(s, positions, weights, row_entries, mx.float32,
                                                stream=CPU), [rows], d_out)[0]
    if device == mx.Device(mx.cpu):
        got = _gradients.combine_rows_vjp(_cpu.CPU, d_out, rows, positions, weights, row_entries,
                                          stream=CPU)[0]
    else:
        gpu, stream = _gpu_backend(), mx.default_stream(device)
        got = _cpp_vjp(lambda s: gpu.combine_rows(s, positions, weights, row_entries,
                                                  dtype=mx.float32, stream=stream), [rows],
                       d_out)[0]
    _agree(got, want, "combine: d rows", device)


@pytest.mark.parametrize("token_rows,gated,form", [
    (token_rows, gated, form) for token_rows in (False, True) for gated in (False, True)
    for form in ("plain", "biased", "clamped") if gated or form != "clamped"])
def test_grouped_qmm_gradient_is_the_fused_ops(monkeypatch, token_rows, gated, form):
    """The grouped GEMM's gradients in each of its forms, its kernel stood in
    for by MLX's ops of the same meaning (tests/test_grouped_qmm.py runs the
    kernel on a GPU): the gradient of those ops, tokens clamped into the
    tokens, tail rows zeros, whatever a broken plan's tokens say; the rows',
    and with biases (gpt-oss's clamped SwiGLU where gated) the biases'."""
    from mlx_moe_plan import _gpu

    rng = np.random.default_rng(7)
    counts, tail, num_tokens, in_dims, out_dims = [3, 0, 4, 2], 3, 4, 64, 16
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    row_experts = np.concatenate([np.repeat(np.arange(4), counts), np.full(tail, 3)])
    row_tokens = np.concatenate([rng.integers(-2, num_tokens + 2, offsets[-1]),
                                 np.full(tail, -1)]).astype(np.int32)

    def quantized():
        return mx.quantize(mx.array(rng.standard_normal((4, out_dims, in_dims)) * 0.1,
                                    mx.float32), 32, 4)

    gate, up = quantized(), quantized()
    offsets_mx, experts_mx, tokens_mx = (mx.array(offsets), mx.array(row_experts),
                                         mx.array(row_tokens))
    capacity = len(row_experts)
    biases = [mx.array(rng.standard_normal((4, out_dims)), mx.float32)
              for _ in range(1 + gated)] if form != "plain" else []
    clamped = (1.702, 0.5) if form == "clamped" else None  # a limit the sums pass

    def stand_in(backend, rows, weight, scales, biases, expert_offsets, row_tokens, up,
                 out_bias, clamped, dense, bits, group_size, stream):
        return grouped_qmm_by_mlx_ops(rows, weight, scales, biases, expert_offsets,
                                      experts_mx, bits=bits, group_size=group_size,
                                      row_tokens=row_tokens, up=up,
                                      bias=None if out_bias is None else out_bias[0],
                                      up_bias=None if out_bias is None or up is None
                                      else out_bias[1], clamped_swiglu=clamped)

    monkeypatch.setattr(_gpu, "_grouped_qmm", stand_in)
    function = _gpu._grouped_qmm_function("cuda", 4, 32, token_rows, gated, bool(biases),
                                          clamped, False, mx.default_stream(mx.cpu))
    rows = mx.array(rng.standard_normal((num_tokens if token_rows else capacity, in_dims)),
                    mx.float32)
    cotangent = mx.array(rng.standard_normal((capacity, out_dims)), mx.float32)
    extra = ([tokens_mx] if token_rows else []) + (list(up) if gated else [])

    def loss(rows, *biases):
        return (function(rows, *gate, offsets_mx, experts_mx, *extra, *biases)
                * cotangent).sum()

    def want_loss(rows, *biases):
        out = grouped_qmm_by_mlx_ops(rows, *gate, offsets_mx, experts_mx, bits=4, group_size=32,
                                     row_tokens=tokens_mx if token_rows else None,
                                     up=up if gated else None,
                                     bias=biases[0] if biases else None,
                                     up_bias=biases[1] if gated and biases else None,
                                     clamped_swiglu=clamped)
        return (out * cotangent).sum()

    # One argument's gradient comes as itself, several as a tuple.
    if clamped:  # the clamps reached: the gate's from above, up's both ways
        gate_sums, up_sums = (grouped_qmm_by_mlx_ops(
            rows, *matrices, offsets_mx, experts_mx, bits=4, group_size=32,
            row_tokens=tokens_mx if token_rows else None, bias=bias)[:offsets[-1]]
            for matrices, bias in ((gate, biases[0]), (up, biases[1])))
        limit = clamped[1]
        assert mx.any(gate_sums > limit) and mx.any(up_sums > limit) and mx.any(up_sums < -limit)
    arguments = tuple(range(1 + len(biases))) if biases else 0
    got = mx.grad(loss, argnums=arguments)(rows, *biases)
    want = mx.grad(want_loss, argnums=arguments)(rows, *biases)
    for got, want in zip(*((g,) if not biases else g for g in (got, want))):
        assert float(mx.abs(want).max()) > 0
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
