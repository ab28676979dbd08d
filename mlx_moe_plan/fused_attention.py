"""mlx-lm attention whose queries' and keys' norms and rotary embedding
`patch_model` makes one launch.

Qwen3-MoE's attention normalizes each query and key head with an RMS norm of
its own (`q_norm`, `k_norm`) and then rotates it (`rope`): on a GPU, a launch
each for the queries' norm, the keys' norm and their two rotations, and a
copy before each norm where the projections' outputs are parts of one GEMM's
(`projections.Siblings`). In a decoding step, where
`rules.fuses_head_norm_rope` says so, the fused attention makes both from
the projections' outputs in one launch of kernels/head_norm_rope.h
(`_backend.HeadNormRope`), reading the queries and keys where the one GEMM
wrote them. Everywhere else it calls the attention's own `__call__`, op for
op.

Its forward mirrors mlx-lm's code, so it is used only while that code reads
as it did when the forward was written: each entry keeps a digest of the
class's `__call__` source (mlx-lm 0.32.2), as `fused_blocks.py` does for the
MoE blocks; `tests/test_fused_attention.py` names any whose digest no longer
matches the installed mlx-lm.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from . import _backend, projections, rules
from ._backend import on_cuda
from ._compiled import module_cache, step_rows
from .fused_blocks import qualified_name, source_digest, swap_class

# The attention classes whose `__call__` `_forward` mirrors, and that
# source's digest (mlx-lm 0.32.2).
FUSED_ATTENTION: dict[str, str] = {
    "mlx_lm.models.qwen3_moe.Attention": "9107ca69f9dfb65c",
}


class FusedAttention:
    """Marks an mlx-lm attention whose class `patch_model` swapped for one
    that normalizes and rotates its queries and keys in one launch where
    `rules.fuses_head_norm_rope` says so (a subclass of its own class)."""


def fusable(module: nn.Module) -> bool:
    """Whether `module` is an attention of `FUSED_ATTENTION`, its code as the
    entry's, not fused yet."""
    attention_class = type(module)
    digest = FUSED_ATTENTION.get(qualified_name(attention_class))
    return digest is not None and source_digest(attention_class.__call__) == digest


# The last int offset and its array: a step's layers share one (their caches
# are at the same offset), where mlx-lm's rope makes one a call. Replaced
# whole, so a thread reads a matching pair.
_last_offset: tuple[int, mx.array] | None = None


def _offsets(cache) -> mx.array | None:
    """The cache's positions as head_norm_rope.h reads them: int32 `[1]` for
    one offset (`KVCache`), `[batch]` for one a sequence (`BatchKVCache`)."""
    global _last_offset
    offset = getattr(cache, "offset", None)
    if isinstance(offset, int):
        last = _last_offset
        if last is None or last[0] != offset:
            last = _last_offset = (offset, mx.array([offset], mx.int32))
        return last[1]
    if isinstance(offset, mx.array) and offset.ndim == 1:
        return offset.astype(mx.int32)
    return None


def _route(attention: nn.Module, x: mx.array) -> bool:
    """Whether `attention` makes its queries and keys of `x` in one launch: a
    decoding step's rows where `rules.fuses_head_norm_rope` says so, with a
    plain `nn.RoPE` over whole heads, norms of one epsilon and of the rows'
    dtype, and a backend that has the launch. Asked once for each shape and
    dtype of `x`, the norms' dtype and kind of device, then kept on the
    attention (its `ModuleCache`, which `_compiled.forget` drops): every
    layer asks at every step."""
    key = (x.shape, x.dtype, attention.q_norm.weight.dtype, attention.k_norm.weight.dtype,
           mx.default_device().type)
    routes = module_cache(attention, "_attention_routes")
    route = routes.get(key)
    if route is None:
        route = routes[key] = _asked_route(attention, x)
    return route


def _asked_route(attention: nn.Module, x: mx.array) -> bool:
    rows = step_rows(x)
    if rows == 0 or not rules.fuses_head_norm_rope(rows, cuda=on_cuda()):
        return False
    rope, q_norm, k_norm = attention.rope, attention.q_norm, attention.k_norm
    head_dim = q_norm.weight.shape[-1]
    stream = _backend.resolve_stream(None)
    backend = _backend.implementation(stream)
    return (type(rope) is nn.RoPE and not rope.traditional and rope.dims == head_dim
            and type(q_norm) is nn.RMSNorm and type(k_norm) is nn.RMSNorm
            and q_norm.eps == k_norm.eps and k_norm.weight.shape == (head_dim,)
            and q_norm.weight.dtype == k_norm.weight.dtype == x.dtype
            and backend.head_norm_rope is not None
            and backend.head_norm_rope_computes(head_dim=head_dim, dtype=x.dtype))


def _forward(attention: nn.Module, x: mx.array, mask, cache, offsets: mx.array,
             code: ModuleType) -> mx.array | None:
    """mlx-lm's Qwen3-MoE `Attention.__call__` with a cache, line for line,
    but that the queries' and keys' norms and rotations are one launch, which
    reads the projections' outputs where their one GEMM wrote them
    (`projections.joined`); None where the projections give another dtype
    than the norms' (float32 scales, say: the attention's own call then runs,
    and the lazy outputs made here are never computed). `code`: the module
    of the attention's class, whose `scaled_dot_product_attention` it calls."""
    B, L, D = x.shape
    head_dim = attention.q_norm.weight.shape[-1]
    q_columns = attention.n_heads * head_dim
    k_columns = attention.n_kv_heads * head_dim
    joined = projections.joined((attention.q_proj, attention.k_proj, attention.v_proj), x)
    if joined is None:
        queries_in, keys_in, values = attention.q_proj(x), attention.k_proj(x), \
            attention.v_proj(x)
        q_at = k_at = 0
    else:
        queries_in = keys_in = joined
        q_at, k_at = 0, q_columns
        values = joined[..., q_columns + k_columns:]
    if not queries_in.dtype == keys_in.dtype == x.dtype:
        return None
    stream = _backend.resolve_stream(None)
    queries, keys = _backend.implementation(stream).head_norm_rope(
        queries_in, keys_in, attention.q_norm.weight, attention.k_norm.weight, offsets,
        batch=B, q_heads=attention.n_heads, k_heads=attention.n_kv_heads, q_at=q_at,
        k_at=k_at, eps=attention.q_norm.eps, base=attention.rope.base,
        scale=attention.rope.scale, stream=stream)
    values = values.reshape(B, L, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
    keys, values = cache.update_and_fetch(keys, values)
    output = code.scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=attention.scale, mask=mask)
    output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
    return attention.o_proj(output)


def _fused_call(attention_class: type) -> Callable:
    code = sys.modules[attention_class.__module__]

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        # The rule's rows first, as on CUDA: where it says no even there (its
        # default), the attention's own call costs no more than unpatched.
        if (cache is not None and rules.fuses_head_norm_rope(step_rows(x), cuda=True)
                and _route(self, x)):
            offsets = _offsets(cache)
            y = None if offsets is None else _forward(self, x, mask, cache, offsets, code)
            if y is not None:
                return y
        return attention_class.__call__(self, x, mask, cache)

    return __call__


def fuse(module: nn.Module) -> None:
    """Give `module`, a `fusable` attention, the fused call (in place)."""
    swap_class(module, FusedAttention, _fused_call, "with its queries' and keys' norms and "
               "rotary embedding in one launch where the measured rule says so.")
