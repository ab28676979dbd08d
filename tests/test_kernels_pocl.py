# The kernel bodies of mlx_moe_plan/kernels/, compiled as OpenCL C and run on
# PoCL's CPU device (tests/opencl_harness.py), against mlx_moe_plan.reference
# bit for bit (grouped_qmm.h, a GEMM, within float tolerance): the same texts
# that Metal and CUDA compile, launched as _gpu.py launches them
# (kernels/launch.py), every output poisoned first.

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import (INT32_MAX, INT32_MIN, SHARED_WEIGHTS_BLOCK, assert_bitwise,
                      assert_gemm_close, check_add_rms_norm, check_decode_attention,
                      check_grouped_qmm,
                      check_head_norm_rope, experts_strategy, grouped_qmm_case,
                      grouped_qmm_cases, make_ids, quantized_experts, reference_combine,
                      reference_gather, token_rows)
from hypothesis import assume, given
from hypothesis import strategies as st

from mlx_moe_plan import MAX_EXPERTS
from mlx_moe_plan import reference as ref
from mlx_moe_plan.kernels import launch

pytest.importorskip("pyopencl", reason="pyopencl is not installed (the test extra brings it)")
import opencl_harness as ocl  # noqa: E402  (needs pyopencl)

try:
    ocl.device()
except ocl.Unavailable as error:
    pytest.skip(str(error), allow_module_level=True)

pytestmark = pytest.mark.pocl

NAMES = list(ocl.ROW_DTYPES)
# Element path: 1, 3, 7, 129. 16-byte rows in every dtype (vector path when
# in == out): 8, 64, 136, and 8200 (2050 vectors in float32: the widest
# group loops). 4 and 12: 16-byte rows in float32 only.
GATHER_HIDDEN = [1, 3, 7, 129, 4, 8, 12, 64, 136, 8200]
# combine's UNROLL grows from 4 to 16 as rows widen (2100: 8, 4100: 16);
# 8200 is past 16 * MAX_ROW_GROUP, so the widest group takes two passes.
COMBINE_HIDDEN = [1, 3, 7, 129, 8, 64, 520, 2100, 4100, 8200]

# Layout of each dtype's bits: (storage, exponent mask, mantissa mask).
_BITS = {
    "float32": (np.uint32, 0x7F800000, 0x007FFFFF),
    "float16": (np.uint16, 0x7C00, 0x03FF),
    "bfloat16": (np.uint16, 0x7F80, 0x007F),
}


def _stored(bits: np.ndarray, name: str) -> np.ndarray:
    """Bits as the harness and the reference take a `name` array."""
    return bits if name == "bfloat16" else bits.view(ocl.DTYPES[name][0])


def _gather_values(rng, shape, name: str) -> np.ndarray:
    """Half normal values, half random bits: every exponent, subnormals, +-0,
    +-inf, rounding ties of every conversion. NaNs become infs (see
    test_gather_copies_nan_payloads for NaN)."""
    storage, exponent, mantissa = _BITS[name]
    with np.errstate(over="ignore"):
        normal = ref.from_float32(rng.standard_normal(shape).astype(np.float32), name)
    bits = np.where(rng.random(shape) < 0.5, _stored(normal, name).view(storage),
                    rng.integers(0, np.iinfo(storage).max, shape, dtype=storage, endpoint=True))
    nan = ((bits & exponent) == exponent) & ((bits & mantissa) != 0)
    bits[nan] &= ~storage(mantissa)
    bits[bits == _poison(storage)] ^= 1  # an unwritten element must differ from every value
    return _stored(bits, name)


def _poison(storage) -> int:
    return int.from_bytes(bytes([ocl.POISON_BYTE]) * np.dtype(storage).itemsize, "little")


# Exponent ranges whose values stay finite through combine's sums: float32 and
# bfloat16 reach subnormals, float16 its subnormals below 2**-14.
_COMBINE_EXPONENTS = {"float32": (-150, 90), "float16": (-26, 11), "bfloat16": (-135, 90)}


def _combine_values(rng, shape, name: str) -> np.ndarray:
    low, high = _COMBINE_EXPONENTS[name]
    values = np.ldexp(rng.standard_normal(shape), rng.integers(low, high, shape, endpoint=True))
    values[rng.random(shape) < 0.1] = rng.choice([0.0, -0.0])
    return ref.from_float32(values.astype(np.float32), name)


def _index(rng, shape, num_src: int, invalid_rate: float) -> np.ndarray:
    """Rows of src, -1 for none, and at `invalid_rate` values outside [-1, num_src)."""
    index = rng.integers(-1, num_src, shape) if num_src else np.full(shape, -1)
    invalid = rng.random(shape) < invalid_rate
    outside = [num_src, num_src + 1, INT32_MAX, -2, INT32_MIN]
    index[invalid] = rng.choice(outside, int(invalid.sum()))
    return index.astype(np.int32)


def _present(index: np.ndarray, num_src: int) -> np.ndarray:
    """The reference's index: the kernels read no row outside src and treat one as -1."""
    return np.where((index >= 0) & (index < num_src), index, -1).astype(np.int32)


# --- plan ------------------------------------------------------------------------


def assert_plan_equal(actual: ref.ReferencePlan, expected: ref.ReferencePlan) -> None:
    for field in ref.ReferencePlan.__dataclass_fields__:
        value, wanted = getattr(actual, field), getattr(expected, field)
        if isinstance(wanted, np.ndarray):
            assert_bitwise(value, wanted, field)
        else:
            assert value == wanted, f"{field}: {value} != {wanted}"  # ints, or None


def _weights(rng, shape) -> np.ndarray:
    """float32 weights with +-0, +-inf and a NaN payload: place copies bits."""
    weights = rng.standard_normal(shape).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf], np.float32)
    specials = np.append(specials, np.array([0x7FC01234], np.uint32).view(np.float32))
    pick = rng.random(shape) < 0.1
    weights[pick] = rng.choice(specials, int(pick.sum()))
    return weights


def _check_plan(ids: np.ndarray, num_experts: int, tile_m: int, weights) -> None:
    expected = ref.moe_plan(ids, num_experts, weights=weights, tile_m=tile_m)
    actual = ocl.plan(ids, weights, num_experts, tile_m, ids.shape[-1])
    assert_plan_equal(actual, expected)


@st.composite
def plan_cases(draw):
    top_k = draw(st.one_of(st.sampled_from([1, 2]), st.integers(1, 16)))
    block = launch.PLAN_BLOCK  # the second branch takes more than one block
    tokens = draw(st.one_of(st.integers(0, 48),
                            st.integers(block // top_k + 1, 3 * block // top_k)))
    num_experts = draw(experts_strategy())
    tile_m = draw(st.one_of(st.just(1), st.integers(1, 128), st.sampled_from([4, 16, 64, 128])))
    mode = draw(st.sampled_from(["uniform", "one_expert", "few_experts", "distinct_per_token",
                                 "duplicates"]))
    skip_rate = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    invalid_rate = min(draw(st.sampled_from([0.0, 0.1, 0.3])), 1.0 - skip_rate)
    # uint32 as routers give them (no skips; invalid ids up to 2**32 - 1).
    id_dtype = draw(st.sampled_from(["int32", "uint32"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = make_ids(rng, (tokens, top_k), num_experts, id_dtype, mode, skip_rate, invalid_rate)
    weights = _weights(rng, ids.shape) if draw(st.booleans()) else None
    return ids, num_experts, tile_m, weights


@given(case=plan_cases())
def test_plan_matches_reference(case):
    _check_plan(*case)


def _tokens_of(expert_of_entry, tokens: int, top_k: int) -> np.ndarray:
    return np.asarray(expert_of_entry, np.int32).reshape(tokens, top_k)


# Cases every run takes, whatever Hypothesis draws: (ids, E, tile_m).
_rng = np.random.default_rng(7)
PLAN_EDGES = {
    # every sub-block counter of expert 1 reaches 32, in 4 blocks
    "one_expert_owns_all": (_tokens_of(np.ones(2000), 1000, 2), 3, 1),
    "all_skipped": (_tokens_of(np.full(600, -1), 600, 1), 5, 4),
    "all_invalid": (_tokens_of(_rng.integers(9, INT32_MAX, 700), 350, 2), 9, 1),
    # uint32 ids from 2**31 on are invalid, not skipped (negative as int32)
    "uint32_past_int32": (_rng.choice(np.array([0, 5, 6, 2**31, 2**31 + 5, 2**32 - 1], np.uint32),
                                      1200).reshape(600, 2), 6, 1),
    "one_expert_e1": (_tokens_of(_rng.integers(-1, 2, 1100), 550, 2), 1, 3),
    "same_expert_k16": (_tokens_of(np.repeat(_rng.integers(0, 4, 100), 16), 100, 16), 4, 16),
    "max_experts_tile128": (_tokens_of(_rng.integers(-1, 1025, 1600), 100, 16), 1024, 128),
    "max_experts_tile1": (_tokens_of(_rng.integers(0, 1024, 1600), 1600, 1), 1024, 1),
    # 21 groups: phase 1's 8-wide unrolled reads run 2 full rounds and a partial one
    "twenty_one_blocks": (_tokens_of(_rng.integers(-1, 70, 10700), 1070, 10), 64, 8),
}


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("case", PLAN_EDGES, ids=list(PLAN_EDGES))
def test_plan_edge_cases(case, weighted):
    ids, num_experts, tile_m = PLAN_EDGES[case]
    weights = _weights(np.random.default_rng(1), ids.shape) if weighted else None
    _check_plan(ids, num_experts, tile_m, weights)


# (case, cap): every case in chunks of all its blocks and of about half of
# them; 21 blocks under a cap of 4 make chunks of 6, 6, 6 and 3.
CHUNKED = [(case, cap) for case in ("one_expert_owns_all", "one_expert_e1", "max_experts_tile1",
                                    "twenty_one_blocks") for cap in (1, 2)]


@pytest.mark.parametrize("case, max_groups", CHUNKED + [("twenty_one_blocks", 4)])
def test_plan_groups_place_several_blocks(case, max_groups):
    """Past PLAN_MAX_GROUPS blocks, a group places a chunk of blocks in turn."""
    ids, num_experts, tile_m = PLAN_EDGES[case]
    with launch.plan_max_groups(max_groups):  # a lowered cap: chunks of several blocks
        plan_launch = launch.plan_launch(ids.size, num_experts, tile_m, ids.shape[-1], True)
        assert plan_launch.groups <= max_groups and plan_launch.params.blocks_per_group > 1
        _check_plan(ids, num_experts, tile_m, _weights(np.random.default_rng(2), ids.shape))


@given(case=plan_cases(), max_groups=st.integers(1, 3))
def test_plan_chunks_match_reference(case, max_groups):
    with launch.plan_max_groups(max_groups):  # per example: not a fixture's scope
        _check_plan(*case)


def test_device_runs_the_plan_groups():
    """The plan runs groups of PLAN_BLOCK threads."""
    plan_launch = launch.plan_launch(1, 1, 1, 1, True)
    limit = ocl.max_group_size("plan", plan_launch.template)
    assert limit >= plan_launch.group_size, (
        f"{ocl.device().name} runs groups of at most {limit}: the plan needs "
        f"{plan_launch.group_size}")


# --- gather ----------------------------------------------------------------------


def _check_gather(src, index, out_dtype):
    # The kernel's index as the reference's plan: a row of src for each out row.
    rows = SimpleNamespace(row_tokens=_present(index, src.shape[0]), capacity=index.shape[0])
    expected = reference_gather(src, rows, out_dtype)
    assert_bitwise(ocl.gather(src, index, out_dtype), expected, "out")


@given(in_dtype=st.sampled_from(NAMES), out_dtype=st.sampled_from(NAMES),
       hidden=st.sampled_from(GATHER_HIDDEN), num_src=st.integers(0, 40),
       num_rows=st.integers(0, 80), invalid_rate=st.sampled_from([0.0, 0.1, 0.5]),
       seed=st.integers(0, 2**32 - 1))
def test_gather_matches_reference(in_dtype, out_dtype, hidden, num_src, num_rows, invalid_rate,
                                  seed):
    rng = np.random.default_rng(seed)
    src = _gather_values(rng, (num_src, hidden), in_dtype)
    _check_gather(src, _index(rng, (num_rows,), num_src, invalid_rate), out_dtype)


@pytest.mark.parametrize("hidden", [3, 8], ids=["element_path", "vector_path_if_same_dtype"])
@pytest.mark.parametrize("out_dtype", NAMES)
@pytest.mark.parametrize("in_dtype", NAMES)
def test_gather_every_dtype_pair(in_dtype, out_dtype, hidden):
    rng = np.random.default_rng(3)
    src = _gather_values(rng, (20, hidden), in_dtype)
    _check_gather(src, _index(rng, (50,), 20, 0.2), out_dtype)


def _nan_payloads(name: str) -> np.ndarray:
    """Quiet and signalling NaNs of both signs with payloads, as stored bits."""
    storage, exponent, mantissa = _BITS[name]
    sign = np.iinfo(storage).max ^ (exponent | mantissa)
    payloads = [1, 3, mantissa, mantissa >> 1, (mantissa >> 1) + 1, 0x15 & mantissa]
    bits = [exponent | payload | s for payload in payloads for s in (0, sign)]
    return np.array(bits, storage)


@pytest.mark.parametrize("hidden", [
    pytest.param(8, id="vector_path"),
    pytest.param(3, id="element_path"),
])
@pytest.mark.parametrize("name", NAMES)
def test_gather_copies_nan_payloads(name, hidden):
    """A same-dtype gather moves bits, NaN payloads included, on both paths."""
    bits = _nan_payloads(name)
    src = _stored(np.resize(bits, (4, hidden)), name)
    _check_gather(src, np.array([3, -1, 0, 2, 1], np.int32), name)


def test_buffers_take_the_vector_path():
    """gather checks IS_ALIGNED16 at run time and falls back to elements: the
    vector path runs here only because OpenCL buffers start 16-byte aligned."""
    assert ocl.device().mem_base_addr_align >= 128  # bits


@pytest.mark.parametrize("hidden", [8, 136])
@pytest.mark.parametrize("name", NAMES)
def test_unaligned_buffers_take_the_element_paths(name, hidden):
    """Widths whose rows would be copied as vectors, with every buffer taken as
    unaligned (as MLX views sliced past their first element reach a GPU): gather
    and combine fall back to elements, bit for bit the same."""
    rng = np.random.default_rng(hidden)
    index = _index(rng, (30, 3), 20, 0.2)
    weights = rng.standard_normal(index.shape).astype(np.float32)
    with ocl.unaligned_buffers():
        _check_gather(_gather_values(rng, (20, hidden), name), index[:, 0], name)
        _check_combine(_combine_values(rng, (20, hidden), name), index, weights, name)


# --- combine ---------------------------------------------------------------------


def _check_combine(src, index, weights, out_dtype):
    # The kernel's index as the reference's plan: for each out row, its fan_in
    # rows of src; unweighted, each with weight 1.
    rows = SimpleNamespace(positions=_present(index, src.shape[0]), top_k=index.shape[1],
                           row_weights=None)
    weights = np.ones(index.shape, np.float32) if weights is None else weights
    expected = reference_combine(src, rows, weights, out_dtype)
    assert_bitwise(ocl.combine(src, index, weights, out_dtype), expected, "out")


@given(in_dtype=st.sampled_from(NAMES), out_dtype=st.sampled_from(NAMES),
       hidden=st.sampled_from(COMBINE_HIDDEN),
       fan_in=st.one_of(st.sampled_from([1, 2]), st.integers(1, 16)),
       num_src=st.integers(0, 40), num_out=st.integers(0, 40), weighted=st.booleans(),
       invalid_rate=st.sampled_from([0.0, 0.1, 0.5]), seed=st.integers(0, 2**32 - 1))
def test_combine_matches_reference(in_dtype, out_dtype, hidden, fan_in, num_src, num_out,
                                   weighted, invalid_rate, seed):
    rng = np.random.default_rng(seed)
    src = _combine_values(rng, (num_src, hidden), in_dtype)
    index = _index(rng, (num_out, fan_in), num_src, invalid_rate)
    weights = None
    if weighted:
        weights = rng.standard_normal(index.shape).astype(np.float32)
        weights[rng.random(index.shape) < 0.1] = -0.0
    _check_combine(src, index, weights, out_dtype)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("name", NAMES)
def test_combine_every_dtype(name, weighted):
    rng = np.random.default_rng(5)
    src = _combine_values(rng, (30, 129), name)
    index = _index(rng, (25, 10), 30, 0.2)
    weights = rng.standard_normal(index.shape).astype(np.float32) if weighted else None
    _check_combine(src, index, weights, name)


# --- more rows than groups ---------------------------------------------------------


def test_rows_beyond_max_groups():
    """Past MAX_GROUPS groups, each group loops over more rows (gather: more
    runs of GATHER_ROWS rows, the last one partial)."""
    rng = np.random.default_rng(11)
    src = _combine_values(rng, (50, 3), "float32")
    index = _index(rng, (launch.GATHER_ROWS * launch.MAX_GROUPS + 1001,), 50, 0.1)
    _check_gather(src, index, "float16")
    _check_gather(_combine_values(rng, (50, 8), "float32"), index, "float32")  # 16-byte vectors
    num_out = launch.MAX_GROUPS + 1000
    _check_combine(src, index[:num_out, None], None, "bfloat16")
    pairs = _index(rng, (num_out, 2), 50, 0.1)
    _check_combine(src, pairs, rng.standard_normal(pairs.shape).astype(np.float32), "float32")


# --- grouped_qmm: a GEMM, checked within float tolerance ----------------------------


def _grouped_qmm(offsets, weight, scales, biases, rows, row_experts, bits, group_size, name):
    """ocl.grouped_qmm as check_grouped_qmm calls an implementation (the harness
    reads the experts from the offsets and the dtype from the rows)."""
    return ocl.grouped_qmm(rows, weight, scales, biases, offsets, bits, group_size)


def _dense_qmm(offsets, weight, scales, biases, rows, row_experts, bits, group_size, name):
    """`_grouped_qmm` of one expert that is a dense projection (`dense`)."""
    return ocl.grouped_qmm(rows, weight, scales, biases, offsets, bits, group_size, dense=True)


@given(case=grouped_qmm_cases())
def test_grouped_qmm_matches_reference(case):
    seed, *arguments = case
    check_grouped_qmm(_grouped_qmm, np.random.default_rng(seed), *arguments)


@given(case=grouped_qmm_cases(), k_splits=st.sampled_from([2, 4]),
       steps=st.sampled_from([None, 1, 3]))
def test_grouped_qmm_split_matches_reference(case, k_splits, steps):
    """Warps sharing rows (K_SPLITS) over the same cases: rows of 1 to 4
    quantization groups, so shares of none, one or two groups."""
    seed, *arguments = case
    with launch.grouped_qmm_tiling(k_splits=k_splits, steps=steps):
        check_grouped_qmm(_grouped_qmm, np.random.default_rng(seed), *arguments)


@given(case=grouped_qmm_cases(), steps=st.sampled_from([1, 2, 3]))
def test_grouped_qmm_loads_ahead_match_reference(case, steps):
    """A pass's loads issued for the next pass (`loads_ahead`) over the same
    cases: every group size, bits and dtype, rows of 1 to 4 groups, so one
    pass or several, the last clamped."""
    seed, *arguments = case
    with launch.grouped_qmm_tiling(loads_ahead=1, steps=steps):
        check_grouped_qmm(_grouped_qmm, np.random.default_rng(seed), *arguments)


@given(case=grouped_qmm_cases(), stages=st.sampled_from([2, 3]),
       steps=st.sampled_from([None, 1, 3]), loads_ahead=st.sampled_from([None, 1]))
def test_grouped_qmm_word_ring_matches_reference(case, stages, steps, loads_ahead):
    """The words through a warp's ring in group memory (`word_stages`), rows
    and scales a pass ahead or not, over the same cases: every group size,
    bits and dtype, rows of 1 to 4 groups, so rows shorter than the ring's
    passes ahead, and a last stage partly past the row."""
    seed, *arguments = case
    with launch.grouped_qmm_tiling(word_stages=stages, steps=steps, loads_ahead=loads_ahead):
        check_grouped_qmm(_grouped_qmm, np.random.default_rng(seed), *arguments)


@pytest.mark.parametrize("active", [1, 300, MAX_EXPERTS])
def test_grouped_qmm_more_items_than_groups(active):
    """Every expert count up to MAX_EXPERTS, more (expert, columns) items than
    groups: the groups' lists of experts with rows, and their share of items."""
    rng = np.random.default_rng(active)
    counts = np.zeros(MAX_EXPERTS, np.int64)
    counts[rng.choice(MAX_EXPERTS, active, replace=False)] = rng.integers(1, 4, active)
    check_grouped_qmm(_grouped_qmm, rng, counts, 72, 32, 8, 32, "float16", 2)


@pytest.mark.parametrize("name", launch.GROUPED_QMM_DTYPES)
def test_grouped_qmm_unaligned_rows(name):
    """Rows, words and scales taken as unaligned (MLX views on a GPU) are read
    value by value, word by word."""
    rng = np.random.default_rng(23)
    with ocl.unaligned_buffers():
        for changes in ({}, {"word_stages": 2}):  # the ring's copies word by word
            with launch.grouped_qmm_tiling(**changes):
                check_grouped_qmm(_grouped_qmm, rng, [2, 0, 9, 1, 5], 40, 256, 4, 64, name, 3)
                check_grouped_qmm(_grouped_qmm, rng, [1, 3, 17], 9, 128, 8, 32, name, 0)


@pytest.mark.parametrize("steps,wide_loads", [(1, 1), (2, 1), (4, 0)])
def test_grouped_qmm_loads_ahead_change_no_bit(steps, wide_loads):
    """The next pass's loads issued before a pass's multiply-adds
    (`loads_ahead`) or a pass's own loads waited for: the same values in the
    same sums, the same bits, in one or several passes of a row (12 groups),
    with the scales in pairs and one by one."""
    rng = np.random.default_rng(steps)
    case = grouped_qmm_case(rng, [3, 0, 11, 1], 40, 12 * 64, 4, 64, "bfloat16", 3)
    outs = []
    for loads_ahead in (0, 1):
        with launch.grouped_qmm_tiling(steps=steps, wide_loads=wide_loads,
                                       loads_ahead=loads_ahead):
            outs.append(_grouped_qmm(*case, 4, 64, "bfloat16"))
    assert outs[1].shape == outs[0].shape and outs[1].tobytes() == outs[0].tobytes()
    offsets, weight, scales, biases, rows, _ = case
    assert_gemm_close(outs[1], rows, weight, scales, biases, offsets, 4, 64, "bfloat16")


@pytest.mark.parametrize("steps,stages", [(1, 2), (3, 3), (None, 4)])
def test_grouped_qmm_word_ring_over_passes(steps, stages):
    """The words through a warp's ring in group memory (`word_stages`) over a
    row of 12 groups: more passes than stages, so every stage is refilled,
    one group a pass, 3 (the last stage past the row), or a line of each
    column (4). Against the reference: PoCL's float sums of the same terms
    in the same order still differ between some code shapes in their last
    bits (one tile a warp in groups of 32 threads does too), so bits are
    compared on the GPU (tests/test_grouped_qmm.py)."""
    rng = np.random.default_rng(stages)
    case = grouped_qmm_case(rng, [3, 0, 11, 1], 40, 12 * 64, 4, 64, "bfloat16", 3)
    with launch.grouped_qmm_tiling(word_stages=stages, steps=steps):
        out = _grouped_qmm(*case, 4, 64, "bfloat16")
    offsets, weight, scales, biases, rows, _ = case
    assert_gemm_close(out, rows, weight, scales, biases, offsets, 4, 64, "bfloat16")


@pytest.mark.parametrize("bits", launch.GROUPED_QMM_BITS)
def test_grouped_qmm_wide_rows(bits):
    """A row of many quantization groups, loaded STEPS at a time."""
    check_grouped_qmm(_grouped_qmm, np.random.default_rng(bits), [2, 0, 9], 17, 2048, bits,
                      64, "bfloat16", 3)


def _check_fused(rng, counts, out_dims, in_dims, bits, group_size, name, tail, num_tokens,
                 by_token, gated, token_range=None, biased=False, clamped_swiglu=None):
    """grouped_qmm reading the rows from the tokens (`by_token`: TOKEN_ROWS),
    computing silu(gate) * up (`gated`: GATED), or both; with `biased`, each
    projection's bias added (OUT_BIAS), with `clamped_swiglu` gpt-oss's
    activation for silu's (CLAMPED). Tokens drawn from `token_range`
    (default: the tokens) are clamped into them, as a broken plan's would be.
    Returns the float64 reference of the projections' sums (biases added),
    gate's then up's, on the expert rows."""
    case = grouped_qmm_case(rng, counts, out_dims, in_dims, bits, group_size, name, tail)
    offsets, weight, scales, biases, _, _ = case
    entries = int(offsets[-1])
    low, high = token_range or (0, num_tokens - 1)
    # float16's products silu(gate) * up of 8-bit sums overflow with unit
    # tokens; bfloat16's reach silu's far tails (exp(-gate) overflowing).
    scale = 0.01 if name == "float16" else 1.0
    values = scale * rng.standard_normal((num_tokens, in_dims))
    tokens = ref.from_float32(values.astype(np.float32), name)
    row_tokens = np.concatenate([rng.integers(low, high + 1, entries),
                                 np.full(tail, -1)]).astype(np.int32)
    clamped = row_tokens.copy()
    clamped[:entries] = np.clip(row_tokens[:entries], 0, num_tokens - 1)
    rows = token_rows(tokens, clamped)
    up = quantized_experts(rng, len(counts), out_dims, in_dims, bits, group_size, name) \
        if gated else None
    out_biases = tuple(ref.from_float32(rng.standard_normal((len(counts), out_dims)).astype(
        np.float32), name) for _ in range(1 + gated)) if biased else None
    out = ocl.grouped_qmm(tokens if by_token else rows, weight, scales, biases, offsets, bits,
                          group_size, row_tokens=row_tokens if by_token else None, up=up,
                          out_biases=out_biases, clamped_swiglu=clamped_swiglu)
    assert_gemm_close(out, rows, weight, scales, biases, offsets, bits, group_size, name, up=up,
                      out_biases=out_biases, clamped_swiglu=clamped_swiglu)
    row_experts = np.repeat(np.arange(len(counts)), counts)
    return [ref.grouped_qmm(rows, *matrices, offsets, bits, group_size, name)[:entries]
            + (0 if out_biases is None else ref.to_float32(bias, name)[row_experts])
            for matrices, bias in zip([(weight, scales, biases)] + ([up] if gated else []),
                                      out_biases or (None, None))]


# The fused forms' cases: experts without rows, with a few, with more than a
# pass; columns past a tile's; one to three quantization groups a row.
_FUSED_CASES = dict(
    counts=st.lists(st.one_of(st.integers(0, 3), st.integers(0, 20)), min_size=1, max_size=5),
    out_dims=st.one_of(st.sampled_from([1, 7, 8, 9, 17]), st.integers(1, 40)),
    in_groups=st.integers(1, 3), bits=st.sampled_from(launch.GROUPED_QMM_BITS),
    group_size=st.sampled_from(launch.GROUPED_QMM_QUANT_GROUPS),
    name=st.sampled_from(launch.GROUPED_QMM_DTYPES), tail=st.integers(0, 9),
    seed=st.integers(0, 2**32 - 1))


@given(**_FUSED_CASES, num_tokens=st.integers(1, 6),
       fusion=st.sampled_from(["tokens", "gated", "both"]))
def test_grouped_qmm_fused_matches_reference(counts, out_dims, in_groups, bits, group_size,
                                             name, tail, num_tokens, fusion, seed):
    """The layer's fusions: rows read from the tokens through the plan's
    row_tokens, and SwiGLU of a gate and an up projection, apart and together."""
    _check_fused(np.random.default_rng(seed), counts, out_dims, in_groups * group_size, bits,
                 group_size, name, tail, num_tokens, fusion != "gated", fusion != "tokens")


@given(**_FUSED_CASES, form=st.sampled_from(["bias", "gated", "clamped"]),
       limit=st.sampled_from([0.5, 2.0, 7.0]), by_token=st.booleans())
def test_grouped_qmm_biases_and_clamped_swiglu_match_reference(
        counts, out_dims, in_groups, bits, group_size, name, tail, form, limit, by_token, seed):
    """Each projection's bias in the sums (one projection, or gate and up),
    and gpt-oss's clamped SwiGLU of biased gate and up (the clamps reached:
    limits down to 0.5), as its layer runs them in one launch."""
    _check_fused(np.random.default_rng(seed), counts, out_dims, in_groups * group_size, bits,
                 group_size, name, tail, 4, by_token, form != "bias", biased=True,
                 clamped_swiglu=(1.702, limit) if form == "clamped" else None)


# gpt-oss's fused gate and up in each body: the body, the experts' rows and
# the tiling that takes it (the block tiles from 0 rows an expert, in tall
# blocks from 16; the made weights' block of 160 rows, the rule's for
# gpt-oss-20b's chunks of 2048 tokens).
CLAMPED_FORMS = {
    "grouped_qmm": ("grouped_qmm", [3, 0, 5, 1],
                    dict(tiles_from_rows=10**6, block_gated_tall_rows=16)),
    "grouped_qmm_tiles": ("grouped_qmm_tiles", [40, 0, 75, 9],
                          dict(tiles_from_rows=0, block_gated_tall_rows=16)),
    "made_weights": ("grouped_qmm_tiles", [170, 0, 75, 9],
                     dict(launch.SHARED_WEIGHTS_TILING, tiles_from_rows=0, block_row_tiles=20,
                          block_gated_row_tiles=20))}


@pytest.mark.parametrize("form", list(CLAMPED_FORMS))
def test_grouped_qmm_clamped_swiglu_in_each_body(form):
    """gpt-oss's fused gate and up, biased, in each body (`CLAMPED_FORMS`;
    in the made weights' block its down projection's bias too): the clamps
    reached, the gate's from above and up's both ways."""
    rng = np.random.default_rng(53)
    body, counts, changes = CLAMPED_FORMS[form]
    with launch.grouped_qmm_tiling(**changes):
        assert launch.grouped_qmm_body(sum(counts) + 3, 4) == body
        made = dict(launch.grouped_qmm_launch(4, 128, 72, sum(counts) + 3, 4, 64, "bfloat16",
                                              backend="opencl", gated=True).template)
        assert made.get("SHARED_WEIGHTS", False) == (form == "made_weights")
        gate, up = _check_fused(rng, counts, 72, 128, 4, 64, "bfloat16", 3, 6, True, True,
                                biased=True, clamped_swiglu=(1.702, 2.0))
        if form == "made_weights":
            _check_fused(rng, counts, 72, 128, 4, 64, "bfloat16", 3, 6, False, False,
                         biased=True)
    assert (gate > 2.0).any() and (up > 2.0).any() and (up < -2.0).any()


@pytest.mark.parametrize("gated", [False, True], ids=["tokens", "gated"])
def test_grouped_qmm_fused_wide_rows(gated):
    """Rows of more than 32 quantization groups, where the default tiling
    loads 2 groups a pass, the next pass's before this one's multiply-adds
    (launch.grouped_qmm_loads), 33 of them: the last pass clamped into the
    row; from 64 groups, 4 a pass, waited for."""
    in_dims = 33 * 64
    assert launch.grouped_qmm_loads(in_dims // 64, gated) == (2, True)
    assert launch.grouped_qmm_loads(64, gated) == (4, False)
    assert launch.grouped_qmm_loads(32, gated) == (2 if gated else 1, False)
    assert launch.GROUPED_QMM_TILING.steps is None
    _check_fused(np.random.default_rng(37), [2, 0, 5], 17, in_dims, 4, 64, "bfloat16", 2, 3,
                 True, gated)


def test_grouped_qmm_token_rows_stay_inside():
    """Tokens of a broken plan, negative or past the last, read the nearest
    token inside, never outside the array."""
    rng = np.random.default_rng(29)
    _check_fused(rng, [3, 0, 12, 1], 24, 128, 4, 64, "bfloat16", 2, 4, True, True,
                 token_range=(-50, 60))


@pytest.mark.parametrize("changes", [dict(gated_tiles=1),
                                     dict(gated_tiles=3, row_tiles=2, steps=2),
                                     dict(threads=32, max_groups=1), dict(wide_loads=0),
                                     dict(steps=4), dict(loads_ahead=1, steps=1),
                                     dict(loads_ahead=1, steps=4, wide_loads=0),
                                     dict(word_stages=2), dict(word_stages=3, gated_tiles=1)],
                         ids=["gated_tiles=1", "gated_tiles=3,row_tiles=2,steps=2",
                              "threads=32,max_groups=1", "wide_loads=0", "steps=4",
                              "loads_ahead=1,steps=1", "loads_ahead=1,steps=4,wide_loads=0",
                              "word_stages=2", "word_stages=3,gated_tiles=1"])
def test_grouped_qmm_fused_tilings(changes):
    rng = np.random.default_rng(31)
    with launch.grouped_qmm_tiling(**changes):
        _check_fused(rng, [2, 0, 9, 1, 5], 40, 256, 4, 64, "bfloat16", 3, 7, True, True)
        _check_fused(rng, [1, 3, 17], 9, 128, 8, 32, "float16", 0, 5, True, True)


# The tilings `python -m benchmarks.grouped_qmm --tilings` may compare: each one
# must give the reference's sums before it is worth timing.
TILINGS = [dict(tiles=1), dict(steps=1), dict(tiles=4, steps=4), dict(row_tiles=2),
           dict(threads=256, tiles=1), dict(threads=32), dict(max_groups=1),
           dict(steps=3),  # groups of a row not a multiple of STEPS: the last run clamped
           dict(wide_loads=0), dict(steps=2), dict(steps=4, wide_loads=0),
           dict(k_splits=1), dict(k_splits=2), dict(k_splits=4, steps=1),
           # shares of one group and of none (4 groups a row, 8 sets)
           dict(threads=256, k_splits=8, steps=1),
           # the next pass's loads first: one group a pass, and 3 (the last clamped)
           dict(loads_ahead=1), dict(loads_ahead=1, steps=3), dict(loads_ahead=1, k_splits=4),
           # the words through a ring in group memory: a line a column's stage,
           # 3 groups a stage (the last clamped), one tile (16 columns) a warp
           dict(word_stages=2), dict(word_stages=3, steps=3), dict(word_stages=4, tiles=1),
           dict(word_stages=3, row_tiles=2, threads=64),
           # ... and rows and scales a pass ahead too
           dict(word_stages=2, loads_ahead=1), dict(word_stages=3, loads_ahead=1, steps=3)]


@pytest.mark.parametrize("changes", TILINGS,
                         ids=[",".join(f"{k}={v}" for k, v in t.items()) for t in TILINGS])
def test_grouped_qmm_tilings(changes):
    rng = np.random.default_rng(17)
    with launch.grouped_qmm_tiling(**changes):
        check_grouped_qmm(_grouped_qmm, rng, [2, 0, 9, 1, 5], 40, 256, 4, 64, "bfloat16", 3)
        check_grouped_qmm(_grouped_qmm, rng, [1, 3, 17], 9, 128, 8, 32, "float16", 0)


@pytest.mark.parametrize("changes", [dict(k_splits=2), dict(k_splits=4), dict(k_splits=4, steps=3),
                                     dict(threads=256, k_splits=8, row_tiles=2),
                                     dict(k_splits=4, steps=2, loads_ahead=1), dict(word_stages=3)],
                         ids=["k_splits=2", "k_splits=4", "k_splits=4,steps=3",
                              "threads=256,k_splits=8,row_tiles=2",
                              "k_splits=4,steps=2,loads_ahead=1", "word_stages=3"])
@pytest.mark.parametrize("fusion", ["none", "tokens", "both"])
def test_grouped_qmm_split_rows(changes, fusion):
    """Warps sharing a row's quantization groups (K_SPLITS): 45 groups, so the
    last share is shorter and its last steps lie past the row; the sums added
    in set order, the tail's zeros shared by the sets."""
    rng = np.random.default_rng(41)
    with launch.grouped_qmm_tiling(**changes):
        if fusion == "none":
            check_grouped_qmm(_grouped_qmm, rng, [3, 0, 11, 1], 40, 45 * 64, 4, 64,
                              "bfloat16", 5)
            check_grouped_qmm(_grouped_qmm, rng, [9], 24, 45 * 32, 8, 32, "float16", 0)
        else:
            _check_fused(rng, [2, 0, 9], 17, 45 * 64, 4, 64, "bfloat16", 3, 5, True,
                         fusion == "both")


def test_grouped_qmm_word_ring_fits_the_backend():
    """The ring (`word_stages`) takes a line of each column a stage where the
    tiling leaves steps to the launch, and gives up stages, then length,
    until it fits the backend's group memory; where none fits, each lane
    loads its own words. It takes rows unsplit, and nothing else ahead."""
    def ring(backend, gated=False, bits=4, group=64, **changes):
        with launch.grouped_qmm_tiling(word_stages=3, **changes):
            qmm = launch.grouped_qmm_launch(128, 2048, 768, 64, bits, group, "bfloat16",
                                            backend=backend, gated=gated)
        template = dict(qmm.template)
        assert template["K_SPLITS"] == 1 and not template["LOADS_AHEAD"]  # unless asked
        return template["WORD_STAGES"], template["STEPS"], qmm.shared_bytes

    # A line: 4 groups of 32 bytes; 3 stages of 32 columns, strides of 40 words.
    assert ring("cuda") == (3, 4, 4 * 4 * 3 * 32 * 40)
    assert ring("cuda", gated=True)[:2] == (2, 4)  # 64 columns: 2 stages fit 99 KB
    assert ring("cuda", steps=2)[:2] == (3, 2)  # the tiling's steps stay
    assert ring("metal")[:2] == (2, 2)  # 32 KB: 2 stages of 2 groups
    assert ring("metal", bits=8, group=128) == (0, 1, 0)  # none fits: the lanes' own loads
    for wrong in (dict(word_stages=1), dict(word_stages=2, k_splits=2)):
        with pytest.raises(ValueError, match="word_stages"):
            launch.GroupedQmmTiling(**wrong).check()


def test_grouped_qmm_splits_few_items():
    """The launch splits rows where its items are few: one expert of a dense
    projection's columns (a decoding batch's rows), and not the layer's
    experts at the rule's sizes, nor a wide projection."""
    def splits(experts, in_dims, out_dims, capacity, gated=False):
        qmm = launch.grouped_qmm_launch(experts, in_dims, out_dims, capacity, 4, 64, "bfloat16",
                                        backend="cuda", gated=gated)
        return dict(qmm.template)["K_SPLITS"]

    assert splits(1, 2048, 4096, 8) == 4 and splits(1, 2880, 512, 16) == 4
    assert splits(1, 2048, 151936, 8) == 1  # an lm_head: its columns fill the GPU
    assert splits(128, 2048, 768, 64) == 1 and splits(128, 2048, 768, 64, gated=True) == 1
    assert splits(1, 256, 4096, 8) == 1  # 4 groups a row: nothing to share
    assert launch.grouped_qmm_loads(32, False, k_splits=4) == (4, False)


def test_grouped_qmm_loads_by_row():
    """The launch loads by the row's length (launch.grouped_qmm_loads): 2
    groups a pass loaded ahead on gpt-oss-20b's 45, 1 waited for on 32 and 4
    on 64; a tiling's steps take the row's loads ahead away, its loads_ahead
    sets them."""
    def loads(in_dims, experts=32, **changes):
        with launch.grouped_qmm_tiling(**changes):
            qmm = launch.grouped_qmm_launch(experts, in_dims, 2880, 64, 4, 64, "bfloat16",
                                            backend="cuda")
        template = dict(qmm.template)
        return template["STEPS"], template["LOADS_AHEAD"]

    assert loads(2880) == (2, True) and loads(2048) == (1, False) and loads(4096) == (4, False)
    assert loads(2880, steps=4) == (4, False) and loads(2880, steps=4, loads_ahead=1) == (4, True)
    assert loads(2048, loads_ahead=1) == (1, True) and loads(2880, loads_ahead=0) == (2, False)


def test_grouped_qmm_split_sums_fit_group_memory():
    """A tiling whose sets' sums would pass a backend's group memory is
    refused by name, before any kernel is built (Metal's 32 KB here)."""
    with launch.grouped_qmm_tiling(threads=256, k_splits=8, gated_tiles=2, row_tiles=2):
        launch.grouped_qmm_launch(4, 2048, 512, 64, 4, 64, "bfloat16", backend="cuda",
                                  gated=True)
        with pytest.raises(ValueError, match="k_splits=8.*group memory gated"):
            launch.grouped_qmm_launch(4, 2048, 512, 64, 4, 64, "bfloat16", backend="metal",
                                      gated=True)


# --- grouped_qmm_tiles: the same GEMM in block tiles (prefill sizes) -------------------
# Forced here at any size (tiles_from_rows=0): the block's row and column
# edges, experts of no row and of more than a block, the tail, every bit
# width, group and dtype, the fusions, unaligned inputs and the other blocks.


@given(case=grouped_qmm_cases())
def test_grouped_qmm_tiles_matches_reference(case):
    seed, *arguments = case
    with launch.grouped_qmm_tiling(tiles_from_rows=0):
        check_grouped_qmm(_grouped_qmm, np.random.default_rng(seed), *arguments)


@pytest.mark.parametrize("bits,group_size,name", [(4, 64, "bfloat16"), (8, 32, "float16"),
                                                  (4, 128, "float16"), (8, 128, "bfloat16")])
def test_grouped_qmm_tiles_blocks(bits, group_size, name):
    """Experts past one block of rows (64) and columns past one block (128),
    a row of several stages."""
    rng = np.random.default_rng(bits * group_size)
    with launch.grouped_qmm_tiling(tiles_from_rows=0):
        check_grouped_qmm(_grouped_qmm, rng, [70, 0, 3, 130, 64], 200, 4 * group_size, bits,
                          group_size, name, 5)


def _check_fusion(fusion, rng, counts, out_dims, in_dims, bits, group_size, name, tail,
                  num_tokens):
    """One projection of expert-sorted rows (`fusion` "none"), or `_check_fused`'s
    rows from `num_tokens` tokens ("tokens"), gate and up fused ("gated"), or
    both ("both")."""
    if fusion == "none":
        check_grouped_qmm(_grouped_qmm, rng, counts, out_dims, in_dims, bits, group_size, name,
                          tail)
    else:
        _check_fused(rng, counts, out_dims, in_dims, bits, group_size, name, tail, num_tokens,
                     fusion != "gated", fusion != "tokens")


def tiles_cases(in_groups: st.SearchStrategy) -> dict:
    """The block tiles' Hypothesis arguments: experts of no row, of a few and
    past a block (64 rows), columns past a block's last tile, `in_groups`
    quantization groups a row, every format, tail rows."""
    return dict(counts=st.lists(st.one_of(st.integers(0, 3), st.integers(0, 80)), min_size=1,
                                max_size=4),
                out_dims=st.integers(1, 40), in_groups=in_groups,
                bits=st.sampled_from(launch.GROUPED_QMM_BITS),
                group_size=st.sampled_from(launch.GROUPED_QMM_QUANT_GROUPS),
                name=st.sampled_from(launch.GROUPED_QMM_DTYPES), tail=st.integers(0, 9),
                seed=st.integers(0, 2**32 - 1))


@given(**tiles_cases(st.integers(1, 3)), num_tokens=st.integers(1, 6),
       fusion=st.sampled_from(["tokens", "gated", "both"]))
def test_grouped_qmm_tiles_fused(counts, out_dims, in_groups, bits, group_size, name, tail,
                                 num_tokens, fusion, seed):
    with launch.grouped_qmm_tiling(tiles_from_rows=0):
        _check_fused(np.random.default_rng(seed), counts, out_dims, in_groups * group_size,
                     bits, group_size, name, tail, num_tokens, fusion != "gated",
                     fusion != "tokens")


@pytest.mark.parametrize("name", launch.GROUPED_QMM_DTYPES)
def test_grouped_qmm_tiles_unaligned(name):
    """Unaligned rows and words are copied value by value, word by word."""
    rng = np.random.default_rng(41)
    with launch.grouped_qmm_tiling(tiles_from_rows=0), ocl.unaligned_buffers():
        check_grouped_qmm(_grouped_qmm, rng, [2, 0, 70, 1], 40, 256, 4, 64, name, 3)
        _check_fused(rng, [3, 0, 66], 24, 128, 8, 32, name, 2, 4, True, True,
                     token_range=(-50, 60))


# Each block as it says, not fitted to the few rows an expert holds here
# (test_grouped_qmm_tiles_other_blocks turns _fitted_row_tiles off): the
# default's 64 rows among them, which the rule takes from 50 rows an expert.
TILES_BLOCKS = [dict(block_row_tiles=8), dict(block_row_tiles=2),
                dict(block_row_warps=4, block_row_tiles=1),
                dict(block_column_warps=1, block_tiles=1, block_gated_tiles=1),
                dict(block_stages=3), dict(block_stages=4, block_row_tiles=1),
                dict(block_stage_values=256, block_row_tiles=1),
                dict(block_stage_values=64), dict(block_stage_values=192),
                dict(block_row_warps=2, block_column_warps=2, block_tiles=4,
                     block_gated_tiles=2, block_row_tiles=4),
                # the default block's rows and columns over twice its warps, each
                # holding half its sums (the `fewer-sums` step of gpu_suite.sh)
                dict(block_row_warps=2, block_row_tiles=4),
                dict(block_column_warps=8, block_tiles=1),
                # blocks of as many 8-row tiles as an expert's rows fill at Qwen3-Next's
                # 40 rows an expert, not a power of two (the `few-rows` step; 6,
                # 48 rows, the rule's there)
                dict(block_row_tiles=3, block_gated_row_tiles=3),
                dict(block_row_tiles=5, block_gated_row_tiles=5),
                dict(block_row_tiles=6, block_gated_row_tiles=6),
                dict(block_row_tiles=7, block_gated_row_tiles=7),
                dict(block_max_groups=1), dict(block_least_groups=1),
                # Hopper's warpgroup multiply-add, emulated (tiles_products.h)
                dict(block_warpgroup=1), dict(block_warpgroup=1, block_stage_values=192),
                # the weights made 16-bit in shared memory (SHARED_WEIGHTS): one
                # warpgroup and two, blocks of 64 and 128 rows
                dict(SHARED_WEIGHTS_BLOCK, block_row_tiles=8, block_gated_row_tiles=8),
                dict(SHARED_WEIGHTS_BLOCK, block_column_warps=8, block_stage_values=192),
                launch.SHARED_WEIGHTS_TILING]


@pytest.mark.parametrize("changes", TILES_BLOCKS,
                         ids=[",".join(f"{k}={v}" for k, v in t.items()) for t in TILES_BLOCKS])
def test_grouped_qmm_tiles_other_blocks(changes):
    rng = np.random.default_rng(43)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_fitted_rows=0, **changes):
        check_grouped_qmm(_grouped_qmm, rng, [2, 0, 90, 1, 5], 40, 256, 4, 64, "bfloat16", 3)
        _check_fused(rng, [1, 3, 70], 9, 128, 8, 32, "float16", 0, 5, True, True)


@given(**tiles_cases(st.integers(1, 3)), num_tokens=st.integers(1, 6),
       fusion=st.sampled_from(["none", "tokens", "gated", "both"]), tall=st.booleans(),
       shared_weights=st.booleans())
def test_grouped_qmm_tiles_warpgroup(counts, out_dims, in_groups, bits, group_size, name, tail,
                                     num_tokens, fusion, tall, shared_weights, seed):
    """The block's multiply-adds as one warpgroup's (`block_warpgroup=1`,
    WARPGROUP_MMA emulated as prelude_cuda.h's wgmma computes it), the rows
    staged in its core matrices, or with the weights made 16-bit in shared
    memory (`block_warpgroup=2`, SHARED_WEIGHTS: WARPGROUP_MMA_SS reading A's
    core matrices as the made weights lie): every format, each fusion,
    blocks of 64 rows (half-empty ones multiply half) and the tall gated ones
    of 128."""
    rng = np.random.default_rng(seed)
    block = (dict(SHARED_WEIGHTS_BLOCK, block_row_tiles=8) if shared_weights
             else dict(block_warpgroup=1))
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_gated_tall_rows=0 if tall else 512,
                                   **block):
        qmm = launch.grouped_qmm_launch(len(counts), in_groups * group_size, out_dims,
                                        sum(counts) + tail, bits, group_size, name,
                                        backend="opencl", gated=fusion in ("gated", "both"))
        template = dict(qmm.template)
        # SHARED_WEIGHTS takes stages of whole slabs of 64 values, where the
        # row's groups make them; else the warps' own multiply-adds
        slabs = template["STAGE_GROUPS"] * group_size % 64 == 0
        assert template["SHARED_WEIGHTS"] == (shared_weights and slabs)
        assert template["WARPGROUP"] == (not shared_weights or slabs)
        _check_fusion(fusion, rng, counts, out_dims, in_groups * group_size, bits, group_size,
                      name, tail, num_tokens)


# The blocks a run of items crosses: the warps' own multiply-adds (the
# default block), the warpgroup's, and the made weights' (64 rows) with their
# weights made in the step or a step ahead.
ACROSS_BLOCKS = {"own": {}, "warpgroup": dict(block_warpgroup=1),
                 "made": dict(SHARED_WEIGHTS_BLOCK, block_row_tiles=8, block_gated_row_tiles=8),
                 "made-ahead": dict(SHARED_WEIGHTS_BLOCK, block_row_tiles=8,
                                    block_gated_row_tiles=8, block_weights_ahead=1)}


@given(**tiles_cases(st.integers(1, 3)), num_tokens=st.integers(1, 6),
       fusion=st.sampled_from(["none", "tokens", "gated", "both"]),
       block=st.sampled_from(list(ACROSS_BLOCKS)), groups=st.integers(1, 3))
def test_grouped_qmm_tiles_across_items(counts, out_dims, in_groups, bits, group_size, name,
                                        tail, num_tokens, fusion, block, groups, seed):
    """`block_across_items=1` (ACROSS_ITEMS): each group's items one run of
    stages, an item's first copies issued while the item before is
    multiplied and stored, over 1 to 3 groups (each then several items, up to
    every one): experts without rows, of a few and past a block, tail rows'
    zeros, runs of items of one stage each (the ring of their places past its
    length) and of several, each fusion, in each block."""
    rng = np.random.default_rng(seed)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_across_items=1,
                                   block_max_groups=groups, **ACROSS_BLOCKS[block]):
        qmm = launch.grouped_qmm_launch(len(counts), in_groups * group_size, out_dims,
                                        sum(counts) + tail, bits, group_size, name,
                                        backend="opencl", gated=fusion in ("gated", "both"))
        assert dict(qmm.template)["ACROSS_ITEMS"] and qmm.groups <= groups
        _check_fusion(fusion, rng, counts, out_dims, in_groups * group_size, bits, group_size,
                      name, tail, num_tokens)


def test_grouped_qmm_tiles_across_items_many_stages():
    """A run of items of 10 stages each (640 values in 64), past the stages'
    buffers, one group of every item and two, in the made weights' blocks of
    128 rows (two warpgroups) and the warps' own; and of one stage each, the
    copies two items ahead of the products; a launch whose input is split
    keeps its items apart (INPUT_SPLITS, ACROSS_ITEMS off)."""
    rng = np.random.default_rng(61)
    for block in (dict(launch.SHARED_WEIGHTS_TILING, block_stage_values=64),
                  dict(block_stage_values=64)):
        for groups in (1, 2):
            with launch.grouped_qmm_tiling(tiles_from_rows=0, block_across_items=1,
                                           block_max_groups=groups, **block):
                check_grouped_qmm(_grouped_qmm, rng, [130, 0, 20, 257, 1], 40, 640, 4, 64,
                                  "bfloat16", 5)
                _check_fused(rng, [129, 70, 0, 128, 1], 24, 640, 4, 64, "float16", 2, 5, True,
                             True)
    # items of one stage each in 3 stages: the copies run two items ahead of the products
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_across_items=1,
                                   block_max_groups=1, block_stages=3):
        assert dict(launch.grouped_qmm_launch(5, 64, 40, 420, 4, 64, "bfloat16",
                                              backend="opencl").template)["STAGES"] == 3
        check_grouped_qmm(_grouped_qmm, rng, [130, 0, 20, 257, 1], 40, 64, 4, 64, "bfloat16", 5)
    with launch.grouped_qmm_tiling(block_across_items=1, block_input_splits=2):
        split = dict(launch.grouped_qmm_launch(1, 1024, 256, 32, 4, 64, "bfloat16",
                                               backend="cuda", dense=True).template)
    assert split["INPUT_SPLITS"] == 2 and not split["ACROSS_ITEMS"]


def test_grouped_qmm_tiles_warpgroup_needs_the_instruction():
    """`block_warpgroup=1` and `2` on a CUDA GPU without the instruction are
    refused by name (their kernels would trap); blocks they cannot take (not
    4 warps side by side, or fewer than 8 row tiles; for SHARED_WEIGHTS also
    not 4 or 8 warps of one column tile a matrix, or 2 stages) keep the
    warps' own multiply-adds."""
    for block in (dict(block_warpgroup=1), SHARED_WEIGHTS_BLOCK):
        with launch.grouped_qmm_tiling(tiles_from_rows=0, **block):
            with pytest.raises(ValueError, match=f"block_warpgroup={block['block_warpgroup']}"
                                                 f".*wgmma"):
                launch.grouped_qmm_launch(4, 256, 40, 64, 4, 64, "bfloat16", backend="cuda")
            template = dict(launch.grouped_qmm_launch(4, 256, 40, 64, 4, 64, "bfloat16",
                                                      backend="cuda", warpgroup=True).template)
            assert template["WARPGROUP"]
            assert template["SHARED_WEIGHTS"] == (block["block_warpgroup"] == 2)
    for block, changes in itertools.product(
            (dict(block_warpgroup=1), SHARED_WEIGHTS_BLOCK),
            (dict(block_row_tiles=4), dict(block_row_warps=2, block_column_warps=2))):
        with launch.grouped_qmm_tiling(tiles_from_rows=0, **{**block, **changes}):
            assert not dict(launch.grouped_qmm_launch(4, 256, 40, 64, 4, 64, "bfloat16",
                                                      backend="opencl").template)["WARPGROUP"]
    for changes in (dict(block_tiles=2), dict(block_column_warps=2), dict(block_stages=2)):
        with launch.grouped_qmm_tiling(tiles_from_rows=0, **{**SHARED_WEIGHTS_BLOCK, **changes}):
            assert not dict(launch.grouped_qmm_launch(4, 256, 40, 64, 4, 64, "bfloat16",
                                                      backend="opencl").template)["WARPGROUP"]


@pytest.mark.parametrize("row_tiles", [16, 8])
def test_grouped_qmm_tiles_shared_weights_part_empty(row_tiles):
    """SHARED_WEIGHTS' blocks part empty: experts whose last block holds 1
    to 32, 33 to 64, 65 to 96 and 97 to 127 rows, full ones and empty ones,
    in the rule's blocks of 128 rows and in blocks of 64 (whose half-empty
    ones multiply half their row tiles), one projection and the fused gate
    and up."""
    rng = np.random.default_rng(47)
    block = dict(launch.SHARED_WEIGHTS_TILING, block_row_tiles=row_tiles,
                 block_gated_row_tiles=row_tiles)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, **block):
        template = dict(launch.grouped_qmm_launch(6, 128, 40, 900, 4, 64, "bfloat16",
                                                  backend="opencl", gated=True).template)
        assert template["SHARED_WEIGHTS"] and template["ROW_TILES"] == row_tiles
        check_grouped_qmm(_grouped_qmm, rng, [128 + 20, 0, 40, 128 + 90, 127, 256], 40, 128, 4,
                          64, "bfloat16", 3)
        _check_fused(rng, [33, 70, 0, 100, 1, 128], 24, 128, 4, 64, "float16", 2, 5, True, True)


def test_grouped_qmm_tiles_one_warpgroup_block():
    """The rule's one-warpgroup block (ONE_WARPGROUP_TILING: 4 warps, 96 rows,
    3 stages of 64 values), over more stages than its buffers: experts whose
    last block holds 1 to 48 rows (half-empty: half its row tiles multiplied)
    and 49 to 95, full ones and an empty one, a whole block of columns and a
    part-empty one."""
    rng = np.random.default_rng(83)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, **launch.ONE_WARPGROUP_TILING):
        template = dict(launch.grouped_qmm_launch(6, 640, 72, 900, 4, 64, "bfloat16",
                                                  backend="opencl").template)
        assert template["SHARED_WEIGHTS"] and template["STAGES"] == 3
        assert (template["THREADS"], template["BLOCK_ROWS"], template["BLOCK_COLUMNS"]) == \
            (128, 96, 64)
        check_grouped_qmm(_grouped_qmm, rng, [96 + 20, 0, 48, 96 + 60, 1, 192], 72, 640, 4, 64,
                          "bfloat16", 3)


@pytest.mark.parametrize("row_tiles, stages, max_groups, ahead", [
    (24, 3, 4096, 0), (20, 3, 4096, 0), (10, 3, 4096, 0), (12, 4, 2, 0), (8, 3, 4096, 1),
    (16, 4, 2, 1), (20, 3, 4096, 1), (24, 3, 4096, 1), (10, 6, 4096, 0), (16, 5, 2, 1),
    (6, 3, 4096, 0), (6, 4, 2, 1)])
def test_grouped_qmm_tiles_made_weights_forms(row_tiles, stages, max_groups, ahead):
    """The made weights' forms no rule takes yet: blocks of 48, 80, 96, 160
    and 192 rows (6 to 24 row tiles, wgmma's N of as many), WEIGHTS_AHEAD, each
    stage's weights made a step before its multiply-adds, and 5 or 6 stages
    (`block_shared_stages`' rings). Over more stages than the buffers (10 of
    64 values, 3 to 6 buffers), a group taking one
    block or several: experts whose last block is part empty (at 8 row
    tiles and 6, half-empty ones multiply half their row tiles), full ones and an
    empty one, one projection and the fused gate and up; a block without
    SHARED_WEIGHTS ignores WEIGHTS_AHEAD, and it is 0 or 1."""
    rng = np.random.default_rng(59)
    rows = 8 * row_tiles
    block = dict(launch.SHARED_WEIGHTS_TILING, block_row_tiles=row_tiles,
                 block_gated_row_tiles=row_tiles, block_stage_values=64, block_stages=stages,
                 block_max_groups=max_groups, block_weights_ahead=ahead)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, **block):
        for gated in (False, True):
            template = dict(launch.grouped_qmm_launch(6, 640, 40, 900, 4, 64, "bfloat16",
                                                      backend="opencl", gated=gated).template)
            assert template["SHARED_WEIGHTS"] and template["WEIGHTS_AHEAD"] == bool(ahead)
            assert template["BLOCK_ROWS"] == rows and template["STAGE_GROUPS"] == 1
            assert template["STAGES"] == stages
        check_grouped_qmm(_grouped_qmm, rng, [rows + 20, 0, rows // 2 - 3, rows + rows // 2 + 5,
                                              rows - 1, 2 * rows], 40, 640, 4, 64, "bfloat16", 3)
        _check_fused(rng, [rows + 1, 70, 0, rows // 2, 1, rows], 24, 640, 4, 64, "float16", 2, 5,
                     True, True)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_warpgroup=0, block_weights_ahead=1):
        template = dict(launch.grouped_qmm_launch(6, 640, 40, 900, 4, 64, "bfloat16",
                                                  backend="opencl").template)
        assert not template["SHARED_WEIGHTS"] and not template["WEIGHTS_AHEAD"]
    with pytest.raises(ValueError, match="block_weights_ahead"):
        launch.GroupedQmmTiling(block_weights_ahead=2).check()



@pytest.mark.parametrize("row_tiles, stages, column_warps, max_groups", [
    (16, 3, 8, 4096), (24, 3, 8, 2), (10, 4, 8, 4096), (12, 3, 4, 2), (6, 5, 4, 4096)])
def test_grouped_qmm_tiles_specialized(row_tiles, stages, column_warps, max_groups):
    """The made weights with a warpgroup that only copies the stages and
    makes their weights (`block_specialized`, PRODUCER_WARPGROUPS): here in
    lock-step, each role's steps in turn between the group's barriers (the
    emulation's ROLE_BARRIER), the making warpgroup's copies and weights for
    one or two multiplying warpgroups, blocks of 48 to 192 rows, 3 to 5
    stages, a group taking one block or several; part-empty, full and empty
    experts, one projection and the fused gate and up, against the
    reference. The launch: a warpgroup more, compiled for one group an SM;
    none beside WEIGHTS_AHEAD, the runs across items or the warps' own
    block."""
    rng = np.random.default_rng(97)
    rows = 8 * row_tiles
    block = dict(launch.SHARED_WEIGHTS_TILING, block_row_tiles=row_tiles,
                 block_gated_row_tiles=row_tiles, block_stage_values=64, block_stages=stages,
                 block_column_warps=column_warps, block_max_groups=max_groups,
                 block_specialized=1)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, **block):
        for gated in (False, True):
            made = launch.grouped_qmm_launch(6, 640, 40, 900, 4, 64, "bfloat16", backend="cuda",
                                             gated=gated, warpgroup=True)
            template = dict(made.template)
            assert template["SHARED_WEIGHTS"] and template["PRODUCER_WARPGROUPS"] == 1
            assert made.group_size == template["THREADS"] == 32 * column_warps + 128
            assert made.min_groups == 1 and template["INPUT_SPLITS"] == 1
            assert template["BLOCK_ROWS"] == rows and template["STAGES"] == stages
        check_grouped_qmm(_grouped_qmm, rng, [rows + 20, 0, rows // 2 - 3, rows + rows // 2 + 5,
                                              rows - 1, 2 * rows], 40, 640, 4, 64, "bfloat16", 3)
        _check_fused(rng, [rows + 1, 70, 0, rows // 2, 1, rows], 24, 640, 4, 64, "float16", 2, 5,
                     True, True)
    for others in (dict(block_weights_ahead=1), dict(block_across_items=1),
                   dict(block_warpgroup=0)):
        with launch.grouped_qmm_tiling(tiles_from_rows=0, **dict(block, **others)):
            template = dict(launch.grouped_qmm_launch(6, 640, 40, 900, 4, 64, "bfloat16",
                                                      backend="opencl").template)
            assert template["PRODUCER_WARPGROUPS"] == 0
    with pytest.raises(ValueError, match="block_specialized"):
        launch.GroupedQmmTiling(block_specialized=2).check()


def test_specialized_registers_within_the_launch():
    """Where the specialized block's roles take registers of their own
    (MMA_REGISTERS, MAKING_REGISTERS: gated blocks of 160 and 192 rows), the
    multiplying warps' sums and spare fit theirs, and both roles' together
    fit what the launch gave the group (a thread's at one group an SM, 8 at
    a time, times its threads): setmaxnreg.inc waits until other warps have
    given back as many, so a split of more waits for ever. Elsewhere every
    thread keeps the launch's."""
    for row_tiles in launch.SHARED_WEIGHTS_ROW_TILES:
        for gated in (False, True):
            tiling = dict(launch.SHARED_WEIGHTS_TILING, block_row_tiles=row_tiles,
                          block_gated_row_tiles=row_tiles, block_specialized=1)
            with launch.grouped_qmm_tiling(tiles_from_rows=0, **tiling):
                made = launch.grouped_qmm_launch(128, 2048, 768, 65536, 4, 64, "bfloat16",
                                                 backend="cuda", gated=gated, warpgroup=True)
            template = dict(made.template)
            threads, mma_threads = template["THREADS"], template["THREADS"] - 128
            launch_registers = 65536 // threads // 8 * 8
            sums = (2 if gated else 1) * 8 * row_tiles // 2
            mma, making = template["MMA_REGISTERS"], template["MAKING_REGISTERS"]
            assert bool(mma) == (sums + launch.MMA_SPARE_REGISTERS > launch_registers)
            if mma:
                assert mma >= sums + launch.MMA_SPARE_REGISTERS and mma % 8 == making % 8 == 0
                assert mma * mma_threads + making * 128 <= launch_registers * threads
                assert 24 <= making < launch_registers < mma <= 248

def test_min_groups_bound_the_warps_own_block():
    """`block_min_groups` reaches the warps' own block's launches of experts
    (`Launch.min_groups`, which the GPU glue compiles as CUDA's launch
    bounds: tests/test_cuda_source.py), gated or not, where their blocks
    have up to `block_min_groups_up_to_rows` rows and their input up to
    `block_min_groups_up_to_in_dims` values, at 4 bits; neither the tall
    gated blocks, nor a warpgroup's block (4 or 8 warps multiplying as one,
    their registers wgmma's), nor a dense projection's."""
    def min_groups(capacity, gated=False, in_dims=2048, dense=False, bits=4, **tiling):
        with launch.grouped_qmm_tiling(**tiling):
            made = launch.grouped_qmm_launch(1 if dense else 128, in_dims, 768, capacity, bits, 64,
                                             "bfloat16", backend="cuda", gated=gated,
                                             warpgroup=True, dense=dense)
        assert made.body == "grouped_qmm_tiles"
        return made.min_groups, dict(made.template)["WARPGROUP"], \
            dict(made.template)["BLOCK_ROWS"]

    default = launch.GROUPED_QMM_TILING
    assert (default.block_min_groups, default.block_min_groups_up_to_rows,
            default.block_min_groups_up_to_in_dims) == (3, 48, 2048)
    # 32 and 40 rows an expert: blocks of 40 and 48 rows, bound
    assert min_groups(4096) == min_groups(4096, gated=True) == (3, False, 40)
    assert min_groups(128 * 40) == (3, False, 48)
    assert min_groups(4096, block_min_groups=0) == (0, False, 40)
    assert min_groups(4096, block_min_groups=4) == (4, False, 40)
    # taller blocks, longer inputs: unbound, unless the bounds are raised
    assert min_groups(128 * 50) == (0, False, 64)
    assert min_groups(128 * 50, block_min_groups_up_to_rows=64) == (3, False, 64)
    assert min_groups(4096, in_dims=2880) == (0, False, 40)
    assert min_groups(4096, in_dims=2880, block_min_groups_up_to_in_dims=2880) == (3, False, 40)
    # 128 rows an expert: the made weights' block (wgmma), unbound
    assert min_groups(16384, gated=True)[:2] == (0, True)
    assert min_groups(4096, block_warpgroup=1)[:2] == (0, True)
    # the tall gated blocks (512 rows an expert, the warps' own), unbound
    assert min_groups(128 * 512, gated=True, block_warpgroup=0,
                      block_min_groups_up_to_rows=1 << 20)[:2] == (0, False)
    assert min_groups(128 * 512, block_warpgroup=0,
                      block_min_groups_up_to_rows=1 << 20)[:2] == (3, False)
    # a dense projection's block (32 rows of a decoding batch), unbound
    assert min_groups(32, dense=True, tiles_from_rows=0)[0] == 0
    # 8 bits, not timed: unbound
    assert launch.MIN_GROUPS_BITS == (4,)
    assert min_groups(4096, bits=8)[0] == 0


def test_shared_min_groups_bound_the_made_weights():
    """`block_shared_min_groups` binds the made weights' launches (SHARED_WEIGHTS)
    alone, whatever their rows, the rule's block of two warpgroups or a
    tiling's of one; the warps' own keep `block_min_groups`'. It is at most
    what an SM's threads allow the rule's block of 256."""
    def bound(capacity, gated=False, **tiling):
        with launch.grouped_qmm_tiling(**tiling):
            made = launch.grouped_qmm_launch(128, 2048, 768, capacity, 4, 64, "bfloat16",
                                             backend="cuda", gated=gated, warpgroup=True)
        template = dict(made.template)
        return made.min_groups, template["SHARED_WEIGHTS"], made.group_size

    assert launch.GROUPED_QMM_TILING.block_shared_min_groups == 0
    assert bound(128 * 128) == bound(128 * 128, gated=True) == (0, True, 256)
    assert bound(128 * 128, block_shared_min_groups=2) == (2, True, 256)
    one_warpgroup = dict(block_warpgroup=2, block_column_warps=4, block_tiles=1,
                         block_gated_tiles=1, block_row_tiles=12, block_gated_row_tiles=12,
                         block_stage_values=64, block_stages=3)
    for gated in (False, True):
        assert bound(128 * 160, gated, block_shared_min_groups=3, **one_warpgroup) \
            == (3, True, 128)
    # the warps' own block (40 rows an expert) keeps block_min_groups'
    assert bound(128 * 32, block_shared_min_groups=2) == (3, False, 128)
    launch.GroupedQmmTiling(block_shared_min_groups=8).check()
    with pytest.raises(ValueError, match="block_shared_min_groups"):
        launch.GroupedQmmTiling(block_shared_min_groups=9).check()
    with pytest.raises(ValueError, match="min_groups"):
        launch.GroupedQmmTiling(block_shared_min_groups=-1).check()


def test_fitted_row_tiles_rule():
    """By default an experts' launch in the warps' own block takes the fewest
    8-row tiles whose rows reach the rows an expert holds on average plus
    their square root, at most the tiling's (Qwen3-Next at T = 2048, 40 rows
    an expert: 48 rows; Qwen3-30B-A3B at 512, 32: 40), gated or not, where
    the GPU has wgmma or not, on CUDA and OpenCL, the warps' own block by the
    rule or named (`block_warpgroup=0`), its rows over its row warps; a dense
    projection, the tall gated blocks, Metal and `block_fitted_rows=0` keep
    the tiling's."""
    def block_rows(experts, capacity, gated=False, backend="cuda", warpgroup=True,
                   dense=False):
        template = dict(launch.grouped_qmm_launch(experts, 2048, 512, capacity, 4, 64,
                                                  "bfloat16", backend=backend, gated=gated,
                                                  dense=dense, warpgroup=warpgroup).template)
        assert not template["SHARED_WEIGHTS"]
        return template["BLOCK_ROWS"]

    assert launch.GROUPED_QMM_TILING.block_fitted_rows == 1
    assert block_rows(512, 20480) == block_rows(512, 20480, gated=True) == 48
    assert block_rows(512, 20480, backend="opencl") == block_rows(512, 20480,
                                                                  warpgroup=False) == 48
    assert block_rows(128, 4096) == 40 and block_rows(128, 4096 + 128 * 3) == 48
    assert [launch._fitted_row_tiles(rows, 8) for rows in (1, 26.8, 26.9, 49, 49.3, 64)] \
        == [1, 4, 5, 7, 8, 8]
    assert launch._fitted_row_tiles(40, 5) == 5  # at most the tiling's
    assert launch._fitted_row_tiles(40, 4, row_warps=2) == 3  # 48 rows over 2 warps
    assert block_rows(512, 20480, backend="metal") == 64
    with launch.grouped_qmm_tiling(block_warpgroup=0):
        assert block_rows(512, 20480) == 48 and block_rows(128, 4096) == 40
    with launch.grouped_qmm_tiling(block_row_warps=2, block_row_tiles=4):
        assert block_rows(512, 20480) == 48 and block_rows(128, 128 * 60) == 64
    with launch.grouped_qmm_tiling(block_fitted_rows=0):
        assert block_rows(512, 20480) == block_rows(128, 4096) == 64
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_gated_tall_rows=0):
        assert block_rows(512, 20480, gated=True) == 128  # tall: block_gated_row_tiles
        assert block_rows(1, 40, dense=True) == 32  # halved, not fitted
    with pytest.raises(ValueError, match="block_fitted_rows"):
        launch.GroupedQmmTiling(block_fitted_rows=2).check()


def test_shared_weights_rule():
    """By default (`block_warpgroup=None`) the experts' launches of 4 bits in
    groups of 64 on CUDA where the GPU has wgmma take SHARED_WEIGHTS_TILING's
    block ("made"), gated from `block_shared_gated_rows` rows an expert and
    ungated from `block_shared_whole_rows` where the projection is whole
    stages of 128 values and blocks of 128 columns (and there from
    `block_shared_gated_rows` up to `block_shared_sized_up_to_rows` too,
    and past that ONE_WARPGROUP_TILING's block, "one", while an expert's
    rows fill ONE_WARPGROUP_EXPERT_BLOCKS of its blocks, unless
    `block_one_warpgroup` is 0), else from `block_shared_rows`, a dense
    projection's from `block_shared_dense_rows` whatever its shape; fewer
    rows, another format or backend, no wgmma or a tiling that says 0 keep
    the warps' own multiply-adds ("own")."""
    def block(capacity, gated=False, backend="cuda", warpgroup=True, dense=False, experts=4,
              bits=4, group_size=64, in_dims=256, out_dims=40):
        made = launch.grouped_qmm_launch(experts, in_dims, out_dims, capacity, bits,
                                         group_size, "bfloat16", backend=backend, gated=gated,
                                         dense=dense, warpgroup=warpgroup)
        template = dict(made.template)
        assert template["WARPGROUP"] == template["SHARED_WEIGHTS"]
        if not template["SHARED_WEIGHTS"]:
            return "own"
        if template["THREADS"] == 128:
            assert template["BLOCK_ROWS"] == 8 * launch.ONE_WARPGROUP_TILING["block_row_tiles"]
            assert template["STAGE_GROUPS"] == 1 and made.min_groups == 3
            return "one"
        rows = 128 if dense else 8 * launch._shared_weights_row_tiles(capacity / experts, gated,
                                                                      in_dims)
        assert (template["THREADS"], template["BLOCK_ROWS"]) == (256, rows)
        return "made"

    tiling = launch.GROUPED_QMM_TILING
    assert tiling.block_warpgroup is None and tiling.block_one_warpgroup == 1
    assert block(4 * tiling.block_shared_rows) == "made"
    assert block(4 * tiling.block_shared_rows - 1) == "own"
    assert tiling.block_shared_whole_rows < tiling.block_shared_rows
    whole = 4 * tiling.block_shared_whole_rows
    assert block(whole, out_dims=256) == "made" and block(whole - 1, out_dims=256) == "own"
    # Part of a stage (3 groups of 64 values) or of a block's 128 columns.
    assert block(whole, in_dims=192, out_dims=256) == block(whole, out_dims=192) == "own"
    # Whole blocks also from block_shared_gated_rows up to
    # block_shared_sized_up_to_rows rows an expert, in the block sized to them,
    # and past that in one warpgroup's while an expert's rows fill two of them.
    low, high = tiling.block_shared_gated_rows, tiling.block_shared_sized_up_to_rows
    assert low < high < tiling.block_shared_whole_rows
    assert block(4 * low, out_dims=256) == block(4 * high, out_dims=256) == "made"
    assert block(4 * low - 1, out_dims=256) == "own"
    assert block(4 * high + 1, out_dims=256) == "one"
    two_blocks = launch.ONE_WARPGROUP_EXPERT_BLOCKS * 8 * launch.ONE_WARPGROUP_TILING[
        "block_row_tiles"]
    most = max(c for c in range(4 * high, 4 * tiling.block_shared_whole_rows)
               if launch._held_rows(c / 4) <= two_blocks)
    assert 4 * high < most < 4 * tiling.block_shared_whole_rows - 1
    assert block(most, out_dims=256) == "one" and block(most + 1, out_dims=256) == "own"
    assert block(4 * high, out_dims=192) == "own"
    assert block(4 * high + 1, out_dims=192) == block(4 * high + 1, in_dims=192,
                                                      out_dims=256) == "own"
    assert block(4 * high + 1, gated=True, in_dims=256, out_dims=256) == "made"
    assert block(4 * high + 1, out_dims=256, bits=8) == "own"
    assert block(4 * high + 1, out_dims=256, backend="opencl") == "own"
    with launch.grouped_qmm_tiling(block_one_warpgroup=0):
        assert block(4 * high + 1, out_dims=256) == block(most, out_dims=256) == "own"
    assert block(4 * tiling.block_shared_rows, in_dims=192, out_dims=192) == "made"
    assert block(4 * tiling.block_shared_gated_rows, gated=True) == "made"
    assert block(4 * tiling.block_shared_gated_rows - 1, gated=True) == "own"
    assert block(6400, backend="opencl") == block(6400, warpgroup=False) == "own"
    # Whole blocks, where one expert's launch takes them from fewer rows.
    dense = tiling.block_shared_dense_rows
    assert dense > tiling.block_shared_whole_rows
    assert block(dense, dense=True, experts=1, out_dims=256) == "made"
    assert block(dense - 1, dense=True, experts=1, out_dims=256) == "own"
    assert block(dense - 1, experts=1, out_dims=256) == "made"
    assert block(dense, dense=True, experts=1, in_dims=192, out_dims=192) == "made"
    assert block(6400, dense=True, experts=1, bits=8) == "own"
    assert block(6400, dense=True, experts=1, backend="opencl") == "own"
    assert block(6400, bits=8) == block(6400, group_size=32) == "own"
    with launch.grouped_qmm_tiling(block_warpgroup=0):
        assert block(6400) == "own"
    with pytest.raises(ValueError, match="block_one_warpgroup"):
        launch.GroupedQmmTiling(block_one_warpgroup=2).check()


def test_shared_weights_max_groups():
    """`block_shared_max_groups` caps the grid of an experts' launch in the
    made weights' block where the rule takes it (264 by default), and only
    there: a dense projection's launch in that block and a launch in the
    warps' own keep `block_max_groups`, which caps the rule's block too."""
    def groups(capacity, dense=False, experts=16, warpgroup=True):
        made = launch.grouped_qmm_launch(experts, 256, 512, capacity, 4, 64, "bfloat16",
                                         backend="cuda", gated=True, dense=dense,
                                         warpgroup=warpgroup)
        return made.groups, dict(made.template)["SHARED_WEIGHTS"]

    def launches():  # the experts' in the made weights' block, a dense one's, the warps' own
        return (groups(64 * 16), groups(2048, dense=True, experts=1),
                groups(64 * 16, warpgroup=False))

    made, dense, own = launches()
    assert made[1] and dense[1] and not own[1]
    assert min(made[0], dense[0], own[0]) > 7
    assert launch.GROUPED_QMM_TILING.block_shared_max_groups >= made[0]
    # a prefill's chunk routed as Qwen3-30B-A3B's (2048 tokens, 8 of 128
    # experts): more items than two groups an SM of an H100 or H200, the cap
    assert groups(2048 * 8, experts=128) == (264, True)
    with launch.grouped_qmm_tiling(block_shared_max_groups=7):
        assert launches() == ((7, True), dense, own)
    with launch.grouped_qmm_tiling(block_shared_max_groups=7, block_max_groups=5):
        assert groups(64 * 16) == (5, True)
    with pytest.raises(ValueError, match="at least 1"):
        with launch.grouped_qmm_tiling(block_shared_max_groups=0):
            pass


def test_shared_weights_row_tiles_rule():
    """The experts' made-weights block holds the rows an expert has on
    average plus 1.5 of their square root, in the fewest of
    SHARED_WEIGHTS_ROW_TILES that do; where none does, the tallest from
    TALLEST_MADE_WEIGHTS_FROM_ROWS rows (gated, only for inputs of at most
    TALLEST_GATED_MADE_WEIGHTS_UP_TO_IN_DIMS values, else 128 rows), else
    OVERFULL_MADE_WEIGHTS_ROW_TILES; the tiling's `block_shared_row_tiles`
    says another; a dense projection's keeps 128."""
    def block_rows(capacity, experts=4, dense=False, gated=True, in_dims=256):
        template = dict(launch.grouped_qmm_launch(experts, in_dims, 256, capacity, 4, 64,
                                                  "bfloat16", backend="cuda", gated=gated,
                                                  dense=dense, warpgroup=True).template)
        assert template["SHARED_WEIGHTS"]
        return template["BLOCK_ROWS"]

    widths = launch.SHARED_WEIGHTS_ROW_TILES
    tallest, long_input = widths[-1], launch.TALLEST_GATED_MADE_WEIGHTS_UP_TO_IN_DIMS + 64
    from_rows = launch.TALLEST_MADE_WEIGHTS_FROM_ROWS
    overfull = launch.OVERFULL_MADE_WEIGHTS_ROW_TILES

    def rule(rows, gated=True, in_dims=2048):
        return 8 * launch._shared_weights_row_tiles(rows, gated, in_dims)

    # As measured: 64 rows an expert in 80, 80 in 96, 128 in 160, 160 and 512
    # in 192; 256 in 160; a long input's gated block at 512 in 128.
    assert [rule(rows) for rows in (64, 80, 128, 160, 256, 512)] == [80, 96, 160, 192, 160, 192]
    assert rule(512, in_dims=long_input) == 128 and rule(512, False, long_input) == 192
    assert rule(256, in_dims=long_input) == 160 == rule(256, False, long_input)
    assert rule(from_rows - 1) == 8 * overfull and rule(from_rows) == 8 * tallest
    assert rule(1) == 8 * widths[0]
    for rows in range(1, 2 * from_rows):
        wanted = rows + 1.5 * rows ** 0.5
        for gated, in_dims in ((True, 2048), (False, long_input), (True, long_input)):
            got = rule(rows, gated, in_dims) // 8
            fitting = [tiles for tiles in widths if 8 * tiles >= wanted]
            expected = fitting[0] if fitting else overfull if rows < from_rows else tallest
            if expected == tallest and gated and in_dims == long_input:
                expected = 16
            assert got == expected
    assert block_rows(4 * 64) == 80 and block_rows(4 * 128) == 160 == block_rows(4 * 256)
    assert block_rows(4 * 512, gated=False, experts=1, dense=True) == 128
    assert block_rows(4 * 2048) == 192 and block_rows(4 * 2048, gated=False) == 192
    assert block_rows(4 * 2048, in_dims=long_input) == 128
    with launch.grouped_qmm_tiling(block_shared_row_tiles=16):
        assert block_rows(4 * 64) == block_rows(4 * 2048) == 128
    with pytest.raises(ValueError, match="block_shared_row_tiles"):
        launch.GroupedQmmTiling(block_shared_row_tiles=14).check()


def test_shared_weights_stages_rule():
    """The made weights' block keeps `block_shared_stages` stages in flight at
    most (by the rule 3): where memory is short they fall to 3 at the values
    wanted a stage, then the values fall and the stages start again from
    the count, as many as fit, by the rule an ungated launch's from
    UNGATED_MADE_SMALLER_STAGES; other blocks keep `block_stages`.
    Qwen3-30B-A3B at T = 8192: its down projection (768 values a row) and
    fused gate and up in blocks of 192 rows, 64 values a stage; gpt-oss-20b's
    down at 8192 (192 values wanted, then 64); DeepSeek-V3's down (128
    values, memory full at 3)."""
    def block(experts, in_dims, out_dims, capacity, gated, **tiling):
        with launch.grouped_qmm_tiling(**tiling):
            made = launch.grouped_qmm_launch(experts, in_dims, out_dims, capacity, 4, 64,
                                             "bfloat16", backend="cuda", gated=gated,
                                             warpgroup=True)
        template = dict(made.template)
        assert template["SHARED_WEIGHTS"]
        assert made.shared_bytes <= launch.SHARED_WEIGHTS_BYTES["cuda"]
        return template["STAGES"], template["STAGE_GROUPS"] * 64

    down, fused, deepseek = (128, 768, 2048, 65536, False), (128, 2048, 768, 65536, True), \
        (256, 2048, 7168, 65536, False)
    gpt_oss = (32, 2880, 2880, 32768, False)  # 3 groups a stage wanted (45 a row), then 1
    smaller = launch.UNGATED_MADE_SMALLER_STAGES
    assert block(*down) == (smaller, 64) == block(*gpt_oss) and block(*fused) == (3, 64)
    assert block(*deepseek) == (3, 128)
    assert block(*down, block_shared_stages=3) == (3, 64)  # named, for every launch
    assert block(*down, block_stages=6) == (smaller, 64)  # the other blocks' count
    assert [block(*down, block_shared_stages=n) for n in (4, 5, 6, 8)] == \
        [(4, 64), (5, 64), (6, 64), (6, 64)]
    assert block(*fused, block_shared_stages=6) == (4, 64)
    assert block(*deepseek, block_shared_stages=6) == (3, 128)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_shared_stages=6):
        assert dict(launch.grouped_qmm_launch(
            8, 768, 2048, 8192, 4, 64, "bfloat16", backend="cuda").template)["STAGES"] \
            == launch.GroupedQmmTiling().block_stages


def test_gate_up_apart_rule():
    """A layer's gate and up run apart (`launch.fuses_gate_up` False) where the
    fused launch's made weights take a shorter block than one projection's:
    rows too long for the tallest gated block (Mixtral's 4096 values) from
    512 rows an expert, where one projection takes it; fused at every other
    workload shape and size, under `block_gated_apart=0`, and wherever no
    made weights run (Metal, a GPU without wgmma, other formats)."""
    # (hidden, intermediate, experts, top-K): the benchmarks' layer shapes
    shapes = {"qwen3-30b-a3b": (2048, 768, 128, 8), "qwen3-next": (2048, 512, 512, 10),
              "gpt-oss-20b": (2880, 2880, 32, 4), "mixtral": (4096, 14336, 8, 2),
              "deepseek-v3": (7168, 2048, 256, 8)}

    def apart(shape, tokens, backend="cuda", warpgroup=True, bits=4, quant_group=64):
        hidden, intermediate, experts, top_k = shape
        return not launch.fuses_gate_up(experts, hidden, intermediate, tokens * top_k, bits,
                                        quant_group, backend=backend, warpgroup=warpgroup)

    sizes = (1, 64, 512, 1024, 2048, 4096, 8192, 16384)
    taken = {(name, tokens) for name, shape in shapes.items() for tokens in sizes
             if apart(shape, tokens)}
    assert taken == {("mixtral", 2048), ("mixtral", 4096), ("mixtral", 8192),
                     ("mixtral", 16384), ("deepseek-v3", 16384)}
    mixtral = shapes["mixtral"]
    assert launch.TALLEST_GATED_MADE_WEIGHTS_UP_TO_IN_DIMS < mixtral[0]
    for backend, warpgroup, bits, quant_group in (("metal", False, 4, 64),
                                                  ("opencl", False, 4, 64),
                                                  ("cuda", False, 4, 64), ("cuda", True, 8, 64),
                                                  ("cuda", True, 4, 32)):
        assert not apart(mixtral, 8192, backend, warpgroup, bits, quant_group)
    with launch.grouped_qmm_tiling(block_gated_apart=0):
        assert not apart(mixtral, 8192)
    with launch.grouped_qmm_tiling(block_shared_row_tiles=24):  # one block for both
        assert not apart(mixtral, 8192)
    with pytest.raises(ValueError, match="block_gated_apart"):
        launch.GroupedQmmTiling(block_gated_apart=2).check()


@pytest.mark.parametrize("name", launch.GROUPED_QMM_DTYPES)
def test_grouped_qmm_tiles_tall_part_empty(name):
    """The tall gated blocks (128 rows) forced at any size: experts that end a
    row tile into a block, exactly at a tile's end, past one block, and of one
    row, whose blocks are mostly rows of the next expert or padding."""
    rng = np.random.default_rng(53)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_gated_tall_rows=0):
        assert dict(launch.grouped_qmm_launch(5, 128, 24, 400, 4, 64, name, backend="opencl",
                                              num_rows=6, gated=True).template)["ROW_TILES"] == 16
        _check_fused(rng, [9, 0, 136, 1, 200], 24, 128, 4, 64, name, 3, 6, True, True)


def test_grouped_qmm_tiles_halved_blocks():
    """A dense projection (one ungated expert, `dense`) of up to 64 rows (a
    decoding batch) whose full blocks are fewer than 128 takes blocks of half
    the rows and columns on CUDA and OpenCL; not above, nor an lm_head's many
    columns, an expert-parallel rank's single expert, the gated launch, or
    Metal. Forced at any size, they match the reference: a block part empty,
    columns past the last block, both 16-bit formats and 8 bits."""
    def block(capacity, gated=False, backend="cuda", out_dims=2048, dense=True):
        template = dict(launch.grouped_qmm_launch(1, 2048, out_dims, capacity, 4, 64,
                                                  "bfloat16", backend=backend, gated=gated,
                                                  dense=dense).template)
        return template["BLOCK_ROWS"], template["BLOCK_COLUMNS"]

    with launch.grouped_qmm_tiling(tiles_from_rows=0):
        assert block(64) == block(1) == block(64, backend="opencl") == (32, 64)
        assert block(65) == block(64, dense=False) == (64, 128)
        # an expert's block of the rows it holds (_fitted_row_tiles), not halved
        assert block(1, dense=False) == (8, 128)
        # 127 and 128 blocks of 128 columns (151936: Qwen3-30B-A3B's lm_head)
        assert block(1, out_dims=127 * 128 - 5) == (32, 64)
        assert block(1, out_dims=128 * 128) == block(64, out_dims=151936) == (64, 128)
        assert block(64, gated=True) == (64, 64)  # 64 columns of each of gate and up
        metal = block(64, backend="metal")
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_halved_up_to_rows=0):
        assert block(1) == (64, 128)
        assert block(64, backend="metal") == metal
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_halved_below_blocks=0):
        assert block(1) == (64, 128)
    rng = np.random.default_rng(59)
    with launch.grouped_qmm_tiling(tiles_from_rows=0):
        for rows, name, bits in ((50, "bfloat16", 4), (64, "float16", 4), (3, "bfloat16", 8)):
            check_grouped_qmm(_dense_qmm, rng, [rows], 100, 256, bits, 64, name, 0)
    with pytest.raises(ValueError, match="dense: a dense projection is one expert"):
        launch.grouped_qmm_launch(2, 2048, 2048, 64, 4, 64, "bfloat16", backend="cuda",
                                  dense=True)


@given(**tiles_cases(st.integers(2, 8)), splits=st.integers(2, 5),
       fusion=st.sampled_from(["none", "tokens", "biased"]))
def test_grouped_qmm_tiles_input_splits_match_reference(counts, out_dims, in_groups, bits,
                                                        group_size, name, tail, splits,
                                                        fusion, seed):
    """A block's input split among 2 to 5 groups, a quantization group a
    stage (2 to 8 stages; as many splits as stages at most): experts of no
    row and past a block, the tail, every format, rows from the tokens, a
    bias added once."""
    rng = np.random.default_rng(seed)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_input_splits=splits,
                                   block_stage_values=group_size):
        if sum(counts) + tail:  # else no kernel runs
            qmm = launch.grouped_qmm_launch(len(counts), in_groups * group_size, out_dims,
                                            sum(counts) + tail, bits, group_size, name,
                                            backend="opencl")
            assert dict(qmm.template)["INPUT_SPLITS"] == min(splits, in_groups)
        if fusion == "none":
            check_grouped_qmm(_grouped_qmm, rng, counts, out_dims, in_groups * group_size, bits,
                              group_size, name, tail)
        else:
            _check_fused(rng, counts, out_dims, in_groups * group_size, bits, group_size, name,
                         tail, 4, True, False, biased=fusion == "biased")


@pytest.mark.parametrize("rows, bits, name", [(50, 4, "bfloat16"), (130, 8, "float16")])
def test_grouped_qmm_tiles_shared_weights_split_input(rows, bits, name):
    """A dense projection in the made weights' block (forced: at 50 and 130
    rows, below the rule's `block_shared_dense_rows`), its input split among
    groups where its blocks are few: each split's stages made and
    multiplied, the splits' sums added."""
    with launch.grouped_qmm_tiling(tiles_from_rows=0, **launch.SHARED_WEIGHTS_TILING):
        template = dict(launch.grouped_qmm_launch(1, 512, 100, rows, bits, 64, name,
                                                  backend="opencl", dense=True).template)
        assert template["SHARED_WEIGHTS"] and template["INPUT_SPLITS"] > 1
        check_grouped_qmm(_dense_qmm, np.random.default_rng(61), [rows], 100, 512, bits, 64,
                          name, 0)


@given(counts=st.lists(st.integers(0, 200), min_size=1, max_size=MAX_EXPERTS),
       tail=st.integers(0, 150), gated=st.booleans())
def test_grouped_qmm_tiles_grid_holds_every_item(counts, tail, gated):
    """The block tiles' grid has a group for every (row block, column block)
    item of any plan of its capacity (each expert's blocks, then the tail's,
    as grouped_qmm_tiles.h counts them), so no group takes two; for one
    expert, at most one row block more than the capacity fills. The least
    grid (`block_least_groups`) has an item for every group: the capacity's
    rows in whole blocks."""
    capacity = sum(counts) + tail
    assume(capacity > 0)

    def row_blocks(least: int) -> tuple[int, int]:
        with launch.grouped_qmm_tiling(tiles_from_rows=0, block_max_groups=1 << 30,
                                       block_least_groups=least):
            qmm = launch.grouped_qmm_launch(len(counts), 128, 40, capacity, 4, 64, "bfloat16",
                                            backend="cuda", gated=gated)
        template = dict(qmm.template)
        rows = template["BLOCK_ROWS"]
        return qmm.groups // (template["INPUT_SPLITS"] * qmm.params.column_blocks), rows

    most, rows = row_blocks(0)
    items = sum(-(-count // rows) for count in counts) + -(-tail // rows)
    assert items <= most
    if len(counts) == 1:  # the expert's span and the tail, a block apart at most
        assert most == -(-capacity // rows) + (capacity > 1)
    least = row_blocks(1)
    assert least == (-(-capacity // rows), rows) and least[0] <= items


def test_grouped_qmm_tiles_input_splits():
    """A block's input split among groups (INPUT_SPLITS), each split's float
    sums a slice of the output that the host adds: by the launch where the
    blocks are few and the row long (a dense projection of a decoding
    batch), not where blocks fill the GPU, nor gated, nor a row of few
    stages, nor on Metal, nor experts (several, or an expert-parallel rank's
    single one); forced (any launch), 8 stages split 3 ways (unevenly) and 4
    stages one a split, with experts of no row and of more than a block, the
    tail's zeros in every split, a bias added once, rows read from tokens,
    unaligned copies, 8 bits and both 16-bit formats."""
    def splits(capacity, in_dims, out_dims, gated=False, backend="cuda", num_experts=1,
               dense=True):
        qmm = launch.grouped_qmm_launch(num_experts, in_dims, out_dims, capacity, 4, 64,
                                        "bfloat16", backend=backend, gated=gated,
                                        dense=dense and num_experts == 1)
        template = dict(qmm.template)
        assert template["OutT"] == qmm.outputs[0][1]
        return template["INPUT_SPLITS"], qmm.outputs[0]

    # Qwen3-30B-A3B's attention output at 32 rows: 32 halved blocks, 32 stages;
    # 8 splits of 2 row blocks (the span and a tail, at most) by 32 column blocks.
    assert splits(32, 4096, 2048) == (8, ((8, 32, 2048), "float32"))
    assert launch.grouped_qmm_launch(1, 4096, 2048, 32, 4, 64, "bfloat16", backend="cuda",
                                     dense=True).groups == 8 * 2 * 32
    assert splits(32, 2048, 4096)[0] == 4  # its queries: 64 blocks, 16 stages
    assert splits(32, 2048, 512)[0] == 8  # its keys: 8 blocks, each split 2 stages
    assert splits(64, 2048, 151936) == (1, ((64, 151936), "bfloat16"))  # an lm_head
    assert splits(32, 4096, 2048, backend="opencl")[0] == 8
    assert splits(32, 4096, 2048, backend="metal")[0] == 1
    with launch.grouped_qmm_tiling(tiles_from_rows=0):
        assert splits(64, 4096, 2048, gated=True)[0] == 1
        assert splits(32, 384, 2048)[0] == 1  # 3 stages
        assert splits(320, 4096, 2048, num_experts=8)[0] == 1  # experts: not by default
        assert splits(32, 4096, 2048, dense=False)[0] == 1  # a rank's single expert
    with launch.grouped_qmm_tiling(block_split_below_groups=0):
        assert splits(32, 4096, 2048)[0] == 1
    for bad in (dict(block_input_splits=0), dict(block_split_below_groups=-1)):
        with pytest.raises(ValueError, match="block_input_splits at least 1"):
            with launch.grouped_qmm_tiling(**bad):
                pass
    rng = np.random.default_rng(61)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_input_splits=3):
        assert splits(40, 1024, 40)[0] == 3
        check_grouped_qmm(_grouped_qmm, rng, [2, 0, 90, 1, 5], 40, 1024, 4, 64, "bfloat16", 3)
        _check_fused(rng, [3, 0, 66], 24, 1024, 8, 32, "float16", 2, 5, True, False,
                     biased=True)
        with ocl.unaligned_buffers():
            check_grouped_qmm(_grouped_qmm, rng, [70, 1], 40, 1024, 4, 64, "float16", 2)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_input_splits=100):
        assert splits(40, 512, 40)[0] == 4
        check_grouped_qmm(_grouped_qmm, rng, [33, 0, 4], 100, 512, 4, 64, "bfloat16", 5)


def test_grouped_qmm_tiles_odd_stage_groups():
    """Three quantization groups a stage, an odd count: the whole row, and by
    the default tiling a row of 9 groups in 3 stages (as gpt-oss-20b's 45)."""
    rng = np.random.default_rng(47)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_stage_values=192):
        assert dict(launch.grouped_qmm_launch(4, 192, 40, 76, 4, 64, "bfloat16",
                                              backend="opencl").template)["STAGE_GROUPS"] == 3
        check_grouped_qmm(_grouped_qmm, rng, [2, 0, 70, 1], 40, 192, 4, 64, "bfloat16", 3)
    with launch.grouped_qmm_tiling(tiles_from_rows=0):
        assert dict(launch.grouped_qmm_launch(4, 576, 40, 76, 4, 64, "bfloat16",
                                              backend="opencl").template)["STAGE_GROUPS"] == 3
        check_grouped_qmm(_grouped_qmm, rng, [2, 0, 70, 1], 40, 576, 4, 64, "float16", 3)
        _check_fused(rng, [1, 3, 70], 9, 576, 4, 64, "bfloat16", 0, 5, True, True)


@pytest.mark.parametrize("stage_values, in_dims, want", [
    (128, 2048, 2), (512, 768, 6), (512, 2880, 5), (64, 768, 1), (32, 768, 1), (768, 384, 6),
    (128, 2880, 3), (128, 2240, 1), (256, 2880, 3), (256, 2240, 5)])
def test_grouped_qmm_tiles_stage_groups(stage_values, in_dims, want):
    """A stage holds the most whole quantization groups, up to the tiling's
    values, that divide the row, and where those are at most half the values,
    the fewest above that divide it, up to twice the values (groups of 64
    here: 12 in 768, 45 in 2880, 6 in 384, 35 in 2240)."""
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_row_tiles=1,
                                   block_stage_values=stage_values):
        tiles = launch.grouped_qmm_launch(128, in_dims, 768, 256, 4, 64, "bfloat16",
                                          backend="cuda")
    assert dict(tiles.template)["STAGE_GROUPS"] == want


def test_grouped_qmm_tiles_stage_above_values_falls_back():
    """A stage above the values wanted that does not fit the shared memory in
    2 stages goes back to the groups up to them, in all the tiling's stages:
    8 bits, 45 groups of 64, where 3 a stage fit 4 bits' 2 stages."""
    def stages(bits):
        template = dict(launch.grouped_qmm_launch(32, 2880, 2880, 8192, bits, 64, "bfloat16",
                                                  backend="cuda").template)
        return template["STAGE_GROUPS"], template["STAGES"]

    assert stages(4) == (3, 2)
    assert stages(8) == (1, launch.GroupedQmmTiling().block_stages)


def test_grouped_qmm_tiles_stage_below_one_group():
    """A tiling asking fewer values a stage than a quantization group holds
    stages one group, also where memory is short (Metal's 32 KB, 8 bits in
    groups of 128): the fit's fewer stages and blocks, not a larger stage."""
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_stage_values=32):
        for backend, bits, group_size in (("metal", 8, 128), ("cuda", 4, 64)):
            tiles = launch.grouped_qmm_launch(128, 2048, 768, 8192, bits, group_size,
                                              "bfloat16", backend=backend)
            assert dict(tiles.template)["STAGE_GROUPS"] == 1


def test_grouped_qmm_tiles_tall_gated_blocks():
    """The gated launch takes blocks of 16 row tiles (128 rows) from 512 rows
    an expert of capacity, 4 bits in groups of 64, on CUDA and OpenCL; not
    below, nor other quantizations, one projection, or Metal. Forced at any
    size, they match the reference, float16 and bfloat16."""
    def block_rows(capacity, bits=4, group_size=64, gated=True, backend="cuda"):
        tiles = launch.grouped_qmm_launch(128, 2048, 768, capacity, bits, group_size,
                                          "bfloat16", backend=backend, gated=gated,
                                          num_rows=capacity // 8)
        return dict(tiles.template)["BLOCK_ROWS"]

    assert block_rows(512 * 128) == 128
    assert block_rows(512 * 128, backend="opencl") == 128
    assert block_rows(512 * 128 - 1) == 64
    assert block_rows(512 * 128, bits=8) == 64
    assert block_rows(512 * 128, group_size=128) == 64
    assert block_rows(512 * 128, gated=False) == 64
    assert block_rows(512 * 128, backend="metal") < 128
    rng = np.random.default_rng(53)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_gated_tall_rows=0):
        for name in launch.GROUPED_QMM_DTYPES:
            tiles = launch.grouped_qmm_launch(3, 192, 70, 200, 4, 64, name, backend="opencl",
                                              gated=True, num_rows=5)
            assert dict(tiles.template)["BLOCK_ROWS"] == 128
            _check_fused(rng, [1, 0, 140], 70, 192, 4, 64, name, 3, 5, True, True)


@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64),
                                              (8, 128)])
@pytest.mark.parametrize("gated", [False, True])
def test_grouped_qmm_tiles_cuda_memory(bits, group_size, gated):
    """On CUDA the block's stages fit the group's shared memory with the
    static arrays, and a launch asks for them as dynamic memory: past 48 KB
    in all, more than MLX's 48,000-byte threshold, which lets it pass."""
    tiles = launch.grouped_qmm_launch(128, 2048, 768, 16384, bits, group_size, "bfloat16",
                                      backend="cuda", gated=gated)
    template = dict(tiles.template)
    assert tiles.body == "grouped_qmm_tiles"
    static = 4 * (MAX_EXPERTS + template["THREADS"])
    stages = 4 * template["STAGES"] * (
        template["BLOCK_ROWS"] * template["ROW_STRIDE"]
        + (1 + gated) * template["BLOCK_COLUMNS"]
        * (template["WORD_STRIDE"] + 2 * template["STAGE_GROUPS"]))
    assert tiles.shared_bytes >= stages
    assert static + tiles.shared_bytes <= launch.SHARED_BYTES["cuda"]
    if static + stages > 48 * 1024:
        assert tiles.shared_bytes > 48_000


def test_dynamic_shared_bytes():
    assert launch._dynamic_shared_bytes(4608, 40000) == 40000  # within 48 KB in all
    assert launch._dynamic_shared_bytes(4608, 46000) == launch.CUDA_OPT_IN_BYTES
    assert launch._dynamic_shared_bytes(4608, 95232) == 95232


# --- argsort_slice: a router's top k, index for index -------------------------------


def _router_values(rng, rows: int, row_size: int, name: str) -> np.ndarray:
    """Scores with ties (a few distinct values), both zeros, infinities and NaN
    of either sign among them, stored as `name`."""
    values = rng.choice([-np.inf, -2.5, -0.0, 0.0, 0.125, 1.0, 3.0, np.inf, np.nan, -np.nan],
                        (rows, row_size)).astype(np.float32)
    dense = rng.standard_normal((rows, row_size)).astype(np.float32)
    values = np.where(rng.random((rows, row_size)) < 0.5, dense, values)
    return ref.from_float32(values, name)


@given(rows=st.integers(1, 5), row_size=st.one_of(st.integers(1, 40), st.sampled_from(
           [128, 256, 512, launch.ARGSORT_SLICE_MAX_ROW])),
       name=st.sampled_from(launch.ROW_KINDS), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_argsort_slice_matches_reference(rows, row_size, name, data, seed):
    """Every slice of a row's stable sort: a router's top k (the last k), the
    first k, k = 1 and the whole row; ties, both zeros, infinities and NaN."""
    start = data.draw(st.integers(0, row_size - 1))
    count = data.draw(st.integers(1, row_size - start))
    values = _router_values(np.random.default_rng(seed), rows, row_size, name)
    _check_argsort_slice(values, start, count, name)


def _check_argsort_slice(values, start, count, name):
    """The indices against the reference's, and beside them the values at
    those indices, bit for bit (NaN payloads and signed zeros included)."""
    indices, slice_values = ocl.argsort_slice(values, start, count)
    want = ref.argsort_slice(values, start, count, name)
    np.testing.assert_array_equal(indices, want)
    picked = np.take_along_axis(values, want.astype(np.int64), axis=-1)
    assert slice_values.dtype == values.dtype
    np.testing.assert_array_equal(slice_values.view(f"u{values.itemsize}"),
                                  picked.view(f"u{values.itemsize}"))


@given(rows=st.integers(1, 5), row_size=st.one_of(st.integers(1, 40), st.sampled_from(
           [128, 512, launch.ARGSORT_SLICE_MAX_ROW])),
       name=st.sampled_from(launch.ROW_KINDS), data=st.data(), seed=st.integers(0, 2**32 - 1),
       router=st.booleans())
def test_argsort_slice_normalized_matches_reference(rows, row_size, name, data, seed, router):
    """NORMALIZE: the indices as without it, the values over their sum as the
    reference rounds them; a router's softmax scores, or rows with ties, both
    zeros, infinities and NaN (every NaN alike: its payload is the division's)."""
    start = data.draw(st.integers(0, row_size - 1))
    count = data.draw(st.integers(1, row_size - start))
    rng = np.random.default_rng(seed)
    if router:
        logits = rng.standard_normal((rows, row_size)).astype(np.float32)
        softmax = np.exp(logits - logits.max(-1, keepdims=True))
        values = ref.from_float32(softmax / softmax.sum(-1, keepdims=True), name)
    else:
        values = _router_values(rng, rows, row_size, name)
    indices, normalized = ocl.argsort_slice(values, start, count, normalize=True)
    want_indices = ref.argsort_slice(values, start, count, name)
    np.testing.assert_array_equal(indices, want_indices)
    want = ref.normalized(np.take_along_axis(values, want_indices.astype(np.int64), axis=-1),
                          name)
    assert normalized.dtype == values.dtype
    got_float, want_float = ref.to_float32(normalized, name), ref.to_float32(want, name)
    np.testing.assert_array_equal(np.isnan(got_float), np.isnan(want_float))
    bits = f"u{values.itemsize}"
    finite = ~np.isnan(want_float)
    np.testing.assert_array_equal(normalized.view(bits)[finite], want.view(bits)[finite])


def test_argsort_slice_rows_beyond_max_groups():
    """More rows than groups: each group ranks several rows in turn."""
    rng = np.random.default_rng(41)
    values = _router_values(rng, launch.MAX_GROUPS + 300, 8, "bfloat16")
    _check_argsort_slice(values, 4, 4, "bfloat16")


def test_argsort_slice_reference_is_a_stable_sort():
    # Ties keep index order, NaN sorts last, -0.0 and 0.0 tie: what MLX's GPU
    # merge sort gives (its compare puts NaN after every number, and it takes
    # from the left run on ties).
    values = np.array([[1.0, np.nan, -0.0, 1.0, 0.0, -np.inf, -np.nan]], np.float32)
    assert np.signbit(values[0, 6])
    assert ref.argsort_slice(values, 0, 7).tolist() == [[5, 2, 4, 0, 3, 1, 6]]


# --- head_norm_rope: an attention's queries and keys, normalized and rotated ---------

@given(batch=st.integers(1, 4), length=st.integers(1, 3), q_heads=st.integers(1, 5),
       k_heads=st.integers(1, 3),
       head_dim=st.sampled_from([2, 4, 16, 64, 128, 256, launch.HEAD_NORM_ROPE_MAX_HEAD]),
       name=st.sampled_from(launch.ROW_KINDS), joined=st.booleans(),
       per_sequence=st.booleans(), scale=st.sampled_from([1.0, 0.25]),
       base=st.sampled_from([1e4, 1e6]), eps=st.sampled_from([1e-6, 1e-5]),
       seed=st.integers(0, 2**32 - 1))
def test_head_norm_rope_matches_reference(batch, length, q_heads, k_heads, head_dim, name,
                                          joined, per_sequence, scale, base, eps, seed):
    """Queries and keys read from one GEMM's output (Qwen3's q, k and v
    joined) or from arrays apart with columns before the heads; an offset a
    sequence or one for all, from a padded prompt's negative ones to a long
    context's; a head of zeros or
    of values small beside the norm's epsilon among others, against the reference
    within `head_norm_rope_tolerance`; every output element written (the
    harness poisons them)."""
    rng = np.random.default_rng(seed)
    q_columns, k_columns = q_heads * head_dim, k_heads * head_dim

    def rows(width, at):
        values = rng.standard_normal((batch, length, width)).astype(np.float32) * 3
        # The first head zeros, or small enough that the norm's epsilon counts.
        values[..., at:at + head_dim] *= rng.choice([0.0, 1e-3, 1.0])
        return ref.from_float32(values, name)

    if joined:  # queries, keys, then values
        queries_in = keys_in = rows(q_columns + 2 * k_columns, 0)
        q_at, k_at = 0, q_columns
    else:
        q_at, k_at = int(rng.integers(0, 3)) * head_dim, int(rng.integers(0, 5))
        queries_in, keys_in = rows(q_at + q_columns, q_at), rows(k_at + k_columns + 3, k_at)
    q_weight, k_weight = (ref.from_float32(rng.standard_normal(head_dim).astype(np.float32), name)
                          for _ in range(2))
    # A batch cache's offsets are negative while a left-padded prompt's padding lasts.
    offsets = rng.integers(-8, 5000, batch if per_sequence else 1).astype(np.int32)
    args = (q_weight, k_weight, offsets, q_heads, k_heads, q_at, k_at, eps, base, scale)
    actual = ocl.head_norm_rope(queries_in, keys_in, *args)
    expected = ref.head_norm_rope(queries_in, keys_in, *args, name)
    positions = np.broadcast_to(offsets[:, None], (batch, 1)) + np.arange(length)
    check_head_norm_rope(actual, expected, positions, name, scale)


def test_head_norm_rope_items_beyond_max_groups():
    """More heads of rows than groups: each group makes several in turn."""
    rng = np.random.default_rng(43)
    batch, q_heads, k_heads, head_dim = launch.MAX_GROUPS // 8 + 5, 6, 2, 4
    joined = ref.from_float32(rng.standard_normal((batch, 1, (q_heads + 2 * k_heads) * head_dim))
                              .astype(np.float32), "bfloat16")
    weight = ref.from_float32(rng.standard_normal(head_dim).astype(np.float32) + 1, "bfloat16")
    offsets = np.array([100], np.int32)
    args = (weight, weight, offsets, q_heads, k_heads, 0, q_heads * head_dim, 1e-6, 1e6, 1.0)
    actual = ocl.head_norm_rope(joined, joined, *args)
    expected = ref.head_norm_rope(joined, joined, *args, "bfloat16")
    positions = np.full((batch, 1), 100)
    check_head_norm_rope(actual, expected, positions, "bfloat16", 1.0)


# --- decode_attention: a decoding step's attention -----------------------------------

def _attention_inputs(rng, batch, heads, kv_heads, head_dim, length, name, sinks, spread=1.0):
    """Queries, a cache's key and value buffers of `length` keys, sinks or None."""
    def stored(shape, scale=spread):
        return ref.from_float32((rng.standard_normal(shape) * scale).astype(np.float32), name)

    return (stored((batch, heads, 1, head_dim)), stored((batch, kv_heads, length, head_dim)),
            stored((batch, kv_heads, length, head_dim), 1.0),
            stored((heads,), 2.0) if sinks else None)


@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 2),
       group=st.sampled_from([1, 2, 3, 8, 16]), head_dim=st.sampled_from([64, 128]),
       keys_count=st.sampled_from([1, 2, 15, 16, 17, 63, 64, 65, 129]),
       spare=st.sampled_from([0, 1, 37]), sinks=st.booleans(),
       mask_shape=st.sampled_from([None, "sequences", "heads", "both"]),
       name=st.sampled_from(launch.DECODE_ATTENTION_DTYPES),
       scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 2**32 - 1))
def test_decode_attention_matches_reference(batch, kv_heads, group, head_dim, keys_count, spare,
                                            sinks, mask_shape, name, scale, seed):
    """The first `keys_count` keys of a longer buffer (a cache's slice, read
    where it lies), one key to several splits' worth, key-value heads shared
    by 1 to 16 query heads (rows of the tensor cores' 16 unused or all), with
    and without sinks, with and without a boolean mask (a sequence's,
    a head's or both's, broadcast over the other, the step's own last key
    always attended as in mlx-lm's), against the float64 reference within
    `check_decode_attention`; every output written (the harness poisons
    them, the parts too)."""
    assume(launch.decode_attention_computes(head_dim, group * kv_heads, kv_heads, name))
    rng = np.random.default_rng(seed)
    heads = group * kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    queries, key_buffer, value_buffer, sink_logits = _attention_inputs(
        rng, batch, heads, kv_heads, head_dim, keys_count + spare, name, sinks, spread=2.0)
    mask = None
    if mask_shape is not None:
        shape = (batch if mask_shape in ("sequences", "both") else 1,
                 heads if mask_shape in ("heads", "both") else 1, 1, keys_count)
        mask = rng.random(shape) < 0.7
        mask[..., -1] = True
    actual = ocl.decode_attention(queries, key_buffer, value_buffer, keys_count, sink_logits,
                                  scale, mask)
    expected = ref.decode_attention(queries, key_buffer[:, :, :keys_count],
                                    value_buffer[:, :, :keys_count], sink_logits, scale, name,
                                    mask)
    check_decode_attention(actual, expected, value_buffer[:, :, :keys_count], name)


@pytest.mark.parametrize("groups", [launch.DECODE_ATTENTION_GROUPS, 1])
def test_decode_attention_scores_rising_and_falling(monkeypatch, groups):
    """Scores that grow along the keys and then fall, far apart (weights that
    underflow to 0): spread over many splits of one step each, and, with the
    groups aimed at cut to 1, all in one split of 11 steps, each raising the
    softmax's largest and rescaling what came before."""
    monkeypatch.setattr(launch, "DECODE_ATTENTION_GROUPS", groups)
    launch.decode_attention_launches.cache_clear()
    rng = np.random.default_rng(7)
    batch, heads, kv_heads, head_dim, keys_count = 1, 8, 1, 64, 700
    queries, key_buffer, value_buffer, _ = _attention_inputs(
        rng, batch, heads, kv_heads, head_dim, keys_count, "bfloat16", False)
    ramp = np.concatenate([np.linspace(0.1, 6, 400), np.linspace(6, -3, 300)]).astype(np.float32)
    keys = ref.to_float32(key_buffer, "bfloat16") * 0.05 + ramp[None, None, :, None]
    key_buffer = ref.from_float32(keys, "bfloat16")
    queries = ref.from_float32(np.abs(ref.to_float32(queries, "bfloat16")) + 0.5, "bfloat16")
    actual = ocl.decode_attention(queries, key_buffer, value_buffer, keys_count, None, 0.125)
    launch.decode_attention_launches.cache_clear()
    expected = ref.decode_attention(queries, key_buffer, value_buffer, None, 0.125, "bfloat16")
    check_decode_attention(actual, expected, value_buffer, "bfloat16")


def test_decode_attention_items_beyond_groups():
    """Fewer groups than work items in both launches (past MAX_GROUPS a
    launch's groups are capped): each group takes several in turn, its group
    memory reused after a barrier."""
    rng = np.random.default_rng(9)
    batch, heads, kv_heads, head_dim, keys_count = 3, 12, 4, 64, 150
    queries, key_buffer, value_buffer, sink_logits = _attention_inputs(
        rng, batch, heads, kv_heads, head_dim, keys_count, "float16", True)
    split_launch, merge_launch = launch.decode_attention_launches(
        batch, heads, kv_heads, head_dim, True, 0.125, "float16")
    parts = ocl.run([queries, key_buffer, value_buffer, np.ones((1, 1, 1, 1), bool)],
                    dataclasses.replace(split_launch, groups=7))
    (actual,) = ocl.run([*parts, sink_logits], dataclasses.replace(merge_launch, groups=5))
    expected = ref.decode_attention(queries, key_buffer, value_buffer, sink_logits, 0.125,
                                    "float16")
    check_decode_attention(actual, expected, value_buffer, "float16")


def test_decode_attention_reads_any_strides():
    """Keys and values whose values are not contiguous (every other element of
    wider rows), and every pointer taken as not 16-byte aligned
    (`unaligned_buffers`): the body's value-by-value loads, against the
    reference."""
    rng = np.random.default_rng(11)
    batch, heads, kv_heads, head_dim, keys_count, length = 2, 6, 2, 64, 90, 100
    queries, wide_keys, wide_values, sink_logits = _attention_inputs(
        rng, batch, heads, kv_heads, 2 * head_dim, length, "bfloat16", True)
    queries = np.ascontiguousarray(queries[..., :head_dim])
    split_launch, merge_launch = launch.decode_attention_launches(
        batch, heads, kv_heads, head_dim, True, head_dim ** -0.5, "bfloat16")
    strides = tuple(stride // 2 for stride in wide_keys.strides[:3]) + (2,)
    views = {"keys": ((batch, kv_heads, keys_count, head_dim), strides),
             "values": ((batch, kv_heads, keys_count, head_dim), strides)}
    with ocl.unaligned_buffers():
        parts = ocl.run([queries, wide_keys, wide_values, np.ones((1, 1, 1, 1), bool)],
                        split_launch, views)
    (actual,) = ocl.run([*parts, sink_logits], merge_launch)
    keys, values = (wide[:, :, :keys_count, ::2] for wide in (wide_keys, wide_values))
    expected = ref.decode_attention(queries, keys, values, sink_logits, head_dim ** -0.5,
                                    "bfloat16")
    check_decode_attention(actual, expected, values, "bfloat16")


# --- add_rms_norm: a residual add and the RMS norm after it ------------------------

@given(rows=st.integers(1, 5),
       dims=st.sampled_from([1, 2, 7, 32, 255, 256, 257, 2048, 2880, 4096]),
       name=st.sampled_from(launch.ROW_KINDS), eps=st.sampled_from([1e-6, 1e-5]),
       seed=st.integers(0, 2**32 - 1))
def test_add_rms_norm_matches_reference(rows, dims, name, eps, seed):
    """Rows of the residual stream and a block's update of every width a group
    takes in one pass or several, against the reference: the sums bit for
    bit, the norm within `check_add_rms_norm`'s tolerance; a row whose update
    cancels the residual (sums of zeros: the norm is the epsilon's alone), one
    of values small beside the epsilon, one of large ones; every output
    element written (the harness poisons them)."""
    rng = np.random.default_rng(seed)
    residual = rng.standard_normal((rows, dims)).astype(np.float32) * 4
    update = rng.standard_normal((rows, dims)).astype(np.float32)
    scales = rng.choice([0.0, 1e-3, 1.0, 1.0, 300.0], size=(rows, 1)).astype(np.float32)
    residual, update = residual * scales, update * scales
    cancels = rng.integers(0, rows)
    residual = ref.from_float32(residual, name)
    update = ref.from_float32(update, name)
    if rng.random() < 0.3:
        cancelled = -ref.to_float32(residual[cancels], name)
        update[cancels] = ref.from_float32(cancelled, name)
    weight = ref.from_float32(rng.standard_normal(dims).astype(np.float32) + 1, name)
    check_add_rms_norm(ocl.add_rms_norm(residual, update, weight, eps),
                       ref.add_rms_norm(residual, update, weight, eps, name), name)


def test_add_rms_norm_rows_beyond_max_groups():
    """More rows than groups: each group makes several in turn."""
    rng = np.random.default_rng(45)
    rows, dims = launch.MAX_GROUPS + 3, 4
    residual, update = (ref.from_float32(rng.standard_normal((rows, dims)).astype(np.float32),
                                         "bfloat16") for _ in range(2))
    weight = ref.from_float32(rng.standard_normal(dims).astype(np.float32) + 1, "bfloat16")
    check_add_rms_norm(ocl.add_rms_norm(residual, update, weight, 1e-6),
                       ref.add_rms_norm(residual, update, weight, 1e-6, "bfloat16"), "bfloat16")
