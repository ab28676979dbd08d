# moe_gather and moe_unsort against mlx_moe_plan.reference.moe_gather / moe_unsort,
# bit for bit (bfloat16 compared as its uint16 bits).

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    FLOAT_DTYPES,
    FLOAT_NAMES,
    Routing,
    assert_bitwise,
    float_with_layout,
    make_ids,
    random_floats,
    reference_gather,
    routings,
    to_numpy,
)
from hypothesis import given
from hypothesis import strategies as st

import mlx_moe_plan
from mlx_moe_plan import reference as ref

HIDDEN_SIZES = [1, 3, 7, 129]
X_LAYOUTS = ["contiguous", "transposed", "strided_last", "strided_first", "broadcast"]

# Small enough that capacity * H stays cheap: capacity grows with E * tile_m.
gather_routings = routings(max_tokens=48, max_k=8, max_tile_m=32)


@given(routing=gather_routings, hidden=st.sampled_from(HIDDEN_SIZES),
       x_dtype=st.sampled_from(FLOAT_NAMES), out_dtype=st.sampled_from(FLOAT_NAMES + [None]),
       x_layout=st.sampled_from(X_LAYOUTS))
def test_gather_matches_reference(routing: Routing, hidden, x_dtype, out_dtype, x_layout, device):
    rng = np.random.default_rng(routing.seed)
    values = rng.standard_normal(routing.token_shape + (hidden,)).astype(np.float32)
    x = float_with_layout(values, FLOAT_DTYPES[x_dtype], x_layout, rng)
    dtype = None if out_dtype is None else FLOAT_DTYPES[out_dtype]
    plan = routing.plan(device)

    rows = mlx_moe_plan.moe_gather(x, plan, dtype=dtype, stream=device)

    assert rows.shape == (plan.capacity, hidden)
    assert rows.dtype == (x.dtype if dtype is None else dtype)  # default: x.dtype
    assert_bitwise(rows, reference_gather(x, routing.reference_plan(), dtype), "rows")


@pytest.mark.parametrize("x_dtype", FLOAT_NAMES)
@pytest.mark.parametrize("out_dtype", FLOAT_NAMES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_gather_every_dtype_pair(x_dtype, out_dtype, hidden, device):
    rng = np.random.default_rng(hidden)
    ids = make_ids(rng, (37, 4), 6, "int32", "uniform", 0.15, 0.1)
    plan = mlx_moe_plan.moe_plan(mx.array(ids), 6, tile_m=8, stream=device)
    x = random_floats(rng, (37, hidden), FLOAT_DTYPES[x_dtype])
    rows = mlx_moe_plan.moe_gather(x, plan, dtype=FLOAT_DTYPES[out_dtype], stream=device)
    expected = reference_gather(x, ref.moe_plan(ids, 6, tile_m=8), FLOAT_DTYPES[out_dtype])
    assert_bitwise(rows, expected, f"rows {x_dtype} -> {out_dtype}")


@pytest.mark.parametrize("x_dtype", FLOAT_NAMES)
@pytest.mark.parametrize("out_dtype", FLOAT_NAMES)
def test_gather_special_values(x_dtype, out_dtype, device):
    # Rounding ties, overflow to inf, subnormals, signed zeros and infinities.
    # NaN only where no conversion happens: a copy moves bits, payload included,
    # but NaN bits after a conversion differ between NumPy and MLX's own astype
    # (float32 NaN -> float16: 0x7e00 vs 0x7d00), so docs/DESIGN.md cannot mean them.
    specials = [1.00390625, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 70000.0, 65520.0, -65519.0,
                3.0e38, -0.0, 0.0, 1e-40, -1e-40, 2**-24, 2**-25, 6e-8, np.inf, -np.inf,
                0.1, -1.0 / 3.0]
    values = np.array(specials, np.float32).reshape(-1, 2)
    x = mx.array(values).astype(FLOAT_DTYPES[x_dtype])
    if x_dtype == out_dtype:
        nan_bits = {"float32": [0x7FC00001, 0xFFA00000], "float16": [0x7E01, 0xFD00],
                    "bfloat16": [0x7FC1, 0xFFA0]}[x_dtype]
        bits_dtype = mx.uint32 if x_dtype == "float32" else mx.uint16
        nans = mx.array(nan_bits, bits_dtype).view(x.dtype).reshape(1, 2)
        x = mx.concatenate([x, nans], axis=0)
    ids = np.arange(x.shape[0] * 2, dtype=np.int32).reshape(-1, 2) % 5
    plan = mlx_moe_plan.moe_plan(mx.array(ids), 5, tile_m=2, stream=device)
    rows = mlx_moe_plan.moe_gather(x, plan, dtype=FLOAT_DTYPES[out_dtype], stream=device)
    expected = reference_gather(x, ref.moe_plan(ids, 5, tile_m=2), FLOAT_DTYPES[out_dtype])
    assert_bitwise(rows, expected, f"rows {x_dtype} -> {out_dtype}")


@pytest.mark.parametrize("tile_m", [1, 16])
def test_gather_padding_rows_are_zeros(tile_m, device):
    rng = np.random.default_rng(5)
    ids = make_ids(rng, (20, 3), 7, "int32", "uniform", 0.2, 0.2)
    plan = mlx_moe_plan.moe_plan(mx.array(ids), 7, tile_m=tile_m, stream=device)
    # Offset away from zero so that no routed value is 0.0 by chance.
    x = mx.array(rng.standard_normal((20, 9)).astype(np.float32) + 10.0)
    rows = np.array(mlx_moe_plan.moe_gather(x, plan, stream=device))
    used = np.array(plan.row_tokens) >= 0
    assert np.all(rows[~used].view(np.uint32) == 0)  # +0.0, not -0.0 or stale memory
    assert np.all(rows[used] != 0)


def test_gather_large_plan(device):
    # More than 65,536 rows: row indices past 16 bits.
    num_tokens, top_k, num_experts, tile_m = 8192, 10, 512, 16
    rng = np.random.default_rng(3)
    ids = make_ids(rng, (num_tokens, top_k), num_experts, "int32", "distinct_per_token",
                   0.01, 0.01)
    plan = mlx_moe_plan.moe_plan(mx.array(ids), num_experts, tile_m=tile_m, stream=device)
    x = random_floats(rng, (num_tokens, 3), mx.float16)
    rows = mlx_moe_plan.moe_gather(x, plan, dtype=mx.float32, stream=device)
    expected = reference_gather(x, ref.moe_plan(ids, num_experts, tile_m=tile_m), mx.float32)
    assert_bitwise(rows, expected, "rows")


# --- unsort --------------------------------------------------------------------


@given(routing=gather_routings, hidden=st.sampled_from(HIDDEN_SIZES),
       rows_dtype=st.sampled_from(FLOAT_NAMES))
def test_unsort_matches_reference(routing: Routing, hidden, rows_dtype, device):
    rng = np.random.default_rng(routing.seed)
    plan = routing.plan(device)
    # Random values on every row, padding included: unsort must not read those.
    rows = random_floats(rng, (plan.capacity, hidden), FLOAT_DTYPES[rows_dtype])

    out = mlx_moe_plan.moe_unsort(rows, plan, stream=device)

    assert out.shape == routing.ids.shape + (hidden,)
    assert out.dtype == rows.dtype
    assert_bitwise(out, ref.moe_unsort(to_numpy(rows), routing.reference_plan()), "unsorted")


@given(routing=gather_routings, hidden=st.sampled_from(HIDDEN_SIZES),
       x_dtype=st.sampled_from(FLOAT_NAMES))
def test_unsort_inverts_gather(routing: Routing, hidden, x_dtype, device):
    # unsort(gather(x))[t, k] is x[t] for every routed entry, zeros elsewhere.
    rng = np.random.default_rng(routing.seed)
    x = random_floats(rng, routing.token_shape + (hidden,), FLOAT_DTYPES[x_dtype])
    plan = routing.plan(device)

    out = mlx_moe_plan.moe_unsort(mlx_moe_plan.moe_gather(x, plan, stream=device), plan,
                                  stream=device)

    expected_plan = routing.reference_plan()
    routed = (expected_plan.positions >= 0)[..., None]
    x_bits = to_numpy(x)[..., None, :]
    expected = np.where(routed, x_bits, np.zeros_like(x_bits))
    assert_bitwise(out, np.broadcast_to(expected, routing.ids.shape + (hidden,)), "unsorted")


@pytest.mark.parametrize("rows_dtype", FLOAT_NAMES)
def test_unsort_skipped_entries_are_zeros(rows_dtype, device):
    ids = np.array([[0, -1, 2], [5, 1, -7], [-1, -1, -1]], np.int32)  # 5 is invalid
    plan = mlx_moe_plan.moe_plan(mx.array(ids), 3, tile_m=4, stream=device)
    rows = random_floats(np.random.default_rng(0), (plan.capacity, 4), FLOAT_DTYPES[rows_dtype])
    out = to_numpy(mlx_moe_plan.moe_unsort(rows, plan, stream=device))
    skipped = ids < 0
    skipped[1, 0] = True
    assert np.all(out[skipped] == 0) and np.all(out[~skipped] != 0)
    assert_bitwise(out, ref.moe_unsort(to_numpy(rows), ref.moe_plan(ids, 3, tile_m=4)), "unsorted")


def test_unsort_non_contiguous_rows(device):
    rng = np.random.default_rng(9)
    ids = make_ids(rng, (3, 5, 4), 6, "int32", "uniform", 0.1, 0.1)
    plan = mlx_moe_plan.moe_plan(mx.array(ids), 6, tile_m=2, stream=device)
    values = rng.standard_normal((plan.capacity, 5)).astype(np.float32)
    for layout in ("transposed", "strided_last", "strided_first"):
        rows = float_with_layout(values, mx.float16, layout, rng)
        out = mlx_moe_plan.moe_unsort(rows, plan, stream=device)
        expected = ref.moe_unsort(values.astype(np.float16), ref.moe_plan(ids, 6, tile_m=2))
        assert_bitwise(out, expected, f"unsorted from {layout} rows")


@given(routing=routings(max_tokens=32, max_k=6, max_tile_m=16))
def test_gather_and_unsort_are_deterministic(routing: Routing, device):
    rng = np.random.default_rng(routing.seed)
    x = random_floats(rng, routing.token_shape + (5,), mx.bfloat16)
    plan = routing.plan(device)
    first = mlx_moe_plan.moe_gather(x, plan, dtype=mx.float16, stream=device)
    first_unsorted = mlx_moe_plan.moe_unsort(first, plan, stream=device)
    mx.eval(first, first_unsorted)
    plan = routing.plan(device)
    second = mlx_moe_plan.moe_gather(x, plan, dtype=mx.float16, stream=device)
    assert_bitwise(second, to_numpy(first), "rows")
    assert_bitwise(mlx_moe_plan.moe_unsort(second, plan, stream=device),
                   to_numpy(first_unsorted), "unsorted")


@pytest.mark.parametrize("op", ["moe_gather", "moe_combine", "moe_unsort"])
def test_zero_hidden_size(op, device):
    # H = 0 is a shape like any other: empty outputs of the right shapes.
    ids = mx.array([[0, 1], [1, -1], [2, 0]], mx.int32)
    plan = mlx_moe_plan.moe_plan(ids, 3, weights=mx.ones((3, 2)), tile_m=2, stream=device)
    empty_rows = mx.zeros((plan.capacity, 0), mx.float16)
    out = {
        "moe_gather": lambda: mlx_moe_plan.moe_gather(mx.zeros((3, 0)), plan, stream=device),
        "moe_combine": lambda: mlx_moe_plan.moe_combine(empty_rows, plan, stream=device),
        "moe_unsort": lambda: mlx_moe_plan.moe_unsort(empty_rows, plan, stream=device),
    }[op]()
    mx.eval(out)
    expected_shape = {"moe_gather": (plan.capacity, 0), "moe_combine": (3, 0),
                      "moe_unsort": (3, 2, 0)}[op]
    assert out.shape == expected_shape


def test_ops_on_new_streams(device):
    # Each op on a stream of its own: MLX orders them through the graph.
    rng = np.random.default_rng(17)
    ids = make_ids(rng, (25, 3), 6, "int32", "uniform", 0.1, 0.1)
    weight_values = rng.standard_normal(ids.shape).astype(np.float32)
    plan_stream, gather_stream, combine_stream = (mx.new_stream(device) for _ in range(3))
    plan = mlx_moe_plan.moe_plan(mx.array(ids), 6, weights=mx.array(weight_values), tile_m=4,
                                 stream=plan_stream)
    x = random_floats(rng, (25, 7), mx.float32)
    rows = mlx_moe_plan.moe_gather(x, plan, dtype=mx.bfloat16, stream=gather_stream)
    out = mlx_moe_plan.moe_combine(rows, plan, stream=combine_stream)
    expected_plan = ref.moe_plan(ids, 6, weights=weight_values, tile_m=4)
    expected_rows = reference_gather(x, expected_plan, mx.bfloat16)
    assert_bitwise(rows, expected_rows, "rows")
    assert_bitwise(out, ref.moe_combine(expected_rows, expected_plan, rows_dtype="bfloat16"),
                   "combined")


def test_large_outputs_kept_between_calls_stay_intact(device):
    # Large row outputs reuse buffers kept between calls (src/rows.cpp): a
    # buffer must never be reused while an output still holds it.
    rng = np.random.default_rng(17)
    ids = rng.integers(0, 64, (4096, 8)).astype(np.int32)  # 32768 rows of 256 B: 8 MiB
    plan = mlx_moe_plan.moe_plan(mx.array(ids), 64, stream=device)
    expected = ref.moe_plan(ids, 64)
    inputs = [random_floats(rng, (4096, 128), mx.float16) for _ in range(3)]
    held = [mlx_moe_plan.moe_gather(x, plan, stream=device) for x in inputs[:2]]
    mx.eval(held)
    del held[0]
    mx.eval(mlx_moe_plan.moe_gather(inputs[2], plan, stream=device) * 2)  # reuses the freed one
    third = mlx_moe_plan.moe_gather(inputs[2], plan, stream=device)
    for got, x in [(held[0], inputs[1]), (third, inputs[2])]:
        assert_bitwise(got, ref.moe_gather(to_numpy(x), expected), "gather rows")
