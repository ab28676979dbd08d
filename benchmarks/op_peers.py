"""What our ops are timed against: mlx-lm's `switch_layers` path, and a copy.

- plan vs mlx-lm's index work: the index ops of `_gather_sort`, reproduced
  exactly (`argsort` of the flat ids, `argsort` of that order, the ids taken in
  that order); the row take of `_gather_sort` is timed under gather.
- gather (`tile_m=1`, so both make T*K rows) vs `_gather_sort`'s row take,
  `x.flatten(0, -3)[order // K]`, and vs a copy of the same bytes.
- combine vs `_scatter_unsort` followed by the model's weighted sum
  `(y * scores[..., None]).sum(axis=-2)`.
- unsort vs `_scatter_unsort`.

mlx-lm is optional: without it `mlx_lm` is None, `MLX_LM_MISSING` says why,
and only ours and the copy are timed.
"""

from __future__ import annotations

import mlx.core as mx

try:
    import mlx_lm
    from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort
except ImportError as error:
    mlx_lm = None
    MLX_LM_MISSING = f"{type(error).__name__}: {error}"
else:
    MLX_LM_MISSING = None


def copy_op(rows: mx.array) -> mx.array:
    """An honest copy: reads every byte of `rows` once and writes it once.

    `mx.array(rows)` records an `AsType` to the same dtype, which MLX evaluates
    with its plain contiguous copy (memcpy on the CPU, its vectorized copy
    kernel on a GPU). The obvious spellings are free instead: `astype` to the
    same dtype and `contiguous` of a contiguous array return their input.
    """
    return mx.array(rows)


def mlx_lm_gather_sort(x: mx.array, ids: mx.array):
    """mlx-lm's own `_gather_sort` on `x` shaped as `SwitchGLU` shapes it:
    the original that the reproductions below are checked against."""
    return _gather_sort(mx.expand_dims(x, (-2, -3)), ids)


def mlx_lm_index_work(ids: mx.array):
    """The index ops of `_gather_sort`, exactly, without its row take."""
    flat = ids.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    return order, flat[order], inv_order


def mlx_lm_take(x: mx.array, order: mx.array, top_k: int) -> mx.array:
    """`_gather_sort`'s row take, on `x` shaped as `SwitchGLU` shapes it."""
    x = mx.expand_dims(x, (-2, -3))
    return x.flatten(0, -3)[order // top_k]


def mlx_lm_unsort(rows: mx.array, inv_order: mx.array, shape) -> mx.array:
    """`SwitchGLU`'s tail: `_scatter_unsort` of the `[T*K, 1, H]` rows, then squeeze."""
    return _scatter_unsort(rows[:, None, :], inv_order, shape).squeeze(-2)


def mlx_lm_combine(rows: mx.array, inv_order: mx.array, scores: mx.array) -> mx.array:
    """`_scatter_unsort`, then the weighted sum the model applies to `SwitchGLU`'s output."""
    y = mlx_lm_unsort(rows, inv_order, scores.shape)
    return (y * scores[..., None]).sum(axis=-2)
