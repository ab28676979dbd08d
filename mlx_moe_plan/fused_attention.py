"""mlx-lm attentions whose decoding step `patch_model` makes in the
package's launches: the queries' and keys' norms and rotary embedding in
one, the attention in another.

Qwen3-MoE's attention normalizes each query and key head with an RMS norm of
its own (`q_norm`, `k_norm`) and then rotates it (`rope`): on a GPU, a launch
each for the queries' norm, the keys' norm and their two rotations, and a
copy before each norm where the projections' outputs are parts of one GEMM's
(`projections.Siblings`). In a decoding step, where
`rules.fuses_head_norm_rope` says so, the fused attention makes both from
the projections' outputs in one launch of kernels/head_norm_rope.h
(`_backend.HeadNormRope`), reading the queries and keys where the one GEMM
wrote them. Qwen3-MoE's and gpt-oss's attentions (the latter with its
sinks) then attend each sequence's one query a head to its cache (on CUDA
MLX hands that to cuDNN, or to a vector kernel that reads the keys once a
query head); where `rules.decodes_attention` says so, with no mask or a
boolean one (mlx-lm's batch cache's) and a cache of plain keys and values,
the fused attention hands that to
kernels/decode_attention.h (`_backend.DecodeAttention`), which reads each
key and value once for the query heads that share it. Each launch is taken or not on its own; where
one is not, the attention's own ops run in its place, and where neither is,
its own `__call__`.

Its forwards mirror mlx-lm's code, so each is used only while that code
reads as it did when the forward was written: each entry keeps a digest of
the class's `__call__` source (mlx-lm 0.32.2), as `fused_blocks.py` does for
the MoE blocks; `tests/test_fused_attention.py` names any whose digest no
longer matches the installed mlx-lm.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from . import _backend, projections, rules
from ._backend import on_cuda
from ._checks import decoding_mask_fits
from ._compiled import module_cache, step_rows
from .fused_blocks import qualified_name, source_digest, swap_class


class Launches(NamedTuple):
    """Which of its launches a fused attention takes for a decoding step."""
    head_norm_rope: bool  # its queries' and keys' norms and rotations in one
    attention: bool  # its attention, `_backend.DecodeAttention`


class FusedAttentionEntry(NamedTuple):
    """An attention class whose `__call__` a forward here mirrors."""
    digest: str  # of the class's `__call__` source (mlx-lm 0.32.2)
    forward: Callable  # `forward(attention, x, mask, cache, launches, code)`: the mirror
    sizes: Callable[[nn.Module], tuple[int, int, int]]  # query and key-value heads, head_dim
    head_norm_rope: bool  # whether the forward can take the norms' and rotations' launch


class FusedAttention:
    """Marks an mlx-lm attention whose class `patch_model` swapped for a
    subclass of its own that takes a decoding step's launches where the
    rules say so: its queries' and keys' norms and rotations in one
    (Qwen3-MoE's, `rules.fuses_head_norm_rope`), its attention in another
    (`rules.decodes_attention`)."""


def fusable(module: nn.Module) -> bool:
    """Whether `module` is an attention of `FUSED_ATTENTION`, its code as the
    entry's, not fused yet."""
    attention_class = type(module)
    entry = FUSED_ATTENTION.get(qualified_name(attention_class))
    return entry is not None and source_digest(attention_class.__call__) == entry.digest


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


def _route(attention: nn.Module, x: mx.array, entry: FusedAttentionEntry) -> Launches:
    """The launches `attention` may take for `x`, a decoding step's rows,
    whatever its mask and cache. Asked once for each shape and dtype of `x`,
    the norms' dtypes (where it has the norms' launch) and kind of device,
    then kept on the attention (its `ModuleCache`, which `_compiled.forget`
    drops): every layer asks at every step."""
    key = (x.shape, x.dtype, mx.default_device().type)
    if entry.head_norm_rope:
        # As the module's dictionary's items: its attribute lookups cost the
        # host more than the rest of the key.
        key += (attention["q_norm"]["weight"].dtype, attention["k_norm"]["weight"].dtype)
    routes = module_cache(attention, "_attention_routes")
    route = routes.get(key)
    if route is None:
        route = routes[key] = Launches(
            entry.head_norm_rope and _asked_route(attention, x),
            _asked_attention_route(attention, x, entry))
    return route


def _asked_route(attention: nn.Module, x: mx.array) -> bool:
    """Whether `attention` makes its queries and keys of `x` in one launch: a
    decoding step's rows where `rules.fuses_head_norm_rope` says so, with a
    plain `nn.RoPE` over whole heads, norms of one epsilon and of the rows'
    dtype, and a backend that has the launch."""
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


def _may_decode_attention(rows: int, *, cuda: bool) -> bool:
    """Whether `rules.decodes_attention` says yes for `rows` with a mask or
    without one: the route is kept for a shape of the rows, whatever the
    mask, and `_forward` asks for the step's own."""
    return (rules.decodes_attention(rows, cuda=cuda)
            or rules.decodes_attention(rows, cuda=cuda, masked=True))


def _asked_attention_route(attention: nn.Module, x: mx.array,
                           entry: FusedAttentionEntry) -> bool:
    """Whether `attention` may attend by the backend's launch for `x`: a
    decoding step's rows where `rules.decodes_attention` says so with a mask
    or without, and a backend that has the launch for the attention's heads
    in `x`'s dtype. The keys' count grows every step and is not asked: the
    launch takes any."""
    rows = step_rows(x)
    if rows == 0 or not _may_decode_attention(rows, cuda=on_cuda()):
        return False
    heads, kv_heads, head_dim = entry.sizes(attention)
    backend = _backend.implementation(_backend.resolve_stream(None))
    return (backend.decode_attention is not None
            and backend.decode_attention_computes(head_dim=head_dim, heads=heads,
                                                  kv_heads=kv_heads, dtype=x.dtype))


def _forward(attention: nn.Module, x: mx.array, mask, cache, entry: FusedAttentionEntry,
             code: ModuleType, attends: bool) -> mx.array | None:
    """The entry's forward of `attention` with the launches `_route` gives for
    `x`, the attention's only where `attends` (the rule's answer for this
    step's rows and mask) and mlx-lm would call MLX's attention with no mask
    or a boolean one (a quantized cache's goes to mlx-lm's own);
    None where it takes neither, or where the forward gives up (the
    attention's own call then runs). `code`: the module of the attention's
    class."""
    route = _route(attention, x, entry)
    boolean_mask = mask is None or (isinstance(mask, mx.array) and mask.dtype == mx.bool_)
    # The route said yes with a mask or without; `attends`, for this step's.
    launches = Launches(route.head_norm_rope, attends and route.attention and boolean_mask
                        and not hasattr(cache, "bits"))
    if not any(launches):
        return None
    return entry.forward(attention, x, mask, cache, launches, code)


def _head_norm_rope(attention: nn.Module, x: mx.array,
                    cache) -> tuple[mx.array, mx.array, mx.array] | None:
    """Qwen3-MoE's queries, keys and values of `x` as mlx-lm's lines make them
    before the cache's update, but that the queries' and keys' norms and
    rotations are one launch, which reads the projections' outputs where
    their one GEMM wrote them (`projections.joined`); None where the cache's
    offsets are not ones the launch reads, or where the projections give
    another dtype than the norms' (float32 scales, say: the lazy outputs
    made here are then never computed)."""
    offsets = _offsets(cache)
    if offsets is None:
        return None
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
    return queries, keys, values


def _attention(launch: bool, dtype: mx.Dtype, queries: mx.array, keys: mx.array,
               values: mx.array, sinks: mx.array | None, *, cache, scale: float, mask,
               code: ModuleType) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` of `code` as the attentions
    call it, or, where `launch` and the queries, keys, values and sinks are
    all of `dtype` (the rows' dtype, which the route asked the backend
    about) and the mask, if any, one a sequence or all and one a head or
    all over the keys, the backend's `decode_attention`: the same
    attention."""
    batch, heads = queries.shape[:2]
    if (launch and queries.dtype == keys.dtype == values.dtype == dtype
            and (sinks is None or sinks.dtype == dtype) and keys.shape[-2] >= 1
            and (mask is None
                 or decoding_mask_fits(mask.shape, batch, heads, keys.shape[-2]))):
        stream = _backend.resolve_stream(None)
        return _backend.implementation(stream).decode_attention(
            queries, keys, values, sinks, scale=scale, stream=stream, mask=mask)
    return code.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale,
                                             mask=mask, sinks=sinks)


def _qwen3_moe(attention: nn.Module, x: mx.array, mask, cache, launches: Launches,
               code: ModuleType) -> mx.array | None:
    """mlx-lm's Qwen3-MoE `Attention.__call__` with a cache, line for line,
    but that its queries' and keys' norms and rotations are one launch
    (`_head_norm_rope`) and its attention another (`_attention`) where
    `launches` says so; None where the norms' launch is the only one asked
    and cannot be taken."""
    B, L, D = x.shape
    made = _head_norm_rope(attention, x, cache) if launches.head_norm_rope else None
    if made is not None:
        queries, keys, values = made
    elif not launches.attention:
        return None
    else:
        queries, keys, values = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        queries = attention.q_norm(queries.reshape(B, L, attention.n_heads, -1)).transpose(
            0, 2, 1, 3)
        keys = attention.k_norm(keys.reshape(B, L, attention.n_kv_heads, -1)).transpose(
            0, 2, 1, 3)
        values = values.reshape(B, L, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries = attention.rope(queries, offset=cache.offset)
        keys = attention.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    output = _attention(launches.attention, x.dtype, queries, keys, values, None, cache=cache,
                        scale=attention.scale, mask=mask, code=code)
    output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
    return attention.o_proj(output)


def _gpt_oss(attention: nn.Module, x: mx.array, mask, cache, launches: Launches,
             code: ModuleType) -> mx.array:
    """mlx-lm's gpt-oss `AttentionBlock.__call__` with a cache, line for line,
    but that its attention (with the sinks) is one launch (`_attention`)
    where `launches` says so."""
    B, L, _ = x.shape
    D = attention.head_dim
    q = attention.q_proj(x).reshape(B, L, -1, D).swapaxes(1, 2)
    k = attention.k_proj(x).reshape(B, L, -1, D).swapaxes(1, 2)
    v = attention.v_proj(x).reshape(B, L, -1, D).swapaxes(1, 2)
    q = attention.rope(q, offset=cache.offset)
    k = attention.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    v_hat = _attention(launches.attention, x.dtype, q, k, v, attention.sinks, cache=cache,
                       scale=attention.sm_scale, mask=mask, code=code)
    return attention.o_proj(v_hat.swapaxes(1, 2).reshape(B, L, -1))


# The attention classes whose `__call__` a forward here mirrors, with that
# source's digest (mlx-lm 0.32.2).
FUSED_ATTENTION: dict[str, FusedAttentionEntry] = {
    "mlx_lm.models.qwen3_moe.Attention": FusedAttentionEntry(
        "9107ca69f9dfb65c", _qwen3_moe,
        lambda attention: (attention.n_heads, attention.n_kv_heads,
                           attention.q_norm.weight.shape[-1]),
        head_norm_rope=True),
    "mlx_lm.models.gpt_oss.AttentionBlock": FusedAttentionEntry(
        "907d3050ceb13722", _gpt_oss,
        lambda attention: (attention.num_attention_heads, attention.num_key_value_heads,
                           attention.head_dim),
        head_norm_rope=False),
}


def _fused_call(attention_class: type) -> Callable:
    code = sys.modules[attention_class.__module__]
    entry = FUSED_ATTENTION[qualified_name(attention_class)]

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        # The rules' rows first, as on CUDA: where they say no even there
        # (below their rows), the attention's own call costs no more than
        # unpatched.
        if cache is not None:
            rows = step_rows(x)
            attends = rules.decodes_attention(rows, cuda=True, masked=mask is not None)
            if attends or (entry.head_norm_rope and rules.fuses_head_norm_rope(rows, cuda=True)):
                y = _forward(self, x, mask, cache, entry, code, attends)
                if y is not None:
                    return y
        return attention_class.__call__(self, x, mask, cache)

    return __call__


def fuse(module: nn.Module) -> None:
    """Give `module`, a `fusable` attention, the fused call (in place)."""
    swap_class(module, FusedAttention, _fused_call, "with a decoding step's launches where "
               "the measured rules say so (see FusedAttention).")
