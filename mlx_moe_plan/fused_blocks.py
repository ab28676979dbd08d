"""mlx-lm MoE blocks whose experts' weighted sum `patch_model` fuses.

Each entry of `FUSED_BLOCKS` names an mlx-lm block class and holds a forward
that is that block's `__call__` line for line, except that the experts'
weighted sum, `(switch_mlp(x, inds) * scores[..., None]).sum(-2)`, is one
`SwitchGLU.weighted_sum` (one `moe_combine` in place of unsort, multiply and
sum), and that its top k is `routing.top_k_scores` or `routing.bottom_k` (the
same indices as its `argpartition`, and the scores its `take_along_axis`
picks, in one launch on a GPU). The forward mirrors mlx-lm's code, so it is
used only while that code reads as it did when the forward was written: each
entry keeps a digest of the block's `__call__` source (mlx-lm 0.32.2), and a
block whose source differs keeps its own call (patched experts, unfused sum,
still correct).
`tests/test_nn.py::test_fused_blocks_match_mlx_lm` names any block whose
digest no longer matches the installed mlx-lm and prints its new digest.

This module changes when mlx-lm's blocks change; the layer and its rule
live in `nn.py`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable, Hashable

import mlx.core as mx
import mlx.nn as nn

from . import routing
from ._compiled import compiled_if_small, submit_as_built


def _softmax_top_k(block: nn.Module, x: mx.array) -> tuple[mx.array, mx.array]:
    """Qwen3-MoE's and Qwen3-Next's routing: top-k of the softmax, renormalized."""
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    k = block.top_k
    # mlx-lm's argpartition slice and take_along_axis(gates, inds), then with
    # norm_topk_prob its `scores / mx.sum(scores, axis=-1, keepdims=True)`.
    inds, scores = routing.top_k_scores(gates, k, normalize=block.norm_topk_prob)
    return inds, scores


def _qwen3_moe(block: nn.Module, x: mx.array) -> mx.array:
    inds, scores = _softmax_top_k(block, x)
    return block.switch_mlp.weighted_sum(x, inds, scores, in_rows_dtype=True)


def _qwen3_next(block: nn.Module, x: mx.array) -> mx.array:
    inds, scores = _softmax_top_k(block, x)
    y = block.switch_mlp.weighted_sum(x, inds, scores)
    shared_y = mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return y + shared_y


def _mixtral(block: nn.Module, x: mx.array) -> mx.array:
    gates = block.gate(x)
    k = block.num_experts_per_tok
    inds = routing.bottom_k(-gates, k)
    scores = mx.softmax(mx.take_along_axis(gates, inds, axis=-1), axis=-1, precise=True)
    return block.switch_mlp.weighted_sum(x, inds, scores)


def _deepseek_v3(block: nn.Module, x: mx.array) -> mx.array:
    inds, scores = block.gate(x)
    y = block.switch_mlp.weighted_sum(x, inds, scores, in_rows_dtype=True)
    if block.config.n_shared_experts is not None:
        y = y + block.shared_experts(x)
    return y


# The digest of mlx_lm.models.gpt_oss.mlx_topk, which _gpt_oss mirrors
# (tests/test_routing.py says when it changes).
GPT_OSS_TOP_K_DIGEST = "12f0d87634ca5224"


def _gpt_oss(block: nn.Module, x: mx.array) -> mx.array:
    # The block's own top-k, mlx_lm.models.gpt_oss.mlx_topk (argpartition's
    # slice and take_along_axis), as routing.top_k_scores.
    indices, expert_logits = routing.top_k_scores(block.router(x), block.num_experts_per_tok)
    expert_weights = mx.softmax(expert_logits, axis=-1, precise=True)
    return block.experts.weighted_sum(x, indices, expert_weights)


@dataclass(frozen=True)
class FusedBlock:
    """One mlx-lm block class and the fused forward written against its code."""

    block_class: str
    """The class, `module.QualName`, as mlx-lm defines it."""
    experts: str
    """The block's attribute holding its `SwitchGLU`."""
    forward: Callable[[nn.Module, mx.array], mx.array]
    """`forward(block, x)`: the block's `__call__` with the weighted sum fused."""
    source_digest: str
    """SHA-256 prefix of the block's `__call__` source the forward mirrors."""

    def load_class(self) -> type:
        """The block class from the installed mlx-lm (ImportError if absent)."""
        return load_class(self.block_class)


FUSED_BLOCKS: dict[str, FusedBlock] = {entry.block_class: entry for entry in (
    FusedBlock("mlx_lm.models.qwen3_moe.Qwen3MoeSparseMoeBlock", "switch_mlp", _qwen3_moe,
               "5d2e8164fcb6ebfc"),
    FusedBlock("mlx_lm.models.qwen3_next.Qwen3NextSparseMoeBlock", "switch_mlp", _qwen3_next,
               "9c28cc63a2f1d683"),
    FusedBlock("mlx_lm.models.mixtral.MixtralSparseMoeBlock", "switch_mlp", _mixtral,
               "95e4c55589ec0085"),
    FusedBlock("mlx_lm.models.deepseek_v3.DeepseekV3MoE", "switch_mlp", _deepseek_v3,
               "5c396b22d20c5274"),
    FusedBlock("mlx_lm.models.gpt_oss.MLPBlock", "experts", _gpt_oss, "7c6ef1cd838840ed"),
)}


class FusedMoEBlock:
    """Marks an mlx-lm MoE block whose class `patch_model` swapped for one
    calling the fused forward (a subclass of the block's own class)."""

    submit_position: int | None = None
    """The block's position among the model's fused blocks, in layer order,
    which `patch_model(submit=True)` sets: a decoding step's call, and a
    prompt chunk's, submits its output for evaluation as soon as it is built
    where `rules.submits_block` says so for it (`_compiled.submit_as_built`).
    None: never. Expert-parallel layers never submit (not measured)."""


def qualified_name(cls: type) -> str:
    """`module.QualName` of `cls`, as the registries name classes."""
    return f"{cls.__module__}.{cls.__qualname__}"


def load_class(name: str) -> type:
    """The class `name`, `module.QualName`, from the installed mlx-lm
    (ImportError if absent)."""
    module, _, qualname = name.rpartition(".")
    return getattr(importlib.import_module(module), qualname)


@functools.cache  # once a class, not once a block of it
def source_digest(function) -> str | None:
    """SHA-256 prefix of `function`'s source; None if it has none to read."""
    try:
        return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]
    except (OSError, TypeError):  # no source to read: not known to be safe
        return None


def entry_for(module: nn.Module) -> FusedBlock | None:
    """The registry entry of `module`'s class, if its code is as the entry's."""
    block_class = type(module)
    entry = FUSED_BLOCKS.get(qualified_name(block_class))
    if entry is None or source_digest(block_class.__call__) != entry.source_digest:
        return None
    return entry


_SWAPPED_CLASSES: dict[tuple, type] = {}


def swap_class(module: nn.Module, marker: type, make_call: Callable[[type], Callable],
               doc: str, key: Hashable = None) -> None:
    """Make `module`, in place, an instance of a subclass of its own class and
    of `marker` whose `__call__` is `make_call(its class)`; the subclass is
    made once for each class, marker and `key` (what else the call closes
    over), named `Fused` and the class's name, its docstring the class's
    qualified name and `doc`. Its parameters stay the module's own."""
    own_class = type(module)
    swapped = _SWAPPED_CLASSES.get((own_class, marker, key))
    if swapped is None:
        swapped = _SWAPPED_CLASSES[own_class, marker, key] = type(
            f"Fused{own_class.__name__}", (own_class, marker),
            {"__call__": make_call(own_class), "__module__": marker.__module__,
             "__doc__": f"{own_class.__qualname__} {doc}"})
    module.__class__ = swapped


def fuse(module: nn.Module, entry: FusedBlock) -> None:
    """Give `module`, a block of `entry`'s class, the fused forward (in place)."""

    def fused_call(block_class: type) -> Callable:
        def __call__(self, x: mx.array) -> mx.array:
            # Distributed blocks (a sharding group set) keep their own call.
            if getattr(self, "sharding_group", None) is not None:
                return block_class.__call__(self, x)
            experts = self[entry.experts]
            y = compiled_if_small(self, lambda x: entry.forward(self, x), x,
                                  max_tokens=experts.compile_max_tokens,
                                  key=("block", experts.tile_m))
            if self.submit_position is not None and experts.expert_group is None:
                submit_as_built(y, x, self.submit_position,
                                max_tokens=experts.compile_max_tokens)
            return y

        return __call__

    swap_class(module, FusedMoEBlock, fused_call, "with the experts' weighted sum fused.",
               key=entry)
