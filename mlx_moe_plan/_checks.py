"""Argument checks shared by the public ops: each error names the argument."""

from __future__ import annotations

import mlx.core as mx

ROW_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def check_array(name: str, value) -> mx.array:
    if not isinstance(value, mx.array):
        raise TypeError(f"{name}: expected an mlx.core.array, got {type(value).__name__}")
    return value


def check_row_dtype(name: str, dtype) -> None:
    if dtype not in ROW_DTYPES:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {dtype}")


def check_weights(weights, shape: tuple[int, ...]) -> mx.array:
    """Routing weights: a float array of the indices' shape."""
    check_array("weights", weights)
    if not mx.issubdtype(weights.dtype, mx.floating):
        raise TypeError(f"weights: expected a floating dtype, got {weights.dtype}")
    if weights.shape != shape:
        raise ValueError(f"weights: expected the indices' shape {shape}, got {weights.shape}")
    return weights


def check_rows(rows, capacity: int) -> mx.array:
    """Expert-sorted rows: a float array `[capacity, H]` of the plan's capacity."""
    check_array("rows", rows)
    check_row_dtype("rows", rows.dtype)
    if rows.ndim != 2 or rows.shape[0] != capacity:
        raise ValueError(
            f"rows: expected shape [capacity={capacity}, H], got {rows.shape}"
        )
    return rows


def check_tokens(x: mx.array, token_shape: tuple[int, ...]) -> mx.array:
    """Activations `[..., H]` whose leading shape is a plan's tokens'."""
    if x.ndim < 1 or x.shape[:-1] != token_shape:
        raise ValueError(
            f"x: expected shape {token_shape + ('H',)} to match the plan's tokens, got {x.shape}"
        )
    return x


def decoding_mask_fits(mask_shape: tuple[int, ...], batch: int, heads: int, keys: int) -> bool:
    """Whether a decoding step's attention mask of `mask_shape` is one
    `_backend.DecodeAttention` takes: `[batch or 1, heads or 1, 1, keys]`
    (its dtype, bool, is the caller's to check). The fused attention asks
    it to keep mlx-lm's call for another mask, the GPU glue to refuse one."""
    return (len(mask_shape) == 4 and mask_shape[0] in (1, batch)
            and mask_shape[1] in (1, heads) and tuple(mask_shape[2:]) == (1, keys))
