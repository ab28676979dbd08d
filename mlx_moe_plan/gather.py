"""`moe_gather` (tokens to expert-sorted rows) and its inverse `moe_unsort`."""

from __future__ import annotations

import math

import mlx.core as mx

from . import _backend
from ._checks import check_array, check_row_dtype, check_rows, check_tokens
from .plan import MoEPlan, check_plan


def moe_gather(
    x: mx.array,
    plan: MoEPlan,
    *,
    dtype: mx.Dtype | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """Copy each token's activations to the rows of its experts.

    ``X[row] = x[row_tokens[row]]``, converted to `dtype` in the same pass;
    padding and tail rows are zeros.

    Args:
        x (array): Activations `[..., H]` with the leading shape of the
          plan's `indices` without K (float32, float16 or bfloat16).
        plan (MoEPlan): The plan from :func:`moe_plan`.
        dtype (Dtype, optional): The rows' dtype. Default: `x.dtype`.
        stream (Stream or Device, optional): Where to run.

    Returns:
        array: The rows, `[capacity, H]` of `dtype`.
    """
    check_plan(plan)
    check_array("x", x)
    check_row_dtype("x", x.dtype)
    dtype = x.dtype if dtype is None else dtype
    check_row_dtype("dtype", dtype)
    token_shape = plan.indices_shape[:-1]
    check_tokens(x, token_shape)
    stream = _backend.resolve_stream(stream)
    num_tokens = math.prod(token_shape)
    tokens = x.reshape(num_tokens, x.shape[-1], stream=stream)
    inverse = plan._field("positions", (num_tokens, plan.top_k))
    return _backend.implementation(stream).gather_rows(
        tokens, plan.row_tokens, inverse, dtype=dtype, stream=stream
    )


def moe_unsort(
    rows: mx.array,
    plan: MoEPlan,
    *,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """Put the rows back in `[..., K, H]` entry order, the inverse of a gather.

    Args:
        rows (array): Expert-sorted rows `[capacity, H]`.
        plan (MoEPlan): The plan the rows were gathered with.
        stream (Stream or Device, optional): Where to run.

    Returns:
        array: `indices.shape + (H,)` in `rows.dtype`, zeros for skipped entries.
    """
    check_plan(plan)
    check_rows(rows, plan.capacity)
    stream = _backend.resolve_stream(stream)
    entries = plan._field("positions", (math.prod(plan.indices_shape),))
    inverse = plan._field("row_entries", (plan.capacity, 1))
    out = _backend.implementation(stream).gather_rows(
        rows, entries, inverse, dtype=rows.dtype, stream=stream
    )
    return out.reshape(plan.indices_shape + (rows.shape[-1],), stream=stream)
