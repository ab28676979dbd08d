"""The op benchmark's inputs: routing shaped like a real router's, and rows.

Routing is random but shaped like a real router: top-K of random logits by
`mx.argpartition` (K distinct experts per token), softmax weights over them in
the activation dtype. Ours and the peers get the same int32 ids, cast once
outside the timed region.
"""

from __future__ import annotations

import mlx.core as mx

from .workloads import LayerShape

# The activation dtypes, by the names the command line and the reference use.
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def dtype_name(dtype) -> str:
    """The name of one of DTYPES' dtypes."""
    return next(name for name, value in DTYPES.items() if value == dtype)


def routing(tokens: int, shape: LayerShape, dtype) -> tuple[mx.array, mx.array]:
    """Random router output: int32 ids `[T, K]` (K distinct experts per token), weights."""
    logits = mx.random.normal((tokens, shape.experts))
    picked = mx.argpartition(logits, kth=-shape.top_k, axis=-1)[..., -shape.top_k :]
    scores = mx.softmax(mx.take_along_axis(logits, picked, axis=-1), axis=-1, precise=True)
    return picked.astype(mx.int32), scores.astype(dtype)


def random_values(shape, dtype) -> mx.array:
    """Uniform values in [-1, 1) stored as `dtype`."""
    return mx.random.uniform(-1.0, 1.0, shape).astype(dtype)


def variant(base: mx.array, layer: int) -> mx.array:
    """A distinct copy of `base` for each layer: low mantissa bits flipped.

    Cheaper than drawing new random numbers on a CPU; the exponent is never
    touched, so values stay finite and no value becomes zero.
    """
    bits = base.view(mx.uint32 if base.dtype == mx.float32 else mx.uint16)
    return (bits ^ ((layer * 37 + 1) & 0x3F)).view(base.dtype)
