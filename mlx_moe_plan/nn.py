"""A drop-in `SwitchGLU` for mlx-lm MoE models, built on plan, gather and unsort.

`SwitchGLU` takes the constructor arguments, parameter names and call of
`mlx_lm.models.switch_layers.SwitchGLU`, and reuses mlx-lm's own
`SwitchLinear` projections, so checkpoints load unchanged and `nn.quantize`
turns them into `QuantizedSwitchLinear` exactly as it does mlx-lm's. Needs
mlx-lm installed.

Two ways to install it:

- `patch_model(model)` swaps it into a loaded model in place (and fuses the
  MoE blocks' weighted sums, below, and gives the dense projections a
  decoding batch as one matrix where measured faster, `projections.py`). A
  model patched already is left as it is, with a warning.
- `mlx_lm.models.switch_layers.SwitchGLU = mlx_moe_plan.nn.SwitchGLU` before
  mlx-lm imports a model's module (`mlx_lm.load` imports it on first use;
  a module imported already holds its own `SwitchGLU` name, to replace the
  same way): every model built then has this layer, made by mlx-lm's code.
  The layer reaches mlx-lm's classes as they were when this module was
  imported (`_mlx_lm.py`), not through the module attribute it replaced.
  `patch_model` on such a model fuses its blocks.

Expert GEMMs use MLX's `gather_mm` / `gather_qmm` in one of the formulations
of `rules.Formulation`: sorted single rows (`tile_m=1`), tiles of `tile_m`
rows of one expert each, mlx-lm's own call (`tile_m=MLX_LM`, no plan), or, for
affine-quantized layers of 16-bit rows on a GPU, sorted rows through the
backend's grouped kernel (`tile_m=GROUPED`). The default, `default_tile_m`,
is the measured rule (`rules.formulation_for`); `tile_m` overrides it per
layer. Small batches run compiled (`COMPILE_MAX_TOKENS`): decoding is bound
by the host's graph building.

MoE blocks that weight and sum the experts' outputs themselves
(`(switch_mlp(x, inds) * scores[..., None]).sum(-2)`) can take the fused path,
`SwitchGLU.weighted_sum`: one `moe_combine` in place of unsort, multiply and
sum. `patch_model` gives it to the mlx-lm blocks of `fused_blocks.py` whose
code is the code their fused forward was written against.

`shard_experts` splits each layer's experts among the ranks of an
`mx.distributed` group (expert parallelism).

The layer's parts, each in the module that changes with it: the formulation
and its rule in `rules.py`; mlx-lm's classes and the mirror of its call in
`_mlx_lm.py`; the grouped path in `_grouped.py` (`GroupedExperts`:
`_grouped_mlp`, `_grouped_projection`, `_gates_in_kernel`, `_fuses_gate_up`,
over `_PlanRows`); expert parallelism's runtime in `expert_parallel.py`
(`ShardedExperts`); the compile gate in `_compiled.py`. Here: the layer's
dispatch among them, and the installing (`patch_model`, `shard_experts`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from . import (_backend, _mlx_lm, expert_parallel, fused_attention, fused_blocks, fused_model,
               projections, rules)
from ._compiled import COMPILE_MAX_TOKENS, compiled_if_small
from ._grouped import GroupedExperts
from .combine import moe_combine
from .expert_parallel import ShardedExperts
from .expert_parallel import SYNC_FROM_ENTRIES as EXPERT_PARALLEL_SYNC_FROM_ENTRIES
from .gather import moe_gather, moe_unsort
from .plan import moe_plan
from .rules import (GROUPED, GROUPED_BELOW_ROWS_PER_EXPERT, GROUPED_FROM_ENTRIES, GROUPED_ROWS,
                    GROUPED_TILES_FROM_ROWS_PER_EXPERT, LARGE_TILES_FROM_ROWS_PER_EXPERT,
                    MLX_LM, MLX_LM_CALL, MLX_LM_SORTS_FROM_ENTRIES, SORTED_ROWS,
                    TILED_FROM_ROWS_PER_EXPERT, Formulation)

__all__ = [
    "COMPILE_MAX_TOKENS", "EXPERT_PARALLEL_SYNC_FROM_ENTRIES", "FUSED_BLOCKS", "GROUPED",
    "GROUPED_BELOW_ROWS_PER_EXPERT", "GROUPED_FROM_ENTRIES", "GROUPED_TILES_FROM_ROWS_PER_EXPERT",
    "LARGE_TILES_FROM_ROWS_PER_EXPERT",
    "MLX_LM", "MLX_LM_SORTS_FROM_ENTRIES", "TILED_FROM_ROWS_PER_EXPERT", "Formulation",
    "FusedMoEBlock", "SwitchGLU", "default_tile_m", "patch_model", "shard_experts",
]

# The registry of fused blocks and their marker class, public here too.
FUSED_BLOCKS = fused_blocks.FUSED_BLOCKS
FusedMoEBlock = fused_blocks.FusedMoEBlock


def default_tile_m(num_entries: int, num_experts: int, stream=None, *,
                   grouped: bool = False, out_dims: Sequence[int] = ()) -> int:
    """The GEMM formulation the layer uses unless told: the measured rule
    (`rules.formulation_for`), as the layer's public `tile_m`.

    Args:
        num_entries (int): Routed entries, `T * K` (`indices.size`).
        num_experts (int): Number of experts E.
        stream (Stream or Device, optional): Where the layer runs. Default:
          the default device's stream.
        grouped (bool): Whether the layer's projections and rows are ones
          the backend's grouped kernel computes (`SwitchGLU` knows). Default: no.
        out_dims (Sequence[int]): Output columns of the layer's projections
          (`rules.formulation_for`). Default: none.

    Returns:
        int: `MLX_LM` (0), `GROUPED` (-1), 1, 16 or 64.
    """
    cuda = _backend.on_cuda(stream)
    return rules.formulation_for(num_entries, num_experts, cuda=cuda, grouped=grouped,
                                 out_dims=out_dims).tile_m


def _row_strided(rows: mx.array) -> mx.array:
    """`rows` `[n, 1, H]` as a reshape of `[n, H]`: strides `(H, H, 1)`."""
    return rows.reshape(-1, rows.shape[-1]).reshape(rows.shape)


class SwitchGLU(GroupedExperts, ShardedExperts, nn.Module):
    """mlx-lm's `SwitchGLU` with the token dispatch of `mlx_moe_plan`.

    Args:
        input_dims (int): Model dimension D.
        hidden_dims (int): Expert hidden dimension I.
        num_experts (int): Number of experts E.
        activation (Module): `activation(x_up, x_gate)`. Default: SwiGLU.
        bias (bool): Projection biases. Default: ``False``.
        tile_m (int, optional): GEMM formulation: `MLX_LM` (0) for mlx-lm's
          own call (no plan; meant for small batches: large ones are not
          sliced as our sorted rows are), `GROUPED` (-1) for sorted rows
          through this package's grouped kernel (a few rows an expert, or
          many in its block tiles), 1 for sorted single rows, more for tiles
          of that many rows. Default: `default_tile_m` per call.

    Expert ids must lie in `[0, num_experts)`, as a router gives them. The
    planned formulations skip others (their outputs are zero); mlx-lm's
    hands them to MLX's `gather_qmm`, which does not check them.
    """

    # Rows a single sorted-rows GEMM call takes at most; larger batches run in
    # slices of sorted rows (still sorted): MLX's CUDA backend has failed to
    # launch one sorted gather_qmm over about 80,000 rows.
    max_rows_per_gemm = 32768
    # Calls of up to this many tokens run compiled (COMPILE_MAX_TOKENS); 0: never.
    compile_max_tokens = COMPILE_MAX_TOKENS
    # Expert parallelism's attributes (expert_group, expert_offset,
    # sync_from_entries, static_share): expert_parallel.ShardedExperts.

    def __init__(
        self,
        input_dims: int,
        hidden_dims: int,
        num_experts: int,
        activation: nn.Module | None = None,
        bias: bool = False,
        *,
        tile_m: int | None = None,
    ):
        super().__init__()
        self.tile_m = tile_m
        linear = _mlx_lm.SwitchLinear
        self.gate_proj = linear(input_dims, hidden_dims, num_experts, bias=bias)
        self.up_proj = linear(input_dims, hidden_dims, num_experts, bias=bias)
        self.down_proj = linear(hidden_dims, input_dims, num_experts, bias=bias)
        self.activation = _mlx_lm.SwiGLU() if activation is None else activation

    @classmethod
    def from_mlx_lm(cls, layer: nn.Module, *, tile_m: int | None = None) -> "SwitchGLU":
        """A `SwitchGLU` sharing `layer`'s projections and activation (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.tile_m = tile_m
        new.gate_proj = layer.gate_proj
        new.up_proj = layer.up_proj
        new.down_proj = layer.down_proj
        new.activation = layer.activation
        return new

    @property
    def tile_m(self) -> int | None:
        """The GEMM formulation (see the class), None for the rule's per call."""
        return None if self.formulation is None else self.formulation.tile_m

    @tile_m.setter
    def tile_m(self, tile_m: int | None) -> None:
        # Converted here, once, not at every call.
        self.formulation = Formulation.from_tile_m(tile_m)

    @property
    def num_experts(self) -> int:
        return self.gate_proj.num_experts

    def _out_dims(self) -> tuple[int, int]:
        """Output columns of the gate and up projections, and of the down one
        (their matrices `[E, N, ...]`, as mlx-lm's SwitchLinear keeps them)."""
        return self.gate_proj.weight.shape[1], self.down_proj.weight.shape[1]

    def _formulation(self, x: mx.array, indices: mx.array) -> Formulation:
        """The formulation of a call on `x` routed by `indices`."""
        formulation = self.formulation
        if formulation is None:
            # The columns matter only where the grouped kernel can run, and
            # only its projections are known to hold their weights (not a
            # LoRA adapter's wrapper).
            grouped = self._can_group(x.dtype)
            formulation = rules.formulation_for(indices.size, self.num_experts,
                                                cuda=_backend.on_cuda(), grouped=grouped,
                                                out_dims=self._out_dims() if grouped else ())
        elif formulation is GROUPED_ROWS and not self._can_group(x.dtype):
            formulation = SORTED_ROWS
        # mlx-lm's call would hand the skipped ids (-1) to gather_qmm unchecked.
        if formulation is MLX_LM_CALL and self.expert_group is not None:
            return SORTED_ROWS
        return formulation

    def _plan(self, indices: mx.array, formulation: Formulation):
        indices = self._local_ids(mx.stop_gradient(indices))
        return moe_plan(indices, self.num_experts, tile_m=formulation.plan_tile_m)

    def _mlp(self, rows: mx.array, experts: mx.array) -> mx.array:
        """The expert MLP of `rows` `[n, m, D]`, expert `experts[i]` for `rows[i]`."""
        x_up = self.up_proj(rows, experts, sorted_indices=True)
        x_gate = self.gate_proj(rows, experts, sorted_indices=True)
        if rows.shape[-2] == 1 and "bias" in self.up_proj:
            # mlx-lm's SwitchLinear adds its bias through expand_dims, and an
            # elementwise op may hand that input's strides on to its output:
            # the stride-1 axis of _expert_rows' note, which would reach the
            # down projection's input and, through the activation's gradient,
            # the cotangents of these two. A reshape round trip gives them
            # their true row stride, and so everything computed from them.
            x_up = _row_strided(x_up)
            x_gate = _row_strided(x_gate)
        return self.down_proj(self.activation(x_up, x_gate), experts, sorted_indices=True)

    def _expert_rows(self, x: mx.array, plan, formulation: Formulation) -> mx.array:
        """The expert MLP of every row of the plan, `[capacity, D]`."""
        x = self._sharded_input(x)
        if formulation is GROUPED_ROWS:
            return self._grouped_mlp(x, plan)
        rows = moe_gather(x, plan)
        static = self._static_rows(plan, x.dtype)
        if static is not None:
            out = self._expert_rows_used(rows[:static], plan, static)
            if static == plan.capacity:
                return out
            rest = self._grouped_mlp(x, plan, static, rows[static:])
            return mx.concatenate([out, rest])
        used = self._used_rows(plan)
        if used < plan.capacity:
            # Rows past num_rows are padding nobody reads: zeros stand for
            # their outputs, at the capacity the unsort and combine expect.
            out = self._expert_rows_used(rows[:used], plan, used)
            unused = mx.zeros((plan.capacity - used, out.shape[-1]), dtype=out.dtype)
            return mx.concatenate([out, unused])
        return self._expert_rows_used(rows, plan, plan.capacity)

    def _expert_rows_used(self, rows: mx.array, plan, used: int) -> mx.array:
        """The expert MLP of the plan's first `used` rows, `rows` `[used, D]`."""
        hidden = rows.shape[-1]  # spelled out: -1 cannot be inferred for 0 rows
        if plan.tile_m > 1:
            # Tiles past num_tiles hold zero rows and expert -1: give them the
            # last expert, so the experts stay sorted as sorted_indices
            # promises (a wrong promise gives wrong weight gradients); nothing
            # reads their outputs.
            last = self.num_experts - 1
            tiles = used // plan.tile_m
            experts = mx.where(plan.tile_experts < 0, last, plan.tile_experts)
            if tiles < plan.max_tiles:  # no slice node on the unsharded path
                experts = experts[:tiles]
            out = self._mlp(rows.reshape(tiles, plan.tile_m, hidden), experts)
            return out.reshape(used, out.shape[-1])
        # [capacity, 1, D] by reshape, not expand_dims, and back by reshape,
        # not squeeze (whose gradient is an expand_dims). MLX gives the size-1
        # axis expand_dims inserts a stride of 1, and MLX 0.32.4's CUDA sorted
        # gather_mm of one-row batches (a grouped GEMM over each expert's
        # rows) takes that stride for the distance between rows: it read
        # expand_dims' rows wrongly, reshaped ones right.
        rows = rows.reshape(used, 1, hidden)
        experts = plan.row_experts  # sorted by construction
        if used < plan.capacity:  # no slice node on the unsharded path
            experts = experts[:used]
        step = self.max_rows_per_gemm
        if used <= step:
            out = self._mlp(rows, experts)
        else:
            out = mx.concatenate([self._mlp(rows[i : i + step], experts[i : i + step])
                                  for i in range(0, used, step)])
        return out.reshape(used, out.shape[-1])

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """Args: x `[..., D]`, indices `[..., K]`. Returns `[..., K, D]`, as mlx-lm's."""
        return compiled_if_small(self, self._forward, x, indices,
                                 max_tokens=self.compile_max_tokens, key=("call", self.tile_m))

    def _forward(self, x: mx.array, indices: mx.array) -> mx.array:
        formulation = self._formulation(x, indices)
        if formulation is MLX_LM_CALL:
            return _mlx_lm.mlx_lm_call(self, x, indices)
        plan = self._plan(indices, formulation)
        rows = self._expert_rows(x, plan, formulation)
        return self._summed(moe_unsort(rows, plan))

    def weighted_sum(self, x: mx.array, indices: mx.array, scores: mx.array, *,
                     in_rows_dtype: bool = False) -> mx.array:
        """`(self(x, indices) * scores[..., None]).sum(-2)` with one `moe_combine`.

        The fused path for MoE blocks that weight and sum the experts' outputs
        themselves: no `[..., K, D]` intermediate. The sum runs in float32 over
        ascending k, rounded once to the result's dtype, so its last bits may
        differ from the unfused product-sum in the activations' dtype. The
        `MLX_LM` formulation has no plan to combine with: it computes the
        unfused expression itself, bit for bit mlx-lm's.

        Args:
            x (array): `[..., D]`.
            indices (array): `[..., K]`.
            scores (array): Float weights, `[..., K]`.
            in_rows_dtype (bool): The result in the experts' output dtype, as
              blocks that end in `.astype(y.dtype)` give it. Default: that
              dtype promoted with `scores.dtype`, as the unfused expression.

        Returns:
            array: `[..., D]`.
        """
        def forward(x, indices, scores):
            return self._weighted_sum(x, indices, scores, in_rows_dtype)

        return compiled_if_small(self, forward, x, indices, scores,
                                 max_tokens=self.compile_max_tokens,
                                 key=("weighted_sum", self.tile_m, in_rows_dtype))

    def _weighted_sum(self, x: mx.array, indices: mx.array, scores: mx.array,
                      in_rows_dtype: bool) -> mx.array:
        formulation = self._formulation(x, indices)
        if formulation is MLX_LM_CALL:
            y = _mlx_lm.mlx_lm_call(self, x, indices)
            weighted = (y * scores[..., None]).sum(-2)
            return weighted.astype(y.dtype) if in_rows_dtype else weighted
        plan = self._plan(indices, formulation)
        rows = self._expert_rows(x, plan, formulation)
        dtype = rows.dtype if in_rows_dtype else mx.result_type(rows.dtype, scores.dtype)
        return self._summed(moe_combine(rows, plan, weights=scores, dtype=dtype))


def _layer_order(path: str) -> tuple:
    """A module path's sort key in layer order: "layers.2" before "layers.10"
    (`named_modules` walks a model in no promised order)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part)
                 for part in path.split("."))


def patch_model(model: nn.Module, *, tile_m: int | None = None, fuse: bool = True,
                dense_rows: bool = True, dense: bool = True, submit: bool = True) -> int:
    """Replace every mlx-lm `SwitchGLU` in `model`, in place, keeping its weights.

    Float and quantized layers alike: the projections are kept as they are.
    With `fuse`, the MoE blocks of `FUSED_BLOCKS` whose `__call__` is the one
    their fused forward was written against then sum their experts' weighted
    outputs with one `moe_combine` (`SwitchGLU.weighted_sum`); they become
    instances of a subclass of their own class and of `FusedMoEBlock`. The
    attention classes of `fused_attention.FUSED_ATTENTION` of a model with
    MoE layers likewise become `FusedAttention`s, which normalize and rotate
    a decoding step's queries and keys in one launch where
    `rules.fuses_head_norm_rope` says so (Qwen3-MoE's) and attend in the
    backend's `decode_attention` where `rules.decodes_attention` says so
    (with no mask or a boolean one, the cache not quantized), and the models of
    `fused_model.FUSED_MODELS` `FusedModel`s, which make a decoding step's
    residual adds and the RMS norms after them one launch each where
    `rules.fuses_add_rms_norm` says so. With
    `dense_rows`, the dense quantized projections of a model with MoE layers
    (attention, shared experts, routers, the lm_head) take a decoding batch's
    rows as one matrix where `rules.dense_as_rows` measured that faster
    (`projections.py`); they become instances of a subclass of their own
    class and of `projections.RowsProjection`, and on CUDA those a module
    calls on one input (attention's queries, keys and values) compute a
    decoding step as one GEMM of their stacked matrices where
    `rules.dense_joins_siblings` says so, their arrays becoming views of the
    stacked ones (`projections.Siblings`). With `dense`, the same
    projections compute a decoding batch's rows and a prefill's through the
    grouped kernel as one expert where its GEMM was measured faster
    (`rules.dense_decoding_expert`, `rules.dense_as_expert`; on CUDA). With
    `submit`, the blocks it fuses are numbered in layer order
    (`FusedMoEBlock.submit_position`), and those `rules.submits_block` names
    for a decoding step or a prompt's chunk (on CUDA) hand their output to
    MLX's evaluation as soon as it is built (`_compiled.submit_as_built`):
    the GPU computes the layers built so far while the host builds the rest.

    A model patched already (its layers this package's, its blocks fused and
    projections given rows as asked) is left as it is: the call returns 0 and
    warns (`UserWarning`), as patching twice is most likely a mistake. A
    `tile_m` is never applied to layers that were this package's before the
    call, and the call warns so (set the layers' `tile_m` instead). A model
    built with `switch_layers.SwitchGLU` replaced by this layer has no mlx-lm
    layer to replace (0) but gets its blocks fused and its projections their
    rows, without a warning where there is any of that to do.

    Args:
        model (Module): A loaded mlx-lm model (or any module tree).
        tile_m (int, optional): The GEMM formulation of every new layer (see
          `SwitchGLU`). Default: `default_tile_m`, per call.
        fuse (bool): Fuse the weighted sums, the attentions' norms and
          rotations and their decoding steps' attention, and the residual
          adds with the norms after them, where that is known to be safe.
          Default: ``True``.
        dense_rows (bool): Give the dense quantized projections a decoding
          batch's rows as one matrix, and those on one input one GEMM, where
          measured faster. Default: ``True``.
        dense (bool): Compute the dense quantized projections' rows by the
          grouped kernel where its GEMM was measured faster. Default:
          ``True``.
        submit (bool): The fused blocks the rules name submit a decoding
          step's or a prompt chunk's output for evaluation as soon as it is
          built. Default: ``True``.

    Returns:
        int: How many layers were replaced.
    """
    formulation = Formulation.from_tile_m(tile_m)  # checked before anything changes
    ours_before = sum(isinstance(m, SwitchGLU) for _, m in model.named_modules())
    replacements = [(path, SwitchGLU.from_mlx_lm(module, tile_m=tile_m))
                    for path, module in model.named_modules()
                    if path and isinstance(module, _mlx_lm.SwitchGLU)]
    if replacements:  # MLX's own walk of lists and dicts of modules, and swap
        model.update_modules(tree_unflatten(replacements))
    fused = []
    if fuse:
        for path, module in model.named_modules():
            entry = fused_blocks.entry_for(module)
            if entry is not None and isinstance(module.get(entry.experts), SwitchGLU):
                fused_blocks.fuse(module, entry)
                fused.append((path, module))
    if submit:
        in_layer_order = sorted(fused, key=lambda item: _layer_order(item[0]))
        for position, (_, block) in enumerate(in_layer_order):
            block.submit_position = position
    has_layers = any(isinstance(m, SwitchGLU) for _, m in model.named_modules())
    # Attentions and models whose forward a fused module mirrors, in one walk.
    swaps = [(module, fused) for _, module in model.named_modules()
             if fuse and has_layers for fused in (fused_attention, fused_model)
             if fused.fusable(module)]
    for module, fused in swaps:
        fused.fuse(module)
    rows = (projections.take_rows(model, decoding=dense_rows, expert=dense)
            if (dense_rows or dense) and has_layers else 0)
    name = type(model).__name__
    if ours_before and formulation is not None:
        warnings.warn(f"patch_model: {name} is patched already ({ours_before} MoE layers "
                      f"this package's): tile_m={tile_m} not applied to them; set their "
                      "tile_m instead", stacklevel=2)
    elif not replacements and not fused and not swaps and not rows and has_layers:
        warnings.warn(f"patch_model: {name} is patched already (its MoE layers this "
                      "package's); nothing changed", stacklevel=2)
    return len(replacements)


def shard_experts(model: nn.Module, group: mx.distributed.Group | None = None, *,
                  tensor_parallel: bool = False) -> int:
    """Split the experts of every MoE layer of `model` among `group`'s ranks, in place.

    Patches the model first if it has mlx-lm `SwitchGLU` layers left
    (`patch_model`). Rank r keeps the contiguous experts
    `[r * E / N, (r + 1) * E / N)` of each layer (1/N of their bytes; the
    other arrays are dropped before they are evaluated where they are still
    lazy), computes the routed entries of those experts only, and the layer's
    output is summed over the group with one `all_sum` (the weighted sum of
    a fused block, or the `[..., K, D]` outputs of an unfused one). Input
    gradients are summed over the group too, so training works. Routers stay
    replicated; attention and dense layers too, unless `tensor_parallel`:
    every rank must run the same model on the same inputs.

    A group of one rank is a no-op (returns 0). A model without MoE layers
    returns 0. A model already tensor-parallel (mlx-lm's `model.shard()`,
    which cuts every expert in width) raises a ValueError: ask for
    `tensor_parallel` here instead.

    Args:
        model (Module): A loaded mlx-lm model (or any module tree).
        group (Group, optional): The ranks. Default: `mx.distributed.init()`.
        tensor_parallel (bool): Also cut attention and dense layers with
          mlx-lm's own `model.shard(group)` (the model must have one), all
          but the MoE blocks, which stay whole for expert parallelism
          (DeepSeek-V3's shared experts included: replicated). A rank then
          computes 1/N of the attention heads too. Default: ``False``.

    Returns:
        int: How many layers were sharded.
    """
    group = group or mx.distributed.init()
    if group.size() == 1:
        return 0
    expert_parallel.check_not_tensor_parallel(model)
    if tensor_parallel and not callable(getattr(model, "shard", None)):
        raise ValueError("expert parallelism with tensor-parallel attention: "
                         f"mlx-lm's {type(model).__name__} has no shard()")
    if any(isinstance(m, _mlx_lm.SwitchGLU) for _, m in model.named_modules()):
        patch_model(model)
    layers = [(path, m) for path, m in model.named_modules()
              if isinstance(m, SwitchGLU) and m.expert_group is None]
    expert_parallel.shard_layers(model, layers, group, tensor_parallel=tensor_parallel)
    return len(layers)
