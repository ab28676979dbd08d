"""`moe_combine`: the weighted sum of each token's expert rows."""

from __future__ import annotations

import math

import mlx.core as mx

from . import _backend
from ._checks import check_row_dtype, check_rows, check_weights
from .plan import MoEPlan, check_plan


def moe_combine(
    rows: mx.array,
    plan: MoEPlan,
    *,
    weights: mx.array | None = None,
    dtype: mx.Dtype | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array:
    """Sum each token's expert rows, weighted: ``y[t] = sum_k w[t,k] * rows[positions[t,k]]``.

    The sum runs over k in ascending order in float32 and is rounded once to
    `dtype`; skipped entries add nothing, a token with none is zeros.

    Args:
        rows (array): Expert-sorted rows `[capacity, H]`.
        plan (MoEPlan): The plan the rows were gathered with.
        weights (array, optional): Float weights, shape of the plan's
          `indices`. Default: the weights the plan was built with.
        dtype (Dtype, optional): The output's dtype: float32, float16 or
          bfloat16. Default: `rows.dtype`.
        stream (Stream or Device, optional): Where to run.

    Returns:
        array: `indices.shape[:-1] + (H,)` in `dtype`.
    """
    check_plan(plan)
    check_rows(rows, plan.capacity)
    dtype = rows.dtype if dtype is None else dtype
    check_row_dtype("dtype", dtype)
    if weights is None:
        weights = plan.entry_weights
        if weights is None:
            raise ValueError("weights: the plan carries no weights; pass weights=")
    else:
        check_weights(weights, plan.indices_shape)
    stream = _backend.resolve_stream(stream)
    num_tokens = math.prod(plan.indices_shape[:-1])
    positions = plan._field("positions", (num_tokens, plan.top_k))
    weights = weights.astype(mx.float32, stream=stream).reshape(num_tokens, plan.top_k,
                                                                 stream=stream)
    out = _backend.implementation(stream).combine_rows(
        rows, positions, weights, plan.row_entries, dtype=dtype, stream=stream
    )
    return out.reshape(plan.indices_shape[:-1] + (rows.shape[-1],), stream=stream)
