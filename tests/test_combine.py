# moe_combine against mlx_moe_plan.reference.moe_combine, bit for bit: float32
# accumulation 0 + w0*v0 + w1*v1 + ... in ascending k, rounded once to rows.dtype.

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    FLOAT_DTYPES,
    FLOAT_NAMES,
    Routing,
    as_float32,
    assert_bitwise,
    float_with_layout,
    make_ids,
    random_floats,
    reference_combine,
    routings,
    to_numpy,
)
from hypothesis import given
from hypothesis import strategies as st

import mlx_moe_plan
from mlx_moe_plan import reference as ref

HIDDEN_SIZES = [1, 3, 7, 129]

combine_routings = routings(max_tokens=48, max_k=16, max_tile_m=32)


@given(routing=combine_routings, hidden=st.sampled_from(HIDDEN_SIZES),
       rows_dtype=st.sampled_from(FLOAT_NAMES), weight_dtype=st.sampled_from(FLOAT_NAMES),
       weight_layout=st.sampled_from(["contiguous", "transposed", "strided_last"]),
       out_dtype=st.sampled_from([None, *FLOAT_NAMES]))
def test_combine_explicit_weights(routing: Routing, hidden, rows_dtype, weight_dtype,
                                  weight_layout, out_dtype, device):
    rng = np.random.default_rng(routing.seed)
    plan = routing.plan(device)
    # Random values on every row, padding included: combine must not read those.
    rows = random_floats(rng, (plan.capacity, hidden), FLOAT_DTYPES[rows_dtype])
    raw = rng.standard_normal(routing.ids.shape).astype(np.float32)
    weights = float_with_layout(raw, FLOAT_DTYPES[weight_dtype], weight_layout, rng)

    dtype = None if out_dtype is None else FLOAT_DTYPES[out_dtype]
    out = mlx_moe_plan.moe_combine(rows, plan, weights=weights, dtype=dtype, stream=device)

    assert out.shape == routing.token_shape + (hidden,)
    assert out.dtype == (rows.dtype if dtype is None else dtype)
    expected = reference_combine(rows, routing.reference_plan(), as_float32(weights),
                                  out_dtype)
    assert_bitwise(out, expected, "combined")


@given(routing=routings(max_tokens=48, max_k=16, max_tile_m=32, weights="always"),
       hidden=st.sampled_from(HIDDEN_SIZES), rows_dtype=st.sampled_from(FLOAT_NAMES))
def test_combine_plan_weights(routing: Routing, hidden, rows_dtype, device):
    # Without weights=, the plan's weights (given to moe_plan, any float dtype).
    rng = np.random.default_rng(routing.seed)
    plan = routing.plan(device)
    rows = random_floats(rng, (plan.capacity, hidden), FLOAT_DTYPES[rows_dtype])

    out = mlx_moe_plan.moe_combine(rows, plan, stream=device)

    assert_bitwise(out, reference_combine(rows, routing.reference_plan()), "combined")


@pytest.mark.parametrize("rows_dtype", FLOAT_NAMES)
@pytest.mark.parametrize("top_k", [1, 2, 3, 16])
def test_combine_accumulates_in_float32_in_ascending_k(rows_dtype, top_k, device):
    # Cancelling terms of very different sizes: any other order, a wider or a
    # narrower accumulator, or a fused multiply-add changes the bits.
    rng = np.random.default_rng(top_k)
    num_tokens, hidden = 64, 33
    ids = np.stack([rng.permutation(40)[:top_k] for _ in range(num_tokens)]).astype(np.int32)
    plan = mlx_moe_plan.moe_plan(mx.array(ids), 40, tile_m=4, stream=device)
    scales = np.float32(2.0) ** rng.integers(-12, 12, (plan.capacity, 1)).astype(np.float32)
    rows = mx.array(rng.standard_normal((plan.capacity, hidden)).astype(np.float32) * scales)
    rows = rows.astype(FLOAT_DTYPES[rows_dtype])
    weight_values = (rng.standard_normal(ids.shape) * 3).astype(np.float32)
    weight_values[:, ::2] *= -1
    expected_plan = ref.moe_plan(ids, 40, tile_m=4)
    out = mlx_moe_plan.moe_combine(rows, plan, weights=mx.array(weight_values), stream=device)
    expected = reference_combine(rows, expected_plan, weight_values)
    assert_bitwise(out, expected, "combined")
    if top_k > 1 and rows_dtype == "float32":
        # The data really tells the orders apart, so passing pins ascending k.
        terms = weight_values[:, :, None] * np.array(rows)[expected_plan.positions]
        descending = np.zeros((num_tokens, hidden), np.float32)
        fused = np.zeros((num_tokens, hidden), np.float32)
        for k in reversed(range(top_k)):
            descending = descending + terms[:, k]
        for k in range(top_k):  # a fused multiply-add rounds once per step
            product = weight_values[:, k, None].astype(np.float64) * np.array(
                rows, np.float64)[expected_plan.positions[:, k]]
            fused = (fused.astype(np.float64) + product).astype(np.float32)
        assert top_k < 3 or not np.array_equal(descending, expected)  # a + b == b + a
        assert not np.array_equal(fused, expected)


@pytest.mark.parametrize("rows_dtype", FLOAT_NAMES)
def test_combine_skipped_entries_add_nothing(rows_dtype, device):
    # A skipped or invalid entry contributes nothing, not even a NaN: its weight
    # and every padding row below hold NaN, and all-skipped tokens give zeros.
    ids = np.array([[0, -1, 2, 9], [-1, -1, -1, -1], [1, 1, 9, -5], [2, 0, 1, 2]], np.int32)
    weight_values = np.random.default_rng(1).standard_normal(ids.shape).astype(np.float32)
    weight_values[(ids < 0) | (ids >= 3)] = np.nan
    plan = mlx_moe_plan.moe_plan(mx.array(ids), 3, tile_m=4, stream=device)
    row_values = np.random.default_rng(2).standard_normal((plan.capacity, 6)).astype(np.float32)
    expected_plan = ref.moe_plan(ids, 3, tile_m=4)
    row_values[expected_plan.row_tokens < 0] = np.nan
    rows = mx.array(row_values).astype(FLOAT_DTYPES[rows_dtype])

    out = mlx_moe_plan.moe_combine(rows, plan, weights=mx.array(weight_values), stream=device)

    assert_bitwise(out, reference_combine(rows, expected_plan, weight_values), "combined")
    assert not np.isnan(as_float32(out)).any()
    assert np.all(to_numpy(out)[1] == 0)


def test_combine_explicit_weights_override_the_plan(device):
    rng = np.random.default_rng(4)
    ids = make_ids(rng, (30, 4), 8, "int32", "uniform", 0.1, 0.1)
    plan = mlx_moe_plan.moe_plan(mx.array(ids), 8, weights=mx.ones(ids.shape), stream=device)
    rows = random_floats(rng, (plan.capacity, 5), mx.float32)
    weight_values = rng.standard_normal(ids.shape).astype(np.float32)
    out = mlx_moe_plan.moe_combine(rows, plan, weights=mx.array(weight_values), stream=device)
    expected = reference_combine(rows, ref.moe_plan(ids, 8), weight_values)
    assert_bitwise(out, expected, "combined")


def test_combine_without_any_weights_raises(device):
    plan = mlx_moe_plan.moe_plan(mx.array([[0, 1]]), 2, stream=device)
    rows = mx.ones((plan.capacity, 3))
    with pytest.raises(ValueError, match="weights"):
        mlx_moe_plan.moe_combine(rows, plan, stream=device)


def test_combine_non_contiguous_rows(device):
    rng = np.random.default_rng(6)
    ids = make_ids(rng, (2, 9, 3), 5, "int32", "uniform", 0.1, 0.1)
    weight_values = rng.standard_normal(ids.shape).astype(np.float32)
    plan = mlx_moe_plan.moe_plan(mx.array(ids), 5, weights=mx.array(weight_values), tile_m=3,
                                 stream=device)
    values = rng.standard_normal((plan.capacity, 7)).astype(np.float32)
    for layout in ("transposed", "strided_last", "strided_first"):
        rows = float_with_layout(values, mx.bfloat16, layout, rng)
        out = mlx_moe_plan.moe_combine(rows, plan, stream=device)
        expected = reference_combine(rows, ref.moe_plan(ids, 5, weights=weight_values,
                                                         tile_m=3))
        assert_bitwise(out, expected, f"combined from {layout} rows")


def test_combine_large_plan(device):
    # More than 65,536 rows, at Qwen3-Next's routing shape (E=512, top-10).
    num_tokens, top_k, num_experts, tile_m = 8192, 10, 512, 16
    rng = np.random.default_rng(8)
    ids = make_ids(rng, (num_tokens, top_k), num_experts, "int32", "distinct_per_token",
                   0.01, 0.01)
    weight_values = rng.standard_normal(ids.shape).astype(np.float32)
    plan = mlx_moe_plan.moe_plan(mx.array(ids), num_experts, weights=mx.array(weight_values),
                                 tile_m=tile_m, stream=device)
    rows = random_floats(rng, (plan.capacity, 3), mx.float16)
    out = mlx_moe_plan.moe_combine(rows, plan, stream=device)
    expected = reference_combine(rows, ref.moe_plan(ids, num_experts, weights=weight_values,
                                                     tile_m=tile_m))
    assert_bitwise(out, expected, "combined")


@given(routing=routings(max_tokens=32, max_k=8, max_tile_m=16, weights="always"),
       rows_dtype=st.sampled_from(FLOAT_NAMES))
def test_combine_is_deterministic(routing: Routing, rows_dtype, device):
    rng = np.random.default_rng(routing.seed)
    plan = routing.plan(device)
    rows = random_floats(rng, (plan.capacity, 6), FLOAT_DTYPES[rows_dtype])
    first = mlx_moe_plan.moe_combine(rows, plan, stream=device)
    mx.eval(first)
    second = mlx_moe_plan.moe_combine(rows, routing.plan(device), stream=device)
    assert_bitwise(second, to_numpy(first), "combined")


def test_gather_then_combine_round_trip(device):
    # With weights summing to one per token over its routed entries, combine(gather(x))
    # is x up to rounding: a sanity check of the two ops together.
    rng = np.random.default_rng(12)
    ids = make_ids(rng, (50, 4), 16, "int32", "distinct_per_token", 0.0, 0.0)
    weight_values = np.full(ids.shape, 0.25, np.float32)
    plan = mlx_moe_plan.moe_plan(mx.array(ids), 16, weights=mx.array(weight_values), tile_m=8,
                                 stream=device)
    x = random_floats(rng, (50, 11), mx.float32)
    out = mlx_moe_plan.moe_combine(mlx_moe_plan.moe_gather(x, plan, stream=device), plan,
                                   stream=device)
    np.testing.assert_allclose(np.array(out), np.array(x), rtol=1e-6, atol=1e-7)
