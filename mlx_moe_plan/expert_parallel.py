"""Expert parallelism: each rank of a group keeps a contiguous range of experts.

mlx-lm shards MoE blocks by tensor parallelism: every rank keeps all E experts,
each cut to 1/N of its hidden width. Here each rank keeps whole experts,
`[r * E / N, (r + 1) * E / N)`, and the activations stay replicated: a rank
computes only the routed entries of its own experts (the plan skips the
others) and one `all_sum` of the block's `[T, D]` output adds the ranks' parts.
The layer (`nn.SwitchGLU`) does the shifting, skipping and summing once it
has an `expert_group`, by `ShardedExperts`, its runtime here; `shard_layers`
cuts its projections and sets it. `nn.shard_experts` is the entry point.
With `tensor_parallel=True` the rest of the model (attention, dense layers)
is cut by mlx-lm's own `model.shard()` first, while stand-ins hold the MoE
blocks' places (`shard_all_but`).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients
from mlx.utils import tree_flatten, tree_unflatten

from . import _tracing

# An expert-parallel layer routes about 1/N of its entries to its own
# experts, but a plan's static capacity is all T * K. From this many entries
# it reads the plan's num_rows (one host sync) and runs its GEMMs over the
# used rows only; below (decoding), over the whole capacity, without a sync.
SYNC_FROM_ENTRIES = 1024

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


def shard_layers(model: nn.Module, layers: list[tuple[str, nn.Module]],
                 group: mx.distributed.Group, *, tensor_parallel: bool) -> None:
    """Split the experts of `layers` (paths in `model` and `nn.SwitchGLU`s)
    among `group`'s ranks, in place; with `tensor_parallel`, cut the rest of
    `model` by mlx-lm's `model.shard(group)` first. Everything is checked
    before anything is cut."""
    ranges = [expert_range(layer.num_experts, group) for _, layer in layers]
    if tensor_parallel and layers:
        if any("." not in path for path, _ in layers):
            raise ValueError("expert parallelism with tensor-parallel attention: the MoE "
                             "layers must sit in blocks of a model, not at its top")
        # A layer's parent is its MoE block (`mlp`), which stays whole.
        shard_all_but(model, sorted({path.rpartition(".")[0] for path, _ in layers}), group)
    for (_, layer), (start, stop) in zip(layers, ranges):
        keep_experts(layer, start, stop)
        layer.expert_offset = start
        layer.expert_group = group


class ShardedExperts:
    """The runtime of a layer whose experts may be split among ranks (a mixin
    of `nn.SwitchGLU`): its ids shifted to its own experts, its GEMMs' rows,
    its outputs and input gradients summed over the group."""

    # Set by shard_layers: the layer holds the model's experts
    # [expert_offset, expert_offset + num_experts), its routed ids are
    # shifted by -expert_offset (others skipped), and its outputs are summed
    # over expert_group. None: the layer holds every expert.
    expert_group: mx.distributed.Group | None = None
    expert_offset = 0
    # From this many routed entries a call syncs to run its GEMMs over its
    # own rows (SYNC_FROM_ENTRIES); per layer, so that a benchmark can weigh
    # the sync against the whole capacity.
    sync_from_entries = SYNC_FROM_ENTRIES
    # Instead of that sync, where the grouped kernel computes the layer: the
    # share of the plan's capacity its GEMMs cover statically, the rows past
    # it left to the grouped kernel, which reads their count on the device
    # (e.g. 1.25 / N: none unless the rank's experts draw over 1.25 times
    # their share). None: the sync. See docs/DESIGN.md, "Expert parallelism".
    static_share: float | None = None

    def _local_ids(self, indices: mx.array) -> mx.array:
        """The model's expert ids `indices` as this rank's, -1 (skipped) for
        other ranks' experts; as they are where the layer holds every expert."""
        if self.expert_group is None:
            return indices
        local = indices.astype(mx.int32) - self.expert_offset  # routers give uint32
        return mx.where((local >= 0) & (local < self.num_experts), local, -1)

    def _sharded_input(self, x: mx.array) -> mx.array:
        """`x`, whose gradient an expert-parallel layer sums over its group.

        Each rank's output depends on `x` through its own experts only; the
        ranks' input gradients add up to the whole layer's, as mlx-lm's
        tensor-parallel layers sum theirs (`sum_gradients`)."""
        return x if self.expert_group is None else sum_gradients(self.expert_group)(x)

    def _summed(self, y: mx.array) -> mx.array:
        """`y` summed over the expert group: the ranks' experts' outputs together."""
        return y if self.expert_group is None else \
            mx.distributed.all_sum(y, group=self.expert_group)

    def _sheds_rows(self, plan) -> bool:
        """Whether this call runs its GEMMs over fewer rows than the plan's
        capacity: an expert-parallel layer from `sync_from_entries` entries."""
        return (self.expert_group is not None
                and math.prod(plan.indices_shape) >= self.sync_from_entries)

    def _static_rows(self, plan, dtype: mx.Dtype) -> int | None:
        """The rows an expert-parallel layer's GEMMs cover without a sync,
        the grouped kernel taking the rest (`static_share` of the capacity,
        in whole tiles), from `sync_from_entries` entries where the kernel
        computes the layer; None: elsewhere."""
        share = self.static_share
        if share is not None and not 0 <= share <= 1:
            raise ValueError(f"static_share: expected a share of the capacity in [0, 1] or "
                             f"None, got {share}")
        if share is None or not self._sheds_rows(plan) or not self._can_group(dtype):
            return None
        tiles = math.ceil(share * plan.max_tiles)
        return min(max(tiles, 1), plan.max_tiles) * plan.tile_m

    def _used_rows(self, plan) -> int:
        """The rows an expert-parallel layer runs its GEMMs over: all of the
        capacity, or from `sync_from_entries` entries (and not while traced:
        no sync there) the used rows rounded up to a multiple of an eighth of
        the next power of two, which reads the plan's `num_rows` (a host
        sync)."""
        if not self._sheds_rows(plan) or _tracing.compiled_trace():
            return plan.capacity
        used = max(int(plan.num_rows.item()), 1)
        # Up to the next multiple of an eighth of the next power of two: at
        # most 4 shapes an octave, and under 25% of rows wasted.
        step = max((1 << (used - 1).bit_length()) // 8, plan.tile_m)
        step = -(-step // plan.tile_m) * plan.tile_m
        return min(-(-used // step) * step, plan.capacity)
