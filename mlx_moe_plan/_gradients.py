"""The gradients of `gather_rows` and `combine_rows`, written with the row
operations themselves, so that they run wherever those do.

The GPU backend differentiates its kernels with these (`_gpu.py`, through
`mx.custom_function`). The C++ primitives cannot call Python: their vjps
restate the same formulas in C++ (`GatherRows::vjp` in src/gather.cpp,
`CombineRows::vjp` in src/combine.cpp). tests/test_gradients.py runs these
with the CPU backend as the row operations and checks them against the C++
vjps on random plans, and checks the GPU's gradients against the C++ ones
where a GPU is present.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:  # for the annotations only: _backend imports the backends, which import this
    from ._backend import Backend


def gather_rows_vjp(
    backend: Backend,
    cotangent: mx.array,
    src: mx.array,
    inverse: mx.array,
    *,
    stream: mx.Stream,
) -> mx.array:
    """The cotangent of `src` in `out = gather_rows(src, index, inverse)`.

    Each src row was copied to the out rows its inverse lists: their
    cotangents sum, in float32 over the inverse's ascending columns, rounded
    once to `src.dtype` (an unweighted combine).

    Args:
        backend (Backend): The row operations to run it with.
        cotangent (array): The cotangent of `out`, `[R, H]`.
        src (array): The gathered rows, `[N, H]`.
        inverse (array): int32 `[N, M]`, the out rows that read each src row.
        stream (Stream): Where the row operations run.

    Returns:
        array: `[N, H]` of `src.dtype`.
    """
    return backend.combine_rows(cotangent, inverse, None, None, dtype=src.dtype, stream=stream)


def combine_rows_vjp(
    backend: Backend,
    cotangent: mx.array,
    src: mx.array,
    index: mx.array,
    weights: mx.array | None,
    inverse: mx.array,
    *,
    stream: mx.Stream,
) -> tuple[mx.array, mx.array | None]:
    """The cotangents of `src` and `weights` in
    `out = combine_rows(src, index, weights, inverse)`.

    `d src[r] = w[e] * d out[e // M]` with `e = inverse[r]` (zeros where
    `inverse[r] < 0`): a gather of the cotangent rows, scaled in float32 and
    rounded to `src.dtype`. `d w[n, m] = dot(d out[n], src[index[n, m]])` in
    float32 (zero where `index[n, m] < 0`, whose gathered row is zeros).

    Args:
        backend (Backend): The row operations to run it with.
        cotangent (array): The cotangent of `out`, `[N, H]`.
        src (array): The combined rows, `[R, H]`.
        index (array): int32 `[N, M]`.
        weights (array, optional): float32 `[N, M]`, or None for weights of 1.
        inverse (array): int32 `[R]`, the flat entry `n * M + m` that reads
          each src row.
        stream (Stream): Where the row operations run.

    Returns:
        tuple(array, array): `d src`, `[R, H]` of `src.dtype`, and `d weights`,
        float32 `[N, M]` (None without weights).
    """
    # The elementwise ops on the op's stream too, as the C++ vjp runs them,
    # not on the default device's (which may be another).
    with mx.stream(stream):
        fan_in = index.shape[1]
        used = inverse >= 0
        token = mx.where(used, inverse // fan_in, -1)
        # Differentiable in turn: `index` is the inverse of this gather.
        grad_src = backend.gather_rows(cotangent, token, index, dtype=src.dtype, stream=stream)
        if weights is None:
            return grad_src, None
        row_weight = mx.where(used, mx.take(weights.reshape(-1), mx.maximum(inverse, 0)), 0.0)
        grad_src = (grad_src.astype(mx.float32) * row_weight[:, None]).astype(src.dtype)
        picked = backend.gather_rows(src, index.reshape(-1), None, dtype=mx.float32,
                                     stream=stream)
        picked = picked.reshape(index.shape + (src.shape[1],))
        grad_weights = (picked * cotangent.astype(mx.float32)[:, None, :]).sum(-1)
        return grad_src, grad_weights
