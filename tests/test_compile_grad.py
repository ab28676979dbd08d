# Gradients of moe_gather, moe_combine and moe_unsort against closed forms in
# NumPy float32 (with mlx_moe_plan.reference.moe_plan giving positions and rows),
# a finite-difference spot check, and mx.compile against the uncompiled ops, bit
# for bit.

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import (
    Routing,
    assert_bitwise,
    make_ids,
    routings,
    to_numpy,
)
from hypothesis import given
from hypothesis import strategies as st

from mlx_moe_plan import moe_combine, moe_gather, moe_plan, moe_unsort
from mlx_moe_plan import reference as ref

# float32 sums of up to K = 16 terms in an order the closed form need not share.
RTOL, ATOL = 1e-5, 1e-6

grad_routings = routings(max_tokens=32, max_k=16, max_tile_m=16, weights="never")


def _normal(rng, shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# --- closed forms ------------------------------------------------------------------


def gather_grad_x(expected: ref.ReferencePlan, d_rows: np.ndarray, token_shape) -> np.ndarray:
    """dx[t] = sum_k dX[positions[t, k]] over routed entries."""
    positions = expected.positions.reshape(-1, expected.top_k)
    dx = np.zeros((positions.shape[0], d_rows.shape[-1]), np.float32)
    for k in range(expected.top_k):
        used = positions[:, k] >= 0
        dx[used] += d_rows[positions[used, k]]
    return dx.reshape(tuple(token_shape) + (d_rows.shape[-1],))


def combine_grad_rows(expected, weight_values, dy) -> np.ndarray:
    """d rows[r] = w(entry of r) * dy[token of r]; zeros on padding rows."""
    flat_w = weight_values.reshape(-1)
    flat_dy = dy.reshape(-1, dy.shape[-1])
    d_rows = np.zeros((expected.capacity, dy.shape[-1]), np.float32)
    used = expected.row_entries >= 0
    entries = expected.row_entries[used]
    d_rows[used] = flat_w[entries][:, None] * flat_dy[entries // expected.top_k]
    return d_rows


def combine_grad_weights(expected, rows, dy) -> np.ndarray:
    """dw[t, k] = dot(dy[t], rows[positions[t, k]]); zeros for skipped entries."""
    positions = expected.positions.reshape(-1, expected.top_k)
    flat_dy = dy.reshape(-1, dy.shape[-1]).astype(np.float64)
    dw = np.zeros(positions.shape, np.float64)
    used = positions >= 0
    token_of = np.nonzero(used)[0]
    dw[used] = np.einsum("nh,nh->n", flat_dy[token_of], rows[positions[used]].astype(np.float64))
    return dw.astype(np.float32).reshape(expected.positions.shape)


def unsort_grad_rows(expected, d_out) -> np.ndarray:
    """d rows[r] = dU[entry of r]; zeros on padding rows."""
    flat = d_out.reshape(-1, d_out.shape[-1])
    d_rows = np.zeros((expected.capacity, d_out.shape[-1]), np.float32)
    used = expected.row_entries >= 0
    d_rows[used] = flat[expected.row_entries[used]]
    return d_rows


# --- gradients against the closed forms --------------------------------------------


@given(routing=grad_routings, hidden=st.sampled_from([1, 3, 8]))
def test_gather_vjp_wrt_x(routing: Routing, hidden, device):
    rng = np.random.default_rng(routing.seed)
    plan = routing.plan(device)
    x = mx.array(_normal(rng, routing.token_shape + (hidden,)))
    d_rows = _normal(rng, (plan.capacity, hidden))  # padding rows too: they must not count

    (rows,), (dx,) = mx.vjp(lambda x: [moe_gather(x, plan, stream=device)], [x],
                            [mx.array(d_rows)])

    assert dx.shape == x.shape and dx.dtype == mx.float32
    expected = gather_grad_x(routing.reference_plan(), d_rows, routing.token_shape)
    np.testing.assert_allclose(np.array(dx), expected, rtol=RTOL, atol=ATOL)


@given(routing=grad_routings, hidden=st.sampled_from([1, 3, 8]))
def test_combine_vjp_wrt_rows_and_weights(routing: Routing, hidden, device):
    rng = np.random.default_rng(routing.seed)
    plan = routing.plan(device)
    rows_values = _normal(rng, (plan.capacity, hidden))
    weight_values = _normal(rng, routing.ids.shape)
    dy = _normal(rng, routing.token_shape + (hidden,))

    _, (d_rows, d_weights) = mx.vjp(
        lambda rows, w: [moe_combine(rows, plan, weights=w, stream=device)],
        [mx.array(rows_values), mx.array(weight_values)], [mx.array(dy)])

    expected = routing.reference_plan()
    assert d_rows.shape == (plan.capacity, hidden) and d_weights.shape == routing.ids.shape
    np.testing.assert_allclose(np.array(d_rows), combine_grad_rows(expected, weight_values, dy),
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.array(d_weights), combine_grad_weights(expected, rows_values, dy),
                               rtol=RTOL, atol=ATOL)


@given(routing=grad_routings)
def test_combine_vjp_to_a_wider_dtype(routing: Routing, device):
    # float16 rows summed into float32 (dtype=): the rows' gradient comes back
    # in float16, the weights' as float32 sums of float16 rows.
    rng = np.random.default_rng(routing.seed)
    plan = routing.plan(device)
    rows = mx.array(_normal(rng, (plan.capacity, 8))).astype(mx.float16)
    weight_values = _normal(rng, routing.ids.shape)
    dy = _normal(rng, routing.token_shape + (8,))

    outs, (d_rows, d_weights) = mx.vjp(
        lambda rows, w: [moe_combine(rows, plan, weights=w, dtype=mx.float32, stream=device)],
        [rows, mx.array(weight_values)], [mx.array(dy)])

    assert outs[0].dtype == mx.float32 and d_rows.dtype == mx.float16
    expected = routing.reference_plan()
    rows_values = np.array(rows.astype(mx.float32))
    np.testing.assert_allclose(np.array(d_rows.astype(mx.float32)),
                               combine_grad_rows(expected, weight_values, dy), rtol=2e-3,
                               atol=2e-3)
    np.testing.assert_allclose(np.array(d_weights), combine_grad_weights(expected, rows_values, dy),
                               rtol=RTOL, atol=ATOL)


@given(routing=grad_routings, hidden=st.sampled_from([1, 3, 8]))
def test_unsort_vjp_wrt_rows(routing: Routing, hidden, device):
    rng = np.random.default_rng(routing.seed)
    plan = routing.plan(device)
    rows = mx.array(_normal(rng, (plan.capacity, hidden)))
    d_out = _normal(rng, routing.ids.shape + (hidden,))  # skipped entries too

    _, (d_rows,) = mx.vjp(lambda rows: [moe_unsort(rows, plan, stream=device)], [rows],
                          [mx.array(d_out)])

    expected = unsort_grad_rows(routing.reference_plan(), d_out)
    np.testing.assert_allclose(np.array(d_rows), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("x_dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("rows_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_gather_vjp_follows_the_dtypes(x_dtype, rows_dtype, device):
    # A converting gather: the cotangent arrives in the rows' dtype and dx leaves
    # in x's. Small integers, so every dtype holds the sums exactly.
    rng = np.random.default_rng(51)
    ids = make_ids(rng, (9, 3), 4, "int32", "duplicates", 0.2, 0.1)
    expected = ref.moe_plan(ids, 4, tile_m=2)
    plan = moe_plan(mx.array(ids), 4, tile_m=2, stream=device)
    x = mx.array(_normal(rng, (9, 6))).astype(x_dtype)
    d_rows = rng.integers(-8, 8, (plan.capacity, 6)).astype(np.float32)

    _, (dx,) = mx.vjp(lambda x: [moe_gather(x, plan, dtype=rows_dtype, stream=device)], [x],
                      [mx.array(d_rows).astype(rows_dtype)])

    assert dx.dtype == x_dtype
    np.testing.assert_array_equal(np.array(dx.astype(mx.float32)),
                                  gather_grad_x(expected, d_rows, (9,)))


def test_grad_of_combine_with_the_plans_weights(device):
    # The weights given to moe_plan are differentiable through combine's default:
    # dw[t, k] = dot(dy[t], rows[positions[t, k]]), whatever the plan did with them.
    rng = np.random.default_rng(21)
    ids = make_ids(rng, (12, 3), 5, "int32", "uniform", 0.2, 0.1)
    weight_values = _normal(rng, ids.shape)
    dy = _normal(rng, (12, 4))
    expected = ref.moe_plan(ids, 5, weights=weight_values, tile_m=2)
    rows_values = _normal(rng, (expected.capacity, 4))

    def loss(weights):
        plan = moe_plan(mx.array(ids), 5, weights=weights, tile_m=2, stream=device)
        return (moe_combine(mx.array(rows_values), plan, stream=device) * mx.array(dy)).sum()

    d_weights = mx.grad(loss)(mx.array(weight_values))
    np.testing.assert_allclose(np.array(d_weights), combine_grad_weights(expected, rows_values, dy),
                               rtol=RTOL, atol=ATOL)


def test_grad_of_a_moe_layer_in_miniature(device):
    # gather -> per-row scale -> combine, differentiated w.r.t. x and the weights
    # with mx.grad; the chain rule through both closed forms gives the result.
    rng = np.random.default_rng(22)
    ids = make_ids(rng, (2, 7, 4), 6, "int32", "distinct_per_token", 0.1, 0.1)
    expected = ref.moe_plan(ids, 6, tile_m=4)
    plan = moe_plan(mx.array(ids), 6, tile_m=4, stream=device)
    x_values = _normal(rng, (2, 7, 3))
    weight_values = _normal(rng, ids.shape)
    scale = _normal(rng, (expected.capacity, 1))
    dy = _normal(rng, (2, 7, 3))

    def loss(x, w):
        rows = moe_gather(x, plan, stream=device) * mx.array(scale)
        return (moe_combine(rows, plan, weights=w, stream=device) * mx.array(dy)).sum()

    dx, dw = mx.grad(loss, argnums=(0, 1))(mx.array(x_values), mx.array(weight_values))

    rows = ref.moe_gather(x_values, expected) * scale
    d_rows = combine_grad_rows(expected, weight_values, dy) * scale
    np.testing.assert_allclose(np.array(dx), gather_grad_x(expected, d_rows, (2, 7)),
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.array(dw), combine_grad_weights(expected, rows, dy),
                               rtol=RTOL, atol=ATOL)


def test_finite_differences_through_gather_and_combine(device):
    # A nonlinear loss, so that the vjps are checked against the function itself
    # and not only against closed forms written by the same hand.
    rng = np.random.default_rng(23)
    ids = make_ids(rng, (5, 3), 4, "int32", "uniform", 0.2, 0.1)
    plan = moe_plan(mx.array(ids), 4, tile_m=2, stream=device)
    weights = mx.array(_normal(rng, ids.shape))
    scale = mx.array(_normal(rng, (plan.capacity, 1)))
    x_values = _normal(rng, (5, 4))

    def loss(x, w):
        rows = mx.tanh(moe_gather(x, plan, stream=device) * scale)
        return mx.sin(moe_combine(rows, plan, weights=w, stream=device)).sum()

    dx, dw = mx.grad(loss, argnums=(0, 1))(mx.array(x_values), weights)
    step = 1e-2
    for t, h in [(0, 0), (1, 3), (2, 1), (4, 2)]:
        bumped_up, bumped_down = x_values.copy(), x_values.copy()
        bumped_up[t, h] += step
        bumped_down[t, h] -= step
        numeric = (loss(mx.array(bumped_up), weights).item()
                   - loss(mx.array(bumped_down), weights).item()) / (2 * step)
        assert abs(dx[t, h].item() - numeric) <= 2e-3 + 1e-2 * abs(numeric), (t, h)
    weight_values = np.array(weights)
    for t, k in [(0, 0), (1, 2), (3, 1)]:
        bumped_up, bumped_down = weight_values.copy(), weight_values.copy()
        bumped_up[t, k] += step
        bumped_down[t, k] -= step
        numeric = (loss(mx.array(x_values), mx.array(bumped_up)).item()
                   - loss(mx.array(x_values), mx.array(bumped_down)).item()) / (2 * step)
        assert abs(dw[t, k].item() - numeric) <= 2e-3 + 1e-2 * abs(numeric), (t, k)


# --- mx.compile -------------------------------------------------------------------


def _moe_forward(device, num_experts, tile_m, rows_dtype):
    """plan -> gather (converting) -> combine with the plan's weights."""

    def forward(indices, weights, x):
        plan = moe_plan(indices, num_experts, weights=weights, tile_m=tile_m, stream=device)
        rows = moe_gather(x, plan, dtype=rows_dtype, stream=device)
        combined = moe_combine(rows, plan, stream=device)
        unsorted = moe_unsort(rows, plan, stream=device)
        return (combined, unsorted, plan.row_tokens, plan.row_experts, plan.row_weights,
                plan.row_entries, plan.positions, plan.expert_counts, plan.expert_offsets,
                plan.tile_experts, plan.num_rows, plan.num_tiles, plan.num_invalid)

    return forward


@pytest.mark.parametrize("rows_dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("tile_m", [1, 8])
def test_compiled_forward_gives_the_same_bits(rows_dtype, tile_m, device):
    forward = _moe_forward(device, 10, tile_m, rows_dtype)
    compiled = mx.compile(forward)
    rng = np.random.default_rng(31 + tile_m)
    for _ in range(2):  # new data, same shapes: the compiled graph is reused
        ids = make_ids(rng, (3, 9, 4), 10, "int32", "uniform", 0.1, 0.1)
        inputs = (mx.array(ids), mx.array(_normal(rng, ids.shape)),
                  mx.array(_normal(rng, (3, 9, 6))))
        eager = forward(*inputs)
        mx.eval(eager)
        for name, got, want in zip(range(len(eager)), compiled(*inputs), eager):
            assert_bitwise(got, to_numpy(want), f"output {name}")


def test_compiled_forward_with_int64_indices(device):
    # The clamp of wide ids happens inside the compiled graph too.
    forward = _moe_forward(device, 6, 4, mx.float16)
    ids = np.array([[2**32 + 3, 1], [-(2**40), 5], [3, 2**31]], np.int64)
    x = mx.array(_normal(np.random.default_rng(0), (3, 5)))
    inputs = (mx.array(ids), mx.ones(ids.shape), x)
    eager = forward(*inputs)
    mx.eval(eager)
    for name, got, want in zip(range(len(eager)), mx.compile(forward)(*inputs), eager):
        assert_bitwise(got, to_numpy(want), f"output {name}")
    assert_bitwise(eager[6], ref.moe_plan(ids, 6, tile_m=4).positions, "positions")


def test_compiled_gradient_gives_the_same_bits(device):
    rng = np.random.default_rng(41)
    ids = make_ids(rng, (16, 4), 7, "int32", "uniform", 0.1, 0.05)
    dy = mx.array(_normal(rng, (16, 5)))
    indices = mx.array(ids)

    def loss(x, w):
        plan = moe_plan(indices, 7, tile_m=4, stream=device)
        rows = moe_gather(x, plan, stream=device)
        weighted = moe_combine(rows, plan, weights=w, stream=device)
        back = moe_unsort(rows, plan, stream=device)
        return (weighted * dy).sum() + back.sum()

    grad = mx.value_and_grad(loss, argnums=(0, 1))
    compiled = mx.compile(grad)
    for _ in range(2):
        x, w = mx.array(_normal(rng, (16, 5))), mx.array(_normal(rng, ids.shape))
        value, (dx, dw) = grad(x, w)
        mx.eval(value, dx, dw)
        c_value, (c_dx, c_dw) = compiled(x, w)
        if device == mx.Device(mx.gpu):
            # MLX's compile fuses the elementwise ops between our kernels (the
            # sum of the two row cotangents, their scaling) into one CUDA
            # kernel, which contracts a * b + c into a fused multiply-add: a
            # last-bit difference that is MLX's, not this package's.
            for name, got, want in [("loss", c_value, value), ("dx", c_dx, dx), ("dw", c_dw, dw)]:
                np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6,
                                           err_msg=name)
            continue
        assert_bitwise(c_value, to_numpy(value), "loss")
        assert_bitwise(c_dx, to_numpy(dx), "dx")
        assert_bitwise(c_dw, to_numpy(dw), "dw")


@given(routing=routings(max_tokens=24, max_k=8, max_tile_m=16, index_dtypes=("int32", "int64")))
def test_compiled_plan_matches_reference(routing: Routing, device):
    # Only the indices are traced: the routing's static sizes fix the graph.
    def plan_fields(indices):
        plan = moe_plan(indices, routing.num_experts, tile_m=routing.tile_m, stream=device)
        return [plan.row_tokens, plan.row_experts, plan.row_entries, plan.positions,
                plan.expert_counts, plan.expert_offsets, plan.tile_experts,
                plan.num_rows, plan.num_tiles, plan.num_invalid]

    got = mx.compile(plan_fields)(routing.indices)
    expected = ref.moe_plan(routing.ids, routing.num_experts, tile_m=routing.tile_m)
    names = ["row_tokens", "row_experts", "row_entries", "positions", "expert_counts",
             "expert_offsets", "tile_experts", "num_rows", "num_tiles", "num_invalid"]
    for name, value in zip(names, got):
        assert_bitwise(value, np.asarray(getattr(expected, name), np.int32), name)


# --- the GPU glue's gradients, where a transform traces ---------------------------


def _top_k_by_ops(values, start=12, count=4):
    """The router's top k of `values` by MLX's ops: the indices (no gradient)
    and their scores."""
    order = mx.stop_gradient(mx.argsort(values, axis=-1)[..., start:start + count])
    return order, mx.take_along_axis(values, order, axis=-1)


def _top_k_launch(backend, values, start, count, stream, normalize):
    """`_gpu._argsort_slice`'s launch stood in for on the CPU: `_top_k_by_ops`'
    arrays, with no gradient of their own, as a kernel's: only the glue's
    custom function gives one."""
    return tuple(map(mx.stop_gradient, _top_k_by_ops(values, start, count)))


def test_traced_is_what_a_transform_runs_on():
    """`_tracing.traced`: a transform's inputs and every array made from
    one, while it runs; not an array it does not trace (a closure's), and
    nothing outside a transform, its own arrays once it has returned.
    `_tracing.transforming`: inside each transform, not outside."""
    from mlx_moe_plan._tracing import traced, transforming

    x, constant = mx.array([1.0, 2.0]), mx.array([3.0, -4.0])
    seen = {}

    def record(name):
        def function(x):
            made = x * constant
            seen[name] = (traced([x]), traced([made]), traced([constant]),
                          traced([constant * 2]), traced([constant, made]), transforming())
            return made.sum() if name == "grad" else made
        return function

    mx.grad(record("grad"))(x)
    mx.vjp(record("vjp"), [x], [x])
    mx.jvp(record("jvp"), [x], [x])
    mx.vmap(record("vmap"))(mx.stack([x, x]))
    mx.compile(record("compile"))(x)
    assert seen == {name: (True, True, False, False, True, True)
                    for name in ("grad", "vjp", "jvp", "vmap", "compile")}
    assert not traced([x]) and not traced([x * constant]) and not traced([])
    assert not transforming()


@pytest.mark.parametrize("transform", [None, "grad", "vjp", "jvp", "vmap", "compile"])
def test_gpu_glue_carries_its_gradient_only_where_traced(monkeypatch, transform):
    """The GPU glue (here the router's top k, its launch stood in for by
    MLX's ops on the CPU) makes its custom function, the `CustomTransforms`
    that carries the gradient, where a transform traces the call's arrays,
    and calls the launch alone elsewhere: outside any transform, and inside
    one on arrays it does not trace. The values are the same either way."""
    from benchmarks.step_kernels import graph_nodes
    from mlx_moe_plan import _gpu

    monkeypatch.setattr(_gpu, "_argsort_slice", _top_k_launch)
    glue, stream = _gpu.GpuBackend("cuda"), mx.default_stream(mx.cpu)
    rng = np.random.default_rng(3)
    scores, constant = (mx.array(rng.standard_normal((3, 16)).astype(np.float32))
                        for _ in range(2))
    nodes = {}

    def top_k(name, values):
        picked = glue.argsort_slice(values, 12, 4, stream=stream)[1]
        nodes[name] = graph_nodes(picked)
        return picked

    def function(values):
        top_k("constant", constant)
        picked = top_k("traced", values)
        return picked.sum() if transform == "grad" else picked

    with mx.stream(mx.cpu):
        if transform is None:
            function(scores)
        elif transform in ("vjp", "jvp"):
            getattr(mx, transform)(function, [scores], [mx.ones_like(scores if transform == "jvp"
                                                                     else scores[:, :4])])
        elif transform == "vmap":
            mx.vmap(function)(mx.stack([scores, scores]))
        else:
            getattr(mx, transform)(function)(scores)
    assert nodes["traced"]["CustomTransforms"] == (transform is not None)
    assert nodes["constant"]["CustomTransforms"] == 0 and nodes["constant"]["ArgSort"] == 1
    assert mx.array_equal(glue.argsort_slice(scores, 12, 4, stream=stream)[1],
                          _top_k_by_ops(scores)[1]).item()


@pytest.mark.parametrize("outer", [None, "grad", "parameters", "vmap", "compile"])
def test_compiled_forward_traced_for_replay_carries_no_gradient(monkeypatch, outer):
    """A compiled forward of the package's (`_compiled.compiled_call`) that
    MLX traces to replay, its call made outside every transform, makes its
    launches alone: MLX replays that tape only on untraced arrays, so its
    gradient's nodes would be replayed for nothing. Called inside a
    transform, MLX runs the forward itself on the tracers, and its launches
    carry their gradient; the gradient through the forward is right."""
    from benchmarks.step_kernels import graph_nodes
    from mlx_moe_plan import _compiled, _gpu, _tracing

    monkeypatch.setattr(_gpu, "_argsort_slice", _top_k_launch)
    glue, stream = _gpu.GpuBackend("cuda"), mx.default_stream(mx.cpu)
    module = nn.Linear(16, 16)
    seen = []

    def forward(x):
        picked = glue.argsort_slice(module(x), 12, 4, stream=stream)[1]
        seen.append(graph_nodes(picked)["CustomTransforms"])
        return picked

    def call(x):
        return _compiled.compiled_call(module, forward, x, key=("replay", outer))

    def loss_by_ops(x):
        return _top_k_by_ops(module(x))[1].sum()

    x = mx.array(np.random.default_rng(8).standard_normal((3, 16)).astype(np.float32))
    with mx.stream(mx.cpu):
        want = forward(x)  # uncompiled, outside every transform
        if outer is None:
            got = call(x)
            got_again = call(x)  # replayed: no forward runs
            assert mx.array_equal(got_again, want).item()
        elif outer == "grad":
            got = call(x)
            grad = mx.grad(lambda x: call(x).sum())(x)
            want_grad = mx.grad(loss_by_ops)(x)
            assert mx.array_equal(grad, want_grad).item() and mx.abs(grad).max().item() > 0
        elif outer == "parameters":  # the module's weights traced, not the input
            got = call(x)
            _, grads = nn.value_and_grad(module, lambda x: call(x).sum())(x)
            _, want_grads = nn.value_and_grad(module, loss_by_ops)(x)
            assert mx.array_equal(grads["weight"], want_grads["weight"]).item()
            assert mx.abs(want_grads["weight"]).max().item() > 0
        elif outer == "vmap":
            got = mx.vmap(call)(x[None])[0]
        else:
            got = mx.compile(call)(x)
    assert mx.array_equal(got, want).item()
    # the uncompiled call, then the compiled ones' forwards as MLX ran them
    assert seen == {None: [0, 0], "grad": [0, 0, 1], "parameters": [0, 0, 1], "vmap": [0, 1],
                    "compile": [0, 1]}[outer]
    assert not _tracing.replayed_trace()  # nothing left set past the calls
