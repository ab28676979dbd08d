"""mlx-lm models whose residual adds and the RMS norms after them
`patch_model` makes one launch each.

A Qwen3-MoE decoder layer adds its attention's output to the residual
stream and normalizes the sum for its MoE block; then it adds the block's
output, and the next layer (after the last, the model's final norm)
normalizes that sum for its attention. On a GPU each pair is two launches,
an add and `mx.fast.rms_norm`: four a layer. In a decoding step, where
`rules.fuses_add_rms_norm` says so, the fused model makes each pair in one
launch of kernels/add_rms_norm.h (`_backend.AddRmsNorm`): two a layer. The
sums are the layers' own bits; the norms are MLX's within their rounding.
Everywhere else it calls the model's own `__call__`, op for op.

Its forward mirrors mlx-lm's code of the model and of its decoder layers,
so it is used only while both read as they did when the forward was
written: each entry keeps a digest of both classes' `__call__` source
(mlx-lm 0.32.2), as `fused_blocks.py` does for the MoE blocks;
`tests/test_fused_model.py` names any whose digest no longer matches the
installed mlx-lm.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from . import _backend, rules
from ._backend import on_cuda
from ._compiled import module_cache, step_rows
from .fused_blocks import qualified_name, source_digest, swap_class


class FusedModelEntry(NamedTuple):
    """A model class whose `__call__` `_forward` mirrors, and its decoder layers'."""
    model_digest: str  # of the model class's `__call__` source (mlx-lm 0.32.2)
    layer_class: str  # `module.QualName` of its decoder layers
    layer_digest: str  # of their `__call__` source


FUSED_MODELS: dict[str, FusedModelEntry] = {
    "mlx_lm.models.qwen3_moe.Qwen3MoeModel": FusedModelEntry(
        "d0b5a530f93c1fd5", "mlx_lm.models.qwen3_moe.Qwen3MoeDecoderLayer", "937a607a6e7ea3c9"),
}


class FusedModel:
    """Marks an mlx-lm model whose class `patch_model` swapped for one that
    makes a decoding step's residual adds and the RMS norms after them one
    launch each where `rules.fuses_add_rms_norm` says so (a subclass of its
    own class)."""


def fusable(module: nn.Module) -> bool:
    """Whether `module` is a model of `FUSED_MODELS`, its code as the entry's,
    not fused yet."""
    entry = FUSED_MODELS.get(qualified_name(type(module)))
    return entry is not None and source_digest(type(module).__call__) == entry.model_digest


def _route(model: nn.Module, h: mx.array, entry: FusedModelEntry) -> bool:
    """Whether `model` makes the residual adds and norms of `h`'s step in one
    launch each: a decoding step's rows where `rules.fuses_add_rms_norm` says
    so, one process's layers (no pipeline), each its entry's decoder layer of
    the entry's code with `nn.RMSNorm`s of `h`'s dtype, and a backend that
    has the launch. Asked once for each shape and dtype of `h`, the final
    norm's dtype and kind of device, then kept on the model (its
    `ModuleCache`, which `_compiled.forget` drops)."""
    key = (h.shape, h.dtype, model.norm.weight.dtype, mx.default_device().type)
    routes = module_cache(model, "_model_routes")
    route = routes.get(key)
    if route is None:
        route = routes[key] = _asked_route(model, h, entry)
    return route


def _asked_route(model: nn.Module, h: mx.array, entry: FusedModelEntry) -> bool:
    rows = step_rows(h)
    if rows == 0 or not rules.fuses_add_rms_norm(rows, cuda=on_cuda()):
        return False
    if getattr(model, "pipeline_size", 1) != 1:
        return False
    layers = list(model.pipeline_layers)
    for layer in layers:
        if (qualified_name(type(layer)) != entry.layer_class
                or source_digest(type(layer).__call__) != entry.layer_digest):
            return False
    norms = [model.norm, *(norm for layer in layers
                           for norm in (layer.input_layernorm, layer.post_attention_layernorm))]
    backend = _backend.implementation(_backend.resolve_stream(None))
    return (bool(layers) and all(type(norm) is nn.RMSNorm and norm.weight.dtype == h.dtype
                                 and norm.weight.shape == h.shape[-1:] for norm in norms)
            and backend.add_rms_norm is not None
            and backend.add_rms_norm_computes(dtype=h.dtype))


def _forward(model: nn.Module, inputs: mx.array, cache, input_embeddings: mx.array | None,
             entry: FusedModelEntry, code: ModuleType) -> mx.array | None:
    """mlx-lm's Qwen3-MoE `Qwen3MoeModel.__call__` with a cache and one
    process's layers, and each `Qwen3MoeDecoderLayer.__call__` inside it,
    line for line, but that each residual add and the norm after it are one
    launch; None where `_route` says no, or where the caches are not one a
    layer (the model's own call then runs, and the lazy embedding made here is
    never computed). `code`: the module of the model's class, whose
    `create_attention_mask` it calls."""
    layers = model.pipeline_layers
    if len(cache) != len(layers):  # mlx-lm's loop would stop at the shorter
        return None
    if input_embeddings is not None:
        h = input_embeddings
    else:
        h = model.embed_tokens(inputs)
    if not _route(model, h, entry):
        return None
    stream = _backend.resolve_stream(None)
    launch = _backend.implementation(stream).add_rms_norm

    def add_rms_norm(h: mx.array, r: mx.array, norm: nn.RMSNorm) -> tuple[mx.array, mx.array]:
        # A block's output of another dtype or shape than the stream's, or a
        # stream whose dtype an earlier such output changed (the route checked
        # the norms against the first): the layer's own ops.
        if r.dtype != h.dtype or r.shape != h.shape or norm.weight.dtype != h.dtype:
            h = h + r
            return h, norm(h)
        return launch(h, r, norm.weight, eps=norm.eps, stream=stream)

    mask = code.create_attention_mask(h, cache[0])
    normed = layers[0].input_layernorm(h)
    for index, (layer, layer_cache) in enumerate(zip(layers, cache)):
        r = layer.self_attn(normed, mask, layer_cache)
        h, normed = add_rms_norm(h, r, layer.post_attention_layernorm)
        r = layer.mlp(normed)
        next_norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else model.norm
        h, normed = add_rms_norm(h, r, next_norm)
    return normed


def _step_rows(inputs: mx.array, input_embeddings: mx.array | None) -> int:
    """The rows of a decoding step's tokens `[B, 1]` (or embeddings `[B, 1,
    D]`), else 0."""
    if input_embeddings is not None:
        return step_rows(input_embeddings)
    shape = inputs.shape
    return shape[0] if len(shape) == 2 and shape[1] == 1 else 0


def _fused_call(model_class: type) -> Callable:
    code = sys.modules[model_class.__module__]
    entry = FUSED_MODELS[qualified_name(model_class)]

    def __call__(self, inputs: mx.array, cache=None,
                 input_embeddings: mx.array | None = None) -> mx.array:
        # The rule's rows first, as on CUDA: where it says no even there (its
        # default), the model's own call costs no more than unpatched.
        if (cache is not None
                and rules.fuses_add_rms_norm(_step_rows(inputs, input_embeddings), cuda=True)):
            y = _forward(self, inputs, cache, input_embeddings, entry, code)
            if y is not None:
                return y
        return model_class.__call__(self, inputs, cache, input_embeddings)

    return __call__


def fuse(module: nn.Module) -> None:
    """Give `module`, a `fusable` model, the fused call (in place)."""
    swap_class(module, FusedModel, _fused_call, "with each residual add and the RMS norm "
               "after it in one launch where the measured rule says so.")
