# moe_plan against mlx_moe_plan.reference.moe_plan: every field, bit for bit.

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    ARRAY_FIELDS,
    SCALAR_FIELDS,
    FLOAT_DTYPES,
    Routing,
    as_float32,
    assert_bitwise,
    assert_plan_matches,
    make_ids,
    routings,
    with_layout,
)
from hypothesis import given
from hypothesis import strategies as st

import mlx_moe_plan
from mlx_moe_plan import _sizes
from mlx_moe_plan import reference as ref
from mlx_moe_plan.kernels import launch


def _plan_of(ids, num_experts, device, *, weights=None, tile_m=1, **kwargs):
    indices = mx.array(np.asarray(ids))
    return mlx_moe_plan.moe_plan(indices, num_experts, weights=weights, tile_m=tile_m,
                                 stream=device, **kwargs)


@given(routing=routings())
def test_plan_matches_reference(routing: Routing, device):
    plan = routing.plan(device)
    assert_plan_matches(plan, routing.reference_plan())


@given(routing=routings(max_tokens=16, max_k=4, max_experts=8, max_tile_m=8,
                        index_dtypes=("int32",)))
def test_plan_small_dense_cases(routing: Routing, device):
    # Few experts and small tiles: many collisions, long runs of one expert and
    # padding in almost every span, where ordering mistakes show first.
    assert_plan_matches(routing.plan(device), routing.reference_plan())


@pytest.mark.parametrize("top_k", [1, 2, 16])
@pytest.mark.parametrize("num_experts", [1, 2, 7, mlx_moe_plan.MAX_EXPERTS])
@pytest.mark.parametrize("tile_m", [1, 3, 128])
def test_plan_corner_sizes(top_k, num_experts, tile_m, device):
    rng = np.random.default_rng(top_k * 10_000 + num_experts * 10 + tile_m)
    ids = make_ids(rng, (33, top_k), num_experts, "int32", "uniform", 0.1, 0.1)
    assert_plan_matches(_plan_of(ids, num_experts, device, tile_m=tile_m),
                        ref.moe_plan(ids, num_experts, tile_m=tile_m))


@pytest.mark.parametrize("shape", [(0, 1), (0, 16), (3, 0, 4), (0, 0, 2)])
@pytest.mark.parametrize("tile_m", [1, 16])
def test_plan_without_tokens(shape, tile_m, device):
    # T = 0: empty arrays everywhere, num_rows 0, offsets all zero.
    ids = np.zeros(shape, np.int32)
    weights = mx.zeros(shape, mx.float32)
    plan = _plan_of(ids, 5, device, weights=weights, tile_m=tile_m)
    expected = ref.moe_plan(ids, 5, weights=np.zeros(shape, np.float32), tile_m=tile_m)
    assert plan.capacity == 0
    assert_plan_matches(plan, expected)


@pytest.mark.parametrize("shape", [(0, 1), (3, 0, 4)])
@pytest.mark.parametrize("tile_m", [1, 16])
def test_gpu_plan_without_tokens_runs_anywhere(shape, tile_m, monkeypatch):
    # With no entries the GPU backend runs no kernel: its plan is zeros viewed
    # as the kernel's output would be, which any stream can check.
    from mlx_moe_plan import _backend, _gpu

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran for a plan of no entries")

    monkeypatch.setattr(_gpu, "_kernel", no_kernel)
    monkeypatch.setattr(_backend, "implementation", lambda stream: _gpu.for_backend("cuda"))
    ids = np.zeros(shape, np.int32)
    for weights in (None, np.zeros(shape, np.float32)):
        plan = _plan_of(ids, 5, mx.cpu, weights=None if weights is None else mx.array(weights),
                        tile_m=tile_m)
        assert_plan_matches(plan, ref.moe_plan(ids, 5, weights=weights, tile_m=tile_m))


def test_plan_single_token_without_leading_dims(device):
    # indices of shape [K]: T = 1 with an empty leading shape.
    ids = np.array([3, -1, 3, 9, 0], np.int32)
    plan = _plan_of(ids, 4, device, tile_m=2)
    assert plan.positions.shape == (5,)
    assert_plan_matches(plan, ref.moe_plan(ids, 4, tile_m=2))


@pytest.mark.parametrize("tile_m", [1, 4])
def test_plan_one_expert_owns_every_entry(tile_m, device):
    ids = np.full((64, 8), 5, np.int32)
    plan = _plan_of(ids, 6, device, tile_m=tile_m)
    expected = ref.moe_plan(ids, 6, tile_m=tile_m)
    assert_plan_matches(plan, expected)
    assert np.array(plan.expert_counts).tolist() == [0] * 5 + [512]


def test_plan_known_small_example(device):
    # Written out by hand from docs/DESIGN.md, so that the reference itself is checked.
    ids = np.array([[1, 0], [1, -1], [7, 1]], np.int32)  # 7 is invalid with E = 3
    weights = mx.array([[0.5, 0.25], [2.0, 8.0], [4.0, 1.5]], mx.float32)
    plan = _plan_of(ids, 3, device, weights=weights, tile_m=2)
    # expert 0: entry 1 (t0); expert 1: entries 0 (t0), 2 (t1), 5 (t2); expert 2: none.
    # capacity: 6 entries + min(3, 6) * (2 - 1) = 9, rounded up to 10.
    assert plan.capacity == 10 and plan.max_tiles == 5 and plan.top_k == 2
    assert np.array(plan.row_tokens).tolist() == [0, -1, 0, 1, 2, -1, -1, -1, -1, -1]
    assert np.array(plan.row_entries).tolist() == [1, -1, 0, 2, 5, -1, -1, -1, -1, -1]
    assert np.array(plan.row_experts).tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert np.array(plan.row_weights).tolist() == [0.25, 0, 0.5, 2.0, 1.5, 0, 0, 0, 0, 0]
    assert np.array(plan.positions).tolist() == [[2, 0], [3, -1], [-1, 4]]
    assert np.array(plan.expert_counts).tolist() == [1, 3, 0]
    assert np.array(plan.expert_offsets).tolist() == [0, 2, 6, 6]
    assert np.array(plan.tile_experts).tolist() == [0, 1, 1, -1, -1]
    assert (plan.num_rows.item(), plan.num_tiles.item(), plan.num_invalid.item()) == (6, 3, 1)


@pytest.mark.parametrize(
    "index_dtype, values, num_experts",
    [
        # 64-bit ids must not wrap into valid experts: 2**32 + 3 is not expert 3,
        # 2**32 - 1 is not the skip value -1, and -2**40 is skipped, not invalid.
        ("int64", [2**32 + 3, 2**32 - 1, -(2**40), 3, 2**31, -(2**63), 2**63 - 1, 2**32], 8),
        # uint32 ids >= 2**31 are invalid (they are negative as int32).
        ("uint32", [2**31, 2**32 - 1, 2**31 + 2, 2, 7, 8, 0, 2**32 - 8], 8),
        ("uint64", [2**32 + 3, 2**32 - 1, 2**62, 3, 2**31, 0, 8, 1], 8),
        ("int32", [2**31 - 1, -(2**31), 8, -1, 7, 0, 1, 2**31 - 8], 8),
        ("int16", [32767, -32768, 1024, -1, 1023, 0, 3, 4], 1024),
        ("uint8", [255, 254, 200, 0, 199, 1, 3, 4], 200),
        ("int8", [127, -128, 100, -1, 99, 0, 3, 4], 100),
        ("uint16", [65535, 32768, 1024, 0, 1023, 1, 3, 4], 1024),
    ],
)
def test_plan_extreme_ids_per_index_dtype(index_dtype, values, num_experts, device):
    ids = np.array(values, dtype=index_dtype).reshape(2, 4)
    plan = _plan_of(ids, num_experts, device, tile_m=2)
    expected = ref.moe_plan(ids, num_experts, tile_m=2)
    assert_plan_matches(plan, expected)


@pytest.mark.parametrize("layout", ["transposed", "strided_last", "strided_first"])
@pytest.mark.parametrize("index_dtype", ["int32", "int64", "uint32", "int16"])
def test_plan_non_contiguous_indices(layout, index_dtype, device):
    rng = np.random.default_rng(7)
    ids = make_ids(rng, (4, 6, 5), 13, index_dtype, "uniform", 0.2, 0.2)
    indices = with_layout(ids, layout, rng)
    weight_values = rng.standard_normal(ids.shape).astype(np.float32)
    weights = mx.array(np.ascontiguousarray(weight_values.T)).T  # transposed weights too
    plan = mlx_moe_plan.moe_plan(indices, 13, weights=weights, tile_m=4, stream=device)
    assert_plan_matches(plan, ref.moe_plan(ids, 13, weights=weight_values, tile_m=4))


@pytest.mark.parametrize("weight_dtype", list(FLOAT_DTYPES))
def test_plan_carries_weights_as_float32(weight_dtype, device):
    rng = np.random.default_rng(11)
    ids = make_ids(rng, (40, 3), 9, "int32", "uniform", 0.2, 0.1)
    weights = mx.array(rng.standard_normal(ids.shape).astype(np.float32)).astype(
        FLOAT_DTYPES[weight_dtype])
    plan = _plan_of(ids, 9, device, weights=weights, tile_m=8)
    assert plan.row_weights.dtype == mx.float32
    assert_plan_matches(plan, ref.moe_plan(ids, 9, weights=as_float32(weights), tile_m=8))


def test_plan_without_weights_has_no_row_weights(device):
    plan = _plan_of([[0, 1]], 2, device)
    assert plan.row_weights is None


@pytest.mark.parametrize("skew", ["uniform", "one_hot_expert"])
def test_plan_more_than_65536_rows(skew, device):
    # Past 2**16 rows: any 16-bit counter or index in the kernels would wrap here.
    # 160 blocks of the GPU plan: its groups place chunks of several (PLAN_MAX_GROUPS).
    num_tokens, top_k, num_experts, tile_m = 8192, 10, 512, 16
    plan_launch = launch.plan_launch(num_tokens * top_k, num_experts, tile_m, top_k, True)
    assert plan_launch.params.blocks_per_group > 1
    rng = np.random.default_rng(2024)
    if skew == "uniform":
        ids = make_ids(rng, (num_tokens, top_k), num_experts, "int32", "distinct_per_token",
                       0.0, 0.0)
    else:  # one expert takes 70,000 entries, more than 2**16 on its own
        ids = rng.integers(0, num_experts, (num_tokens, top_k)).astype(np.int32)
        ids.reshape(-1)[:70_000] = 3
    ids.reshape(-1)[rng.integers(0, ids.size, 500)] = -1
    ids.reshape(-1)[rng.integers(0, ids.size, 500)] = num_experts + 1
    weight_values = rng.standard_normal(ids.shape).astype(np.float32)
    plan = _plan_of(ids, num_experts, device, weights=mx.array(weight_values), tile_m=tile_m)
    expected = ref.moe_plan(ids, num_experts, weights=weight_values, tile_m=tile_m)
    assert expected.num_rows > 65_536
    assert_plan_matches(plan, expected)


@pytest.mark.parametrize("max_groups", [1, 3])
@pytest.mark.parametrize("mode", ["uniform", "one_expert", "duplicates"])
def test_plan_groups_place_chunks(mode, max_groups, device):
    # The GPU plan under a lowered cap on its groups: each places a chunk of
    # blocks in turn (3,000 entries: 6 blocks, in chunks of 6 or of 2).
    rng = np.random.default_rng(max_groups)
    ids = make_ids(rng, (1000, 3), 37, "int32", mode, 0.1, 0.1)
    weight_values = rng.standard_normal(ids.shape).astype(np.float32)
    with launch.plan_max_groups(max_groups):
        plan = _plan_of(ids, 37, device, weights=mx.array(weight_values), tile_m=4)
    assert_plan_matches(plan, ref.moe_plan(ids, 37, weights=weight_values, tile_m=4))


def test_check_raises_on_invalid_ids(device):
    ids = mx.array([[0, 1], [4, -1]], mx.int32)
    with pytest.raises(ValueError, match="indices"):
        mlx_moe_plan.moe_plan(ids, 4, check=True, stream=device)


@pytest.mark.parametrize("index_dtype", [mx.int64, mx.uint32])
def test_check_raises_on_wide_invalid_ids(index_dtype, device):
    ids = mx.array([[2**32 + 1 if index_dtype == mx.int64 else 2**31, 0]], index_dtype)
    with pytest.raises(ValueError, match="indices"):
        mlx_moe_plan.moe_plan(ids, 4, check=True, stream=device)


def test_check_passes_without_invalid_ids(device):
    # Skipped (negative) ids are not invalid.
    ids = mx.array([[0, 3], [-1, -(2**31)], [2, 2]], mx.int32)
    plan = mlx_moe_plan.moe_plan(ids, 4, check=True, stream=device)
    assert plan.num_invalid.item() == 0
    assert_plan_matches(plan, ref.moe_plan(np.array(ids), 4))


@given(routing=routings(max_tokens=32))
def test_check_agrees_with_num_invalid(routing: Routing, device):
    expected = routing.reference_plan()
    if expected.num_invalid:
        with pytest.raises(ValueError, match="indices"):
            routing.plan(device, check=True)
    else:
        assert_plan_matches(routing.plan(device, check=True), expected)


@given(routing=routings(max_tokens=48, weights="always"))
def test_plan_is_deterministic(routing: Routing, device):
    # Bitwise the same on every run: two separate evaluations of the same input.
    first = routing.plan(device)
    mx.eval(*[getattr(first, name) for name in ARRAY_FIELDS + SCALAR_FIELDS], first.row_weights)
    second = routing.plan(device)
    for name in ARRAY_FIELDS + SCALAR_FIELDS + ("row_weights",):
        assert_bitwise(getattr(second, name), np.array(getattr(first, name)), name)


@given(num_experts=st.integers(1, mlx_moe_plan.MAX_EXPERTS), tile_m=st.integers(1, 128),
       num_tokens=st.integers(0, 1000), top_k=st.integers(1, 16))
def test_capacity_formula(num_experts, tile_m, num_tokens, top_k, device):
    # docs/DESIGN.md's capacity, restated independently of reference.capacity_for
    # and of the package's own _sizes.capacity_for. Static sizes only: nothing
    # is evaluated.
    num_entries = num_tokens * top_k
    if tile_m == 1:
        capacity = num_entries
    else:
        worst = num_entries + min(num_experts, num_entries) * (tile_m - 1)
        capacity = (worst + tile_m - 1) // tile_m * tile_m
    assert ref.capacity_for(num_entries, num_experts, tile_m) == capacity
    assert _sizes.capacity_for(num_entries, num_experts, tile_m) == capacity
    indices = mx.zeros((num_tokens, top_k), mx.int32)
    plan = mlx_moe_plan.moe_plan(indices, num_experts, tile_m=tile_m, stream=device)
    assert (plan.capacity, plan.max_tiles) == (capacity, capacity // tile_m)
