# Bad arguments against docs/DESIGN.md's error rule (no NumPy reference here): every
# error that shapes and dtypes reveal is a ValueError or TypeError raised at call
# time, and its message names the argument.

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

import mlx_moe_plan
from mlx_moe_plan import moe_combine, moe_gather, moe_plan, moe_unsort

ERRORS = (ValueError, TypeError)


def _names(argument: str) -> str:
    """A pattern for a message that names `argument`, and is not a binding's
    "incompatible function arguments" listing (which names every parameter)."""
    return rf"(?s)^(?!.*incompatible function arguments).*\b{re.escape(argument)}\b"


@pytest.fixture
def good(device):
    """Valid inputs (T = 6 as [2, 3], K = 2, E = 4, H = 5) that each test spoils once."""
    indices = mx.array([[[0, 1], [2, -1], [3, 3]], [[1, 0], [9, 2], [0, 0]]], mx.int32)
    weights = mx.full(indices.shape, 0.5, mx.float32)
    plan = moe_plan(indices, 4, weights=weights, tile_m=2, stream=device)
    x = mx.ones((2, 3, 5), mx.float32)
    rows = mx.ones((plan.capacity, 5), mx.float32)
    return dict(indices=indices, weights=weights, plan=plan, x=x, rows=rows)


# --- moe_plan ------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_indices",
    [
        pytest.param(mx.zeros((3, 2), mx.float32), id="float32"),
        pytest.param(mx.zeros((3, 2), mx.float16), id="float16"),
        pytest.param(mx.zeros((3, 2), mx.bool_), id="bool"),
        pytest.param(mx.array(1, mx.int32), id="0-d"),
        pytest.param(mx.zeros((3, 0), mx.int32), id="K=0"),
        pytest.param(np.zeros((3, 2), np.int32), id="numpy"),
        pytest.param([[0, 1]], id="list"),
    ],
)
def test_plan_rejects_bad_indices(bad_indices, device):
    with pytest.raises(ERRORS, match=_names("indices")):
        moe_plan(bad_indices, 4, stream=device)


@pytest.mark.parametrize(
    "num_experts",
    [0, -1, mlx_moe_plan.MAX_EXPERTS + 1, 4.0, "4", True, None],
    ids=["0", "-1", "1025", "float", "str", "bool", "None"],
)
def test_plan_rejects_bad_num_experts(num_experts, good, device):
    with pytest.raises(ERRORS, match=_names("num_experts")):
        moe_plan(good["indices"], num_experts, stream=device)


@pytest.mark.parametrize("num_experts", [1, mlx_moe_plan.MAX_EXPERTS])
def test_plan_accepts_num_experts_at_the_limits(num_experts, good, device):
    plan = moe_plan(good["indices"], num_experts, stream=device)
    assert plan.num_experts == num_experts


@pytest.mark.parametrize("tile_m", [0, -3, 2.0, "2", False],
                         ids=["0", "-3", "float", "str", "bool"])
def test_plan_rejects_bad_tile_m(tile_m, good, device):
    with pytest.raises(ERRORS, match=_names("tile_m")):
        moe_plan(good["indices"], 4, tile_m=tile_m, stream=device)


@pytest.mark.parametrize(
    "make_weights",
    [
        pytest.param(lambda shape: mx.ones(shape[:-1], mx.float32), id="missing K"),
        pytest.param(lambda shape: mx.ones(shape[:-1] + (shape[-1] + 1,)), id="K+1"),
        pytest.param(lambda shape: mx.ones(shape).reshape(-1, shape[-1]), id="flattened"),
        pytest.param(lambda shape: mx.ones(shape, mx.int32), id="int32"),
        pytest.param(lambda shape: mx.ones(shape, mx.bool_), id="bool"),
        pytest.param(lambda shape: np.ones(shape, np.float32), id="numpy"),
    ],
)
def test_plan_rejects_bad_weights(make_weights, good, device):
    with pytest.raises(ERRORS, match=_names("weights")):
        moe_plan(good["indices"], 4, weights=make_weights(good["indices"].shape), stream=device)


# --- moe_gather ----------------------------------------------------------------


@pytest.mark.parametrize(
    "make_x",
    [
        pytest.param(lambda: mx.ones((6, 5)), id="flattened tokens"),
        pytest.param(lambda: mx.ones((3, 2, 5)), id="swapped leading dims"),
        pytest.param(lambda: mx.ones((2, 4, 5)), id="wrong T"),
        pytest.param(lambda: mx.ones((2, 3)), id="missing H"),
        pytest.param(lambda: mx.array(1.0), id="0-d"),
        pytest.param(lambda: mx.ones((2, 3, 5), mx.int32), id="int32"),
        pytest.param(lambda: mx.ones((2, 3, 5), mx.bool_), id="bool"),
        pytest.param(lambda: np.ones((2, 3, 5), np.float32), id="numpy"),
    ],
)
def test_gather_rejects_bad_x(make_x, good, device):
    with pytest.raises(ERRORS, match=_names("x")):
        moe_gather(make_x(), good["plan"], stream=device)


@pytest.mark.parametrize("op", ["moe_gather", "moe_combine"])
@pytest.mark.parametrize("dtype", [mx.int32, mx.uint16, mx.bool_, mx.float64, "float16"],
                         ids=["int32", "uint16", "bool", "float64", "str"])
def test_rejects_bad_output_dtype(op, dtype, good, device):
    with pytest.raises(ERRORS, match=_names("dtype")):
        if op == "moe_gather":
            moe_gather(good["x"], good["plan"], dtype=dtype, stream=device)
        else:
            moe_combine(good["rows"], good["plan"], dtype=dtype, stream=device)


# --- rows: moe_combine and moe_unsort --------------------------------------------


def _bad_rows(capacity: int):
    return [
        pytest.param(lambda: mx.ones((capacity + 1, 5)), id="capacity+1"),
        pytest.param(lambda: mx.ones((capacity - 1, 5)), id="capacity-1"),
        pytest.param(lambda: mx.ones((capacity * 5,)), id="1-d"),
        pytest.param(lambda: mx.ones((1, capacity, 5)), id="3-d"),
        pytest.param(lambda: mx.ones((capacity, 5), mx.int32), id="int32"),
        pytest.param(lambda: np.ones((capacity, 5), np.float32), id="numpy"),
    ]


# The good plan's capacity: 12 entries + min(4, 12) * (2 - 1) = 16 rows.
GOOD_CAPACITY = 16


@pytest.mark.parametrize("make_rows", _bad_rows(GOOD_CAPACITY))
def test_combine_rejects_bad_rows(make_rows, good, device):
    assert good["plan"].capacity == GOOD_CAPACITY
    with pytest.raises(ERRORS, match=_names("rows")):
        moe_combine(make_rows(), good["plan"], stream=device)


@pytest.mark.parametrize("make_rows", _bad_rows(GOOD_CAPACITY))
def test_unsort_rejects_bad_rows(make_rows, good, device):
    assert good["plan"].capacity == GOOD_CAPACITY
    with pytest.raises(ERRORS, match=_names("rows")):
        moe_unsort(make_rows(), good["plan"], stream=device)


@pytest.mark.parametrize(
    "make_weights",
    [
        pytest.param(lambda: mx.ones((2, 3)), id="missing K"),
        pytest.param(lambda: mx.ones((6, 2)), id="flattened tokens"),
        pytest.param(lambda: mx.ones((2, 3, 3)), id="K+1"),
        pytest.param(lambda: mx.ones((2, 3, 2), mx.int32), id="int32"),
        pytest.param(lambda: np.ones((2, 3, 2), np.float32), id="numpy"),
    ],
)
def test_combine_rejects_bad_weights(make_weights, good, device):
    with pytest.raises(ERRORS, match=_names("weights")):
        moe_combine(good["rows"], good["plan"], weights=make_weights(), stream=device)


def test_combine_without_weights_anywhere(good, device):
    plan = moe_plan(good["indices"], 4, tile_m=2, stream=device)  # no weights
    with pytest.raises(ValueError, match=_names("weights")):
        moe_combine(good["rows"], plan, stream=device)


# --- the plan and stream arguments of every op -----------------------------------


def _calls(good, **kwargs):
    return {
        "moe_gather": lambda plan: moe_gather(good["x"], plan, **kwargs),
        "moe_combine": lambda plan: moe_combine(good["rows"], plan, **kwargs),
        "moe_unsort": lambda plan: moe_unsort(good["rows"], plan, **kwargs),
    }


@pytest.mark.parametrize("op", ["moe_gather", "moe_combine", "moe_unsort"])
@pytest.mark.parametrize("bad_plan", [None, "plan", {"capacity": 16}], ids=["None", "str", "dict"])
def test_ops_reject_a_plan_that_is_not_a_moe_plan(op, bad_plan, good, device):
    with pytest.raises(ERRORS, match=_names("plan")):
        _calls(good, stream=device)[op](bad_plan)


@pytest.mark.parametrize("op", ["moe_gather", "moe_combine", "moe_unsort"])
def test_ops_reject_a_plan_lookalike(op, good, device):
    # Duck typing is refused too: the fields' invariants are the plan's promise.
    from types import SimpleNamespace

    plan = good["plan"]
    fields = ("row_tokens", "row_experts", "row_weights", "row_entries", "positions",
              "num_experts", "tile_m", "capacity", "max_tiles", "top_k", "indices_shape")
    lookalike = SimpleNamespace(**{name: getattr(plan, name) for name in fields})
    with pytest.raises(ERRORS, match=_names("plan")):
        _calls(good, stream=device)[op](lookalike)


BAD_STREAMS = [pytest.param("cpu", id="str"), pytest.param(0, id="int"),
               pytest.param(mx.float32, id="dtype")]


@pytest.mark.parametrize("stream", BAD_STREAMS)
def test_plan_rejects_bad_stream(stream, good):
    with pytest.raises(ERRORS, match=_names("stream")):
        moe_plan(good["indices"], 4, stream=stream)


@pytest.mark.parametrize("op", ["moe_gather", "moe_combine", "moe_unsort"])
@pytest.mark.parametrize("stream", BAD_STREAMS)
def test_ops_reject_bad_stream(op, stream, good):
    with pytest.raises(ERRORS, match=_names("stream")):
        _calls(good, stream=stream)[op](good["plan"])


def test_stream_accepts_what_mlx_ops_accept(good, device):
    # mx ops take a Stream, a Device or a DeviceType (stream=mx.cpu is the usual
    # spelling); so do these ops, and all three give the same plan.
    indices = good["indices"]
    kind = mx.cpu if device.type == mx.DeviceType.cpu else mx.gpu
    assert mx.add(indices, 1, stream=kind).shape == indices.shape  # MLX's own convention
    plans = [moe_plan(indices, 4, tile_m=2, stream=stream)
             for stream in (mx.default_stream(device), device, kind)]
    for plan in plans[1:]:
        assert np.array_equal(np.array(plan.row_tokens), np.array(plans[0].row_tokens))
        moe_gather(good["x"], plan, stream=kind)


def test_plan_rejects_more_rows_than_int32_indexes(device):
    # A lazy broadcast: the shape alone decides, nothing is allocated.
    too_many_entries = mx.broadcast_to(mx.array(0, mx.int32), (2**27, 17))
    with pytest.raises(ValueError, match=_names("indices")):
        moe_plan(too_many_entries, 4, stream=device)
    # Padding alone can overflow: 2**20 entries, 1024 experts, tiles of 2**21.
    with pytest.raises(ValueError, match=_names("indices")):
        moe_plan(mx.zeros((2**20, 1), mx.int32), 1024, tile_m=2**21, stream=device)


def test_plan_tile_m_beyond_int32(device):
    # No tokens, so capacity is 0 whatever tile_m is: the call either works or
    # refuses tile_m by name, not with a binding's "incompatible arguments".
    try:
        plan = moe_plan(mx.zeros((0, 2), mx.int32), 4, tile_m=2**31, stream=device)
    except ERRORS as error:
        assert re.search(_names("tile_m"), str(error)), str(error)
    else:
        assert plan.capacity == 0 and plan.num_rows.item() == 0


def test_grouped_qmm_rejects_a_mismatched_up_row_tokens_or_bias():
    """The fused grouped GEMM's extra arguments are checked before any kernel
    runs (an `up` of fewer experts or columns would read past its arrays)."""
    from mlx_moe_plan import _gpu

    gpu = _gpu.GpuBackend("cuda")
    weight = mx.zeros((4, 16, 8), mx.uint32)
    scales = biases = mx.zeros((4, 16, 2), mx.bfloat16)
    plan_arrays = (mx.zeros((5,), mx.int32), mx.zeros((6,), mx.int32))
    rows = mx.zeros((3, 64), mx.bfloat16)
    kwargs = dict(bits=4, group_size=32, stream=mx.default_stream(mx.cpu))
    with pytest.raises(ValueError, match="up: its weight"):
        gpu.grouped_qmm(rows, weight, scales, biases, *plan_arrays, **kwargs,
                        up=(mx.zeros((2, 16, 8), mx.uint32), scales, biases))
    with pytest.raises(ValueError, match="up: its scales"):
        gpu.grouped_qmm(rows, weight, scales, biases, *plan_arrays, **kwargs,
                        up=(weight, scales.astype(mx.float16), biases))
    with pytest.raises(ValueError, match="row_tokens"):
        gpu.grouped_qmm(rows, weight, scales, biases, *plan_arrays, **kwargs,
                        row_tokens=mx.zeros((6,), mx.uint32))
    # The matrices against the rows' length, group and dtype (a narrower
    # weight would be read past its end; other scales read as the rows' type).
    for wrong in (mx.zeros((4, 16, 6), mx.uint32), mx.zeros((4, 16, 8), mx.int32),
                  mx.zeros((16, 8), mx.uint32)):
        with pytest.raises(ValueError, match="weight: expected"):
            gpu.grouped_qmm(rows, wrong, scales, biases, *plan_arrays, **kwargs)
    with pytest.raises(ValueError, match="weight: expected"):
        gpu.grouped_qmm(mx.zeros((3, 48), mx.bfloat16), weight, scales, biases, *plan_arrays,
                        **kwargs)
    for wrong in (scales.astype(mx.float32), mx.zeros((4, 16, 4), mx.bfloat16)):
        with pytest.raises(ValueError, match="scales: expected"):
            gpu.grouped_qmm(rows, weight, wrong, biases, *plan_arrays, **kwargs)
        with pytest.raises(ValueError, match="biases: expected"):
            gpu.grouped_qmm(rows, weight, scales, wrong, *plan_arrays, **kwargs)
    # The projections' biases: [E, N] in the rows' dtype (a shorter one would
    # be read past its end), up's with up and the gate's only; the clamped
    # SwiGLU with up only.
    up = (weight, scales, biases)
    bias = mx.zeros((4, 16), mx.bfloat16)
    for wrong in (mx.zeros((4, 8), mx.bfloat16), mx.zeros((4, 16), mx.float32)):
        with pytest.raises(ValueError, match="bias: expected"):
            gpu.grouped_qmm(rows, weight, scales, biases, *plan_arrays, **kwargs, bias=wrong)
        with pytest.raises(ValueError, match="up_bias: expected"):
            gpu.grouped_qmm(rows, weight, scales, biases, *plan_arrays, **kwargs, up=up,
                            bias=bias, up_bias=wrong)
    with pytest.raises(ValueError, match="up_bias"):
        gpu.grouped_qmm(rows, weight, scales, biases, *plan_arrays, **kwargs, up=up, bias=bias)
    with pytest.raises(ValueError, match="up_bias"):
        gpu.grouped_qmm(rows, weight, scales, biases, *plan_arrays, **kwargs, bias=bias,
                        up_bias=bias)
    with pytest.raises(ValueError, match="clamped_swiglu"):
        gpu.grouped_qmm(rows, weight, scales, biases, *plan_arrays, **kwargs,
                        clamped_swiglu=(1.702, 7.0))
    for wrong in ((1.702, -1.0), (float("nan"), 7.0), (1.702,)):
        with pytest.raises(ValueError, match="clamped_swiglu: expected"):
            gpu.grouped_qmm(rows, weight, scales, biases, *plan_arrays, **kwargs, up=up,
                            clamped_swiglu=wrong)
