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
the row (4.3 us a layer at batch 32; both under Nsight Compute:
benchmarks/RESULTS.md, "A decoding step's kernels").
Elsewhere (the CPU, whose `argpartition` does not sort) these are mlx-lm's
own expressions, so a patched model routes as the unpatched one on every
backend. The same launch gives the scores at those indices
(`top_k_scores`), which the routers would otherwise gather with
`take_along_axis`, a launch more.
"""

from __future__ import annotations

import mlx.core as mx

from . import _backend, rules


def _sorter(values: mx.array, k: int, stream: mx.Stream) -> _backend.ArgsortSlice | None:
    """The backend's argsort_slice where it computes this router's top k on
    `stream`; None elsewhere (the CPU's `argpartition` does not sort)."""
    if stream.device.type != mx.gpu or _backend.gpu_backend() is None or values.ndim < 1:
        return None
    backend = _backend.implementation(stream)
    row_size = values.shape[-1]
    if 1 <= k <= row_size and backend.argsort_slice_computes(row_size=row_size,
                                                             dtype=values.dtype):
        return backend.argsort_slice
    return None


def top_k(scores: mx.array, k: int) -> mx.array:
    """`mx.argpartition(scores, kth=-k, axis=-1)[..., -k:]`, the indices of
    the k largest scores, as MLX computes them.

    Args:
        scores (array): Float scores `[..., E]`.
        k (int): Experts a token, `1 <= k <= E`.

    Returns:
        array: uint32 `[..., k]`, no gradient.
    """
    return _partition_slice(scores, k, largest=True)[0]


def top_k_scores(scores: mx.array, k: int, *,
                 normalize: bool = False) -> tuple[mx.array, mx.array]:
    """`top_k(scores, k)` and the scores it picks, `mx.take_along_axis(scores,
    indices, axis=-1)`: on a GPU from the same launch (no gather after it).

    Args:
        scores (array): Float scores `[..., E]`.
        k (int): Experts a token, `1 <= k <= E`.
        normalize (bool): The picked scores divided by their sum,
          `picked / mx.sum(picked, axis=-1, keepdims=True)`, as a router that
          renormalizes its top k computes them: by those ops after the launch,
          or inside it where `rules.top_k_normalizes` says so
          (kernels/argsort_slice.h says how it rounds). Default: ``False``.

    Returns:
        tuple(array, array): uint32 indices `[..., k]` (no gradient), and
        their scores `[..., k]` in `scores`' dtype, bit for bit
        `take_along_axis`'s (then the ops' where normalized), with its gradient.
    """
    return _partition_slice(scores, k, largest=True, normalize=normalize)


def bottom_k(values: mx.array, k: int) -> mx.array:
    """`mx.argpartition(values, kth=k - 1, axis=-1)[..., :k]`, the indices of
    the k smallest values, as MLX computes them.

    Args:
        values (array): Float values `[..., E]`.
        k (int): Experts a token, `1 <= k <= E`.

    Returns:
        array: uint32 `[..., k]`, no gradient.
    """
    return _partition_slice(values, k, largest=False)[0]


def _partition_slice(values: mx.array, k: int, largest: bool,
                     normalize: bool = False) -> tuple[mx.array, mx.array]:
    """The last k (`largest`) or the first k of `values`' argpartition, and
    the values at them (lazy: where unread, no kernel runs for them on the
    CPU), over their sum with `normalize`."""
    stream = _backend.resolve_stream(None)
    argsort_slice = _sorter(values, k, stream)
    if argsort_slice is None:
        order = mx.argpartition(values, kth=-k if largest else k - 1, axis=-1)
        indices = mx.stop_gradient(order[..., -k:] if largest else order[..., :k])
        picked = mx.take_along_axis(values, indices, axis=-1)
    else:
        start = values.shape[-1] - k if largest else 0
        in_launch = normalize and rules.top_k_normalizes(cuda=_backend.on_cuda(stream))
        indices, picked = argsort_slice(values, start, k, normalize=in_launch, stream=stream)
        indices = mx.stop_gradient(indices)
        if in_launch:
            return indices, picked
    if normalize:
        picked = picked / mx.sum(picked, axis=-1, keepdims=True)
    return indices, picked
