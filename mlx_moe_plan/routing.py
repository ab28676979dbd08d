"""A router's top k as mlx-lm's routers take it, in one launch on a GPU.

mlx-lm's MoE routers pick their experts with `mx.argpartition`: the k largest
scores as `argpartition(scores, kth=-k)[..., -k:]` (Qwen3-MoE, Qwen3-Next,
gpt-oss), or the k smallest of negated gates as `argpartition(-gates,
kth=k - 1)[..., :k]` (Mixtral). On a GPU, MLX's `argpartition` sorts each
row whole, with a stable merge sort that puts NaN last (MLX 0.32.4's CUDA and
Metal backends), and the router slices the sort: a sort kernel per layer and
step, about 12 us a decoding step's layer on the H200 for Qwen3-30B-A3B's 128
experts. There `kernels/argsort_slice.h` gives the same indices, in the
same order, in one launch of its own: each index is its element's rank in
the row (4.3 us a layer at batch 32; both under Nsight Compute, RESULTS.md).
Elsewhere (the CPU, whose `argpartition` does not sort) these are mlx-lm's
own expressions, so a patched model routes as the unpatched one on every
backend.
"""

from __future__ import annotations

import mlx.core as mx

from . import _backend
from .kernels import launch

_SORTED_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _sorts_here(values: mx.array, k: int, stream: mx.Stream) -> bool:
    """Whether the GPU's argsort_slice computes this router's top k on `stream`."""
    return (stream.device.type == mx.gpu and _backend.gpu_backend() is not None
            and values.dtype in _SORTED_DTYPES and values.ndim >= 1
            and 1 <= k <= values.shape[-1] <= launch.ARGSORT_SLICE_MAX_ROW)


def top_k(scores: mx.array, k: int) -> mx.array:
    """`mx.argpartition(scores, kth=-k, axis=-1)[..., -k:]`, the indices of
    the k largest scores, as MLX computes them.

    Args:
        scores (array): Float scores `[..., E]`.
        k (int): Experts a token, `1 <= k <= E`.

    Returns:
        array: uint32 `[..., k]`, no gradient.
    """
    return _partition_slice(scores, k, largest=True)


def bottom_k(values: mx.array, k: int) -> mx.array:
    """`mx.argpartition(values, kth=k - 1, axis=-1)[..., :k]`, the indices of
    the k smallest values, as MLX computes them.

    Args:
        values (array): Float values `[..., E]`.
        k (int): Experts a token, `1 <= k <= E`.

    Returns:
        array: uint32 `[..., k]`, no gradient.
    """
    return _partition_slice(values, k, largest=False)


def _partition_slice(values: mx.array, k: int, largest: bool) -> mx.array:
    """The last k (`largest`) or the first k of `values`' argpartition."""
    stream = _backend.resolve_stream(None)
    if not _sorts_here(values, k, stream):
        order = mx.argpartition(values, kth=-k if largest else k - 1, axis=-1)
        return mx.stop_gradient(order[..., -k:] if largest else order[..., :k])
    start = values.shape[-1] - k if largest else 0
    return _backend.implementation(stream).argsort_slice(values, start, k, stream=stream)
