"""Expert parallelism: each rank of a group keeps a contiguous range of experts.

mlx-lm shards MoE blocks by tensor parallelism: every rank keeps all E experts,
each cut to 1/N of its hidden width. Here each rank keeps whole experts,
`[r * E / N, (r + 1) * E / N)`, and the activations stay replicated: a rank
computes only the routed entries of its own experts (the plan skips the
others) and one `all_sum` of the block's `[T, D]` output adds the ranks' parts.
The layer (`nn.SwitchGLU`) does the shifting, skipping and summing once it
has an `expert_group`; this module cuts its projections and sets it.
`nn.shard_experts` is the entry point. With `tensor_parallel=True` the rest of
the model (attention, dense layers) is cut by mlx-lm's own `model.shard()`
first, while stand-ins hold the MoE blocks' places (`shard_all_but`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

# The projections of a SwitchGLU and their arrays whose first axis is the
# expert's: float weight and bias, quantized weight, scales and biases.
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_ARRAYS = ("weight", "scales", "biases", "bias")


def expert_range(num_experts: int, group: mx.distributed.Group) -> tuple[int, int]:
    """The experts `[start, stop)` rank `group.rank()` keeps.

    Args:
        num_experts (int): The layer's experts E.
        group (Group): The ranks sharing the experts.

    Returns:
        tuple[int, int]: `(r * E / N, (r + 1) * E / N)`.
    """
    size = group.size()
    if num_experts % size:
        raise ValueError(f"expert parallelism: the layer's {num_experts} experts do not "
                         f"divide among {size} ranks (E = {num_experts}, N = {size})")
    per_rank = num_experts // size
    return group.rank() * per_rank, (group.rank() + 1) * per_rank


def check_not_tensor_parallel(model: nn.Module) -> None:
    """Raise if mlx-lm's `model.shard()` already split `model`'s MoE blocks.

    Its blocks keep every expert, each cut in width, and sum over their
    `sharding_group` themselves; cutting their experts too would be wrong."""
    for path, module in model.named_modules():
        if getattr(module, "sharding_group", None) is not None:
            raise ValueError(f"expert parallelism: {path or 'the model'} is already "
                             "tensor-parallel (mlx-lm's model.shard()); use one or the other")


class _StandIn(nn.Module):
    """Holds an MoE block's place while mlx-lm's `model.shard()` runs.

    mlx-lm's `shard()` methods cut a block's experts in width and mark the
    block to sum its output over the group. Here every attribute their code
    reads is another stand-in holding no array, and arithmetic on it (gpt-oss
    divides the experts' bias by N) returns it, so all of that is a no-op.
    """

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self:
            self[name] = _StandIn()
        return self[name]

    def _same(self, _other):
        return self

    __truediv__ = __itruediv__ = __floordiv__ = __ifloordiv__ = _same
    __mul__ = __imul__ = __add__ = __iadd__ = __sub__ = __isub__ = _same


def shard_all_but(model: nn.Module, block_paths: list[str], group: mx.distributed.Group) -> None:
    """mlx-lm's `model.shard(group)` on all of `model` but the modules at `block_paths`.

    Attention and dense layers are cut as mlx-lm's tensor parallelism cuts
    them (their `all_sum`s included); the modules at `block_paths` (the MoE
    blocks) are swapped out for stand-ins meanwhile and come back untouched.

    Args:
        model (Module): An mlx-lm model with a `shard` method.
        block_paths (list[str]): Dotted paths of the modules to leave whole.
        group (Group): The ranks.
    """
    blocks = dict(model.named_modules())
    kept = [(path, blocks[path]) for path in block_paths]
    model.update_modules(tree_unflatten([(path, _StandIn()) for path in block_paths]))
    try:
        model.shard(group)
    finally:
        model.update_modules(tree_unflatten(kept))


def evaluate_sharded(model: nn.Module) -> None:
    """Evaluate the parameters of a lazily loaded model `shard_experts` split.

    The expert-parallel layers' arrays one by one first, each read and cut
    before the next is read, then the rest. Evaluated all at once, MLX reads
    every whole expert array before it cuts any: a peak above the whole
    model's, where this holds one whole array at a time besides the rank's own.

    Args:
        model (Module): The model, its parameters lazy.
    """
    for _, layer in model.named_modules():
        if getattr(layer, "expert_group", None) is not None:
            for _, array in tree_flatten(layer.parameters()):
                mx.eval(array)
    mx.eval(model.parameters())


def _expert_arrays(layer: nn.Module):
    """`(projection, key, array)` for each expert array of `layer`'s projections."""
    for name in _PROJECTIONS:
        projection = layer[name]
        for key in _EXPERT_ARRAYS:
            array = projection.get(key)
            if isinstance(array, mx.array):
                yield projection, key, array


def expert_bytes(layer: nn.Module) -> int:
    """Bytes of the expert arrays of `layer`'s projections: what `keep_experts`
    cuts, of a `SwitchGLU` (ours or mlx-lm's)."""
    return sum(array.nbytes for _, _, array in _expert_arrays(layer))


def keep_experts(layer: nn.Module, start: int, stop: int) -> None:
    """Keep experts `[start, stop)` of `layer`'s projections, in place.

    The slices are copies, so the arrays of the other experts are freed once
    nothing else holds them; lazy (not yet loaded) arrays stay lazy, and only
    the slices are ever computed.
    """
    for projection, key, array in list(_expert_arrays(layer)):
        projection[key] = mx.array(array[start:stop])
