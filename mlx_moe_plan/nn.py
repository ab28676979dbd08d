"""A drop-in `SwitchGLU` for mlx-lm MoE models, built on plan, gather and unsort.

`SwitchGLU` takes the constructor arguments, parameter names and call of
`mlx_lm.models.switch_layers.SwitchGLU`, and reuses mlx-lm's own
`SwitchLinear` projections, so checkpoints load unchanged and `nn.quantize`
turns them into `QuantizedSwitchLinear` exactly as it does mlx-lm's.
`patch_model` swaps it into a loaded model in place.

Expert GEMMs use MLX's `gather_mm` / `gather_qmm` in one of three
formulations: sorted single rows (`tile_m=1`: one expert index a row), tiles
(`tile_m` rows a tile, one expert a tile by the plan's construction, rows seen
as `[max_tiles, tile_m, D]` with `rhs_indices=tile_experts`), or no plan at all
(`tile_m=MLX_LM`: mlx-lm's own call); or, for affine-quantized layers of
16-bit rows on a GPU (`tile_m=GROUPED`, which decoding batches run on CUDA),
this package's grouped kernel over sorted rows. The default,
`default_tile_m`, is the rule measured per backend (benchmarks/RESULTS.md);
`tile_m` overrides it per layer. Small batches run compiled
(`COMPILE_MAX_TOKENS`): decoding is bound by the host's graph building. Needs
mlx-lm installed.

MoE blocks that weight and sum the experts' outputs themselves
(`(switch_mlp(x, inds) * scores[..., None]).sum(-2)`) can take the fused path,
`SwitchGLU.weighted_sum`: one `moe_combine` in place of unsort, multiply and
sum. `patch_model` gives it to the mlx-lm blocks of `fused_blocks.py` whose
code is the code their fused forward was written against.

`shard_experts` splits each layer's experts among the ranks of an
`mx.distributed` group (expert parallelism, `expert_parallel.py`).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import sum_gradients
from mlx.utils import tree_unflatten

try:
    from mlx_lm.models import switch_layers as _mlx_lm_switch
except ImportError as error:  # the layer is an mlx-lm drop-in; the ops are not
    raise ImportError(
        "mlx_moe_plan.nn replaces mlx-lm's SwitchGLU and needs mlx-lm: "
        "pip install mlx-lm (or this package's [bench] extra)"
    ) from error

from . import _backend, _compiled, expert_parallel, fused_blocks, rules
from ._checks import check_tokens
from ._compiled import COMPILE_MAX_TOKENS, compiled_if_small
from .combine import moe_combine
from .gather import moe_gather, moe_unsort
from .plan import moe_plan
from .rules import (GROUPED, GROUPED_BELOW_ROWS_PER_EXPERT, GROUPED_FROM_ENTRIES, GROUPED_ROWS,
                    LARGE_TILES_FROM_ROWS_PER_EXPERT, MLX_LM, MLX_LM_CALL,
                    MLX_LM_SORTS_FROM_ENTRIES, SORTED_ROWS, TILED_FROM_ROWS_PER_EXPERT,
                    Formulation)

# The registry of fused blocks and their marker class, public here too.
FUSED_BLOCKS = fused_blocks.FUSED_BLOCKS
FusedMoEBlock = fused_blocks.FusedMoEBlock


# mlx-lm's own call with its GEMMs' lhs indices given (below) is its code op
# for op, without the index kernels MLX adds to it: compiled, it costs less
# GPU and host time than mlx-lm's, and gives mlx-lm's bits.
# mlx-lm's call hands MLX's gather_qmm (and gather_mm) no lhs_indices, and MLX
# makes them at every call: an arange over the rows, which the up and gate
# projections broadcast against the expert ids, and which MLX's CUDA backend
# then copies to a contiguous array before the GEMM (GatherQMM::eval_gpu,
# MLX 0.32.4); sliced ids (argpartition's, from 2 tokens) are copied by each
# of the three GEMMs too. Five to eight kernels a layer around three GEMMs:
# on the H200 a small kernel costs about 4.4 us of a step, and one of these
# GEMMs at T = 1 about 14 us (benchmarks.dispatch, benchmarks.grouped_qmm).
# Below mlx-lm's sort threshold the MLX_LM formulation runs mlx-lm's call with
# those indices given, constants made once a shape, and the ids made
# contiguous once: the same GEMMs on the same rows, the same bits. It mirrors
# this code of mlx-lm's (0.32.2; SHA-256 prefixes of each __call__'s source)
# and runs mlx-lm's own call where that code differs.
_MLX_LM_CALL_DIGESTS = {"SwitchGLU": "a2f36b7d7e9640a8", "SwitchLinear": "1c91ef16afb139a8",
                        "QuantizedSwitchLinear": "797f197172695142"}


@functools.cache
def _mlx_lm_call_is_mirrored() -> bool:
    """Whether mlx-lm's SwitchGLU and projection calls are the code mirrored."""
    return all(fused_blocks.source_digest(getattr(_mlx_lm_switch, name).__call__) == digest
               for name, digest in _MLX_LM_CALL_DIGESTS.items())


@functools.lru_cache(maxsize=64)
def _gemm_rows(lead: tuple[int, ...], k: int, per_entry: bool) -> mx.array:
    """The lhs indices MLX makes for mlx-lm's unsorted call, as a constant
    uint32 `[*lead, k]`: each entry's token (the up and gate projections'
    rows `[*lead, 1, 1, D]`), or each entry itself (`per_entry`: the down
    projection's `[*lead, k, 1, I]`). Made from host memory, so a trace
    holds them as constants, not as kernels to run."""
    tokens = math.prod(lead)
    rows = np.arange(tokens * k, dtype=np.uint32) if per_entry \
        else np.repeat(np.arange(tokens, dtype=np.uint32), k)
    return mx.array(rows.reshape(*lead, k))


def _switch_projection(projection: nn.Module, x: mx.array, indices: mx.array,
                       rows: mx.array) -> mx.array:
    """`projection(x, indices)`, mlx-lm's SwitchLinear or QuantizedSwitchLinear
    call, unsorted, with the GEMM's lhs indices `rows` given."""
    if isinstance(projection, _mlx_lm_switch.QuantizedSwitchLinear):
        x = mx.gather_qmm(x, projection["weight"], projection["scales"],
                          projection.get("biases"), lhs_indices=rows, rhs_indices=indices,
                          transpose=True, group_size=projection.group_size,
                          bits=projection.bits, mode=projection.mode,
                          global_scale=projection.global_scale, sorted_indices=False)
    else:
        x = mx.gather_mm(x, projection["weight"].swapaxes(-1, -2), lhs_indices=rows,
                         rhs_indices=indices, sorted_indices=False)
    if "bias" in projection:
        x = x + mx.expand_dims(projection["bias"][indices], -2)
    return x


# An expert-parallel layer (shard_experts) routes about 1/N of
# its entries to its own experts, but a plan's static capacity is all T * K.
# From this many entries it reads the plan's num_rows (one host sync) and runs
# its GEMMs over the used rows only, rounded up so that few shapes appear (at
# most 4 an octave); below, over the whole capacity, without a sync (decoding).
EXPERT_PARALLEL_SYNC_FROM_ENTRIES = 1024


def _on_cuda(stream: mx.Stream) -> bool:
    """Whether `stream` runs on MLX's CUDA backend (a fact of the measured rule)."""
    return stream.device.type == mx.gpu and _backend.gpu_backend() == "cuda"


def default_tile_m(num_entries: int, num_experts: int, stream=None, *,
                   grouped: bool = False) -> int:
    """The GEMM formulation the layer uses unless told: the measured rule
    (`rules.formulation_for`), as the layer's public `tile_m`.

    Args:
        num_entries (int): Routed entries, `T * K` (`indices.size`).
        num_experts (int): Number of experts E.
        stream (Stream or Device, optional): Where the layer runs. Default:
          the default device's stream.
        grouped (bool): Whether the layer's projections and rows are ones
          kernels/grouped_qmm.h computes (`SwitchGLU` knows). Default: no.

    Returns:
        int: `MLX_LM` (0), `GROUPED` (-1), 1, 16 or 64.
    """
    cuda = _on_cuda(_backend.resolve_stream(stream))
    return rules.formulation_for(num_entries, num_experts, cuda=cuda, grouped=grouped).tile_m


def _kernel_computes(projection: nn.Module, backend: _backend.Backend, dtype: mx.Dtype) -> bool:
    """Whether `backend`'s grouped kernel computes `projection` on rows of `dtype`."""
    return (isinstance(projection, _mlx_lm_switch.QuantizedSwitchLinear)
            and getattr(projection, "mode", "affine") == "affine"
            and getattr(projection, "global_scale", None) is None
            and projection.get("biases") is not None
            and projection.scales.dtype == dtype
            and backend.grouped_qmm_computes(bits=projection.bits,
                                             group_size=projection.group_size, dtype=dtype))


class _PlanRows:
    """A plan's rows from `first_row` on, as the grouped kernel takes them:
    each expert's span cut to those rows, and their experts and tokens (each
    made when first read). The cut is lazy (the spans are read on the
    device), so a layer can hand the rows past a static count to the kernel
    without learning how many there are: none, or a few, it computes what is
    there."""

    def __init__(self, plan, first_row: int = 0):
        self.plan = plan
        self.first_row = first_row

    @property
    def count(self) -> int:
        """The rows, `capacity - first_row` (used and tail)."""
        return self.plan.capacity - self.first_row

    @functools.cached_property
    def expert_offsets(self) -> mx.array:
        if self.first_row == 0:
            return self.plan.expert_offsets
        # Spans before first_row become empty, the one across it starts there.
        return mx.maximum(self.plan.expert_offsets - self.first_row, 0)

    @functools.cached_property
    def row_experts(self) -> mx.array:
        experts = self.plan.row_experts
        return experts if self.first_row == 0 else experts[self.first_row:]

    @functools.cached_property
    def row_tokens(self) -> mx.array:
        tokens = self.plan.row_tokens
        return tokens if self.first_row == 0 else tokens[self.first_row:]


def _grouped_kernel(projection: nn.Module, rows: mx.array, plan_rows: _PlanRows,
                    **fused) -> mx.array:
    """The grouped kernel (`GpuBackend.grouped_qmm`) of `rows` against
    `projection`'s quantized matrices over `plan_rows`' spans; `fused`, its
    `row_tokens` and `up` arguments."""
    stream = _backend.resolve_stream(None)
    return _backend.implementation(stream).grouped_qmm(
        rows, projection.weight, projection.scales, projection.biases,
        plan_rows.expert_offsets, plan_rows.row_experts, bits=projection.bits,
        group_size=projection.group_size, stream=stream, **fused)


def _row_strided(rows: mx.array) -> mx.array:
    """`rows` `[n, 1, H]` as a reshape of `[n, H]`: strides `(H, H, 1)`."""
    return rows.reshape(-1, rows.shape[-1]).reshape(rows.shape)


class SwitchGLU(nn.Module):
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
          through this package's grouped kernel (meant for a few rows an
          expert), 1 for sorted single rows, more for tiles of that many
          rows. Default: `default_tile_m` per call.

    Expert ids must lie in `[0, num_experts)`, as a router gives them. The
    planned formulations skip others (their outputs are zero); mlx-lm's
    hands them to MLX's `gather_qmm`, which does not check them.
    """

    # Rows a single sorted-rows GEMM call takes at most; larger batches run in
    # slices of sorted rows (still sorted). MLX's CUDA backend has failed to
    # launch sorted gather_qmm over 81,920 rows (cuGraphAddKernelNode: invalid
    # argument) where 20,480 ran.
    max_rows_per_gemm = 32768
    # Calls of up to this many tokens run compiled (COMPILE_MAX_TOKENS); 0: never.
    compile_max_tokens = COMPILE_MAX_TOKENS
    # Expert parallelism (set by shard_experts): the layer
    # holds the model's experts [expert_offset, expert_offset + num_experts),
    # its routed ids are shifted by -expert_offset (others skipped), and its
    # outputs are summed over expert_group. None: the layer holds every expert.
    expert_group: mx.distributed.Group | None = None
    expert_offset = 0
    # From this many routed entries an expert-parallel call syncs to run its
    # GEMMs over its own rows (EXPERT_PARALLEL_SYNC_FROM_ENTRIES); per layer,
    # so that a benchmark can weigh the sync against the whole capacity.
    sync_from_entries = EXPERT_PARALLEL_SYNC_FROM_ENTRIES
    # Instead of that sync, where the grouped kernel computes the layer: the
    # share of the plan's capacity its GEMMs cover statically, the rows past
    # it left to the grouped kernel, which reads their count on the device
    # (e.g. 1.25 / N: none unless the rank's experts draw over 1.25 times
    # their share). None: the sync. See docs/DESIGN.md, "Expert parallelism".
    static_share: float | None = None

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
        linear = _mlx_lm_switch.SwitchLinear
        self.gate_proj = linear(input_dims, hidden_dims, num_experts, bias=bias)
        self.up_proj = linear(input_dims, hidden_dims, num_experts, bias=bias)
        self.down_proj = linear(hidden_dims, input_dims, num_experts, bias=bias)
        self.activation = _mlx_lm_switch.SwiGLU() if activation is None else activation

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

    def _can_group(self, dtype: mx.Dtype) -> bool:
        """Whether the grouped kernel can compute this layer here, for rows of `dtype`."""
        stream = _backend.resolve_stream(None)
        if stream.device.type != mx.gpu:
            return False
        backend = _backend.implementation(stream)
        return all(_kernel_computes(p, backend, dtype)
                   for p in (self.gate_proj, self.up_proj, self.down_proj))

    def _formulation(self, x: mx.array, indices: mx.array) -> Formulation:
        """The formulation of a call on `x` routed by `indices`."""
        formulation = self.formulation
        if formulation is None:
            stream = _backend.resolve_stream(None)
            formulation = rules.formulation_for(indices.size, self.num_experts,
                                                cuda=_on_cuda(stream),
                                                grouped=self._can_group(x.dtype))
        elif formulation is GROUPED_ROWS and not self._can_group(x.dtype):
            formulation = SORTED_ROWS
        # mlx-lm's call would hand the skipped ids (-1) to gather_qmm unchecked.
        if formulation is MLX_LM_CALL and self.expert_group is not None:
            return SORTED_ROWS
        return formulation

    def _plan(self, indices: mx.array, formulation: Formulation):
        indices = mx.stop_gradient(indices)
        if self.expert_group is not None:
            # The model's ids to this rank's, -1 (skipped) for other ranks' experts.
            local = indices.astype(mx.int32) - self.expert_offset  # routers give uint32
            indices = mx.where((local >= 0) & (local < self.num_experts), local, -1)
        return moe_plan(indices, self.num_experts, tile_m=formulation.plan_tile_m)

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
        capacity, or from `sync_from_entries` entries (and not
        while traced: no sync there) the used rows rounded up to a multiple
        of an eighth of the next power of two, which reads the plan's
        `num_rows` (a host sync)."""
        if not self._sheds_rows(plan) or _compiled.tracing():
            return plan.capacity
        used = max(int(plan.num_rows.item()), 1)
        # Up to the next multiple of an eighth of the next power of two: at
        # most 4 shapes an octave, and under 25% of rows wasted.
        step = max((1 << (used - 1).bit_length()) // 8, plan.tile_m)
        step = -(-step // plan.tile_m) * plan.tile_m
        return min(-(-used // step) * step, plan.capacity)

    def _mlx_lm(self, x: mx.array, indices: mx.array) -> mx.array:
        """mlx-lm's own `SwitchGLU` call on these projections: `[..., K, D]`.

        Below mlx-lm's sort threshold, its code with the GEMMs' lhs indices
        given (`_MLX_LM_CALL_DIGESTS`); else mlx-lm's call itself."""
        projections = (self.up_proj, self.gate_proj, self.down_proj)
        if (indices.size >= MLX_LM_SORTS_FROM_ENTRIES or x.shape[:-1] != indices.shape[:-1]
                or not all(type(p) in (_mlx_lm_switch.SwitchLinear,
                                       _mlx_lm_switch.QuantizedSwitchLinear) for p in projections)
                or not _mlx_lm_call_is_mirrored()):
            return _mlx_lm_switch.SwitchGLU.__call__(self, x, indices)
        lead, k = indices.shape[:-1], indices.shape[-1]
        token_rows, entry_rows = _gemm_rows(lead, k, False), _gemm_rows(lead, k, True)
        x = mx.expand_dims(x, (-2, -3))
        # One copy of sliced ids (argpartition's) at most, not one a GEMM.
        indices = mx.contiguous(mx.stop_gradient(indices).astype(mx.uint32))
        x_up = _switch_projection(self.up_proj, x, indices, token_rows)
        x_gate = _switch_projection(self.gate_proj, x, indices, token_rows)
        x = _switch_projection(self.down_proj, self.activation(x_up, x_gate), indices, entry_rows)
        return x.squeeze(-2)

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

    def _gates_in_kernel(self) -> bool:
        """Whether the grouped kernel computes the activation of the gate and up
        projections too: mlx-lm's own SwiGLU, projections without a bias, of
        one quantization (the kernel's rows from the tokens, its sums of both
        projections in one launch)."""
        gate, up = self.gate_proj, self.up_proj
        return (type(self.activation) is _mlx_lm_switch.SwiGLU
                and "bias" not in gate and "bias" not in up
                and (gate.bits, gate.group_size, gate.weight.shape)
                == (up.bits, up.group_size, up.weight.shape))

    def _grouped_projection(self, projection: nn.Module, rows: mx.array,
                            plan_rows: _PlanRows) -> mx.array:
        """`projection` of `rows` `[plan_rows.count, D]` by the grouped kernel,
        each row against its expert (`plan_rows`' spans); through MLX's
        `gather_qmm` where the rows' dtype is not the scales' (the kernel
        reads one dtype; the scales' is 16-bit, `_can_group`)."""
        if rows.dtype != projection.scales.dtype:
            out = projection(rows.reshape(-1, 1, rows.shape[-1]), plan_rows.row_experts,
                             sorted_indices=True)
            return out.reshape(rows.shape[0], out.shape[-1])
        out = _grouped_kernel(projection, rows, plan_rows)
        if "bias" in projection:
            out = out + projection["bias"][plan_rows.row_experts]
        return out

    def _grouped_mlp(self, x: mx.array, plan_rows: _PlanRows,
                     rows: mx.array | None = None) -> mx.array:
        """The expert MLP of `plan_rows` of tokens `x` `[..., D]` by the
        grouped kernel: over the rows each expert has, which it reads on the
        device, so an expert-parallel layer needs no sync either. `rows`:
        those rows gathered already (given where `plan_rows` starts past the
        first row). `[plan_rows.count, D]`."""
        plan = plan_rows.plan
        if self._gates_in_kernel():
            # One launch reads the tokens through the plan and gives
            # silu(gate) * up: no gathered rows, no separate activation.
            check_tokens(x, plan.indices_shape[:-1])  # as moe_gather checks them
            up = self.up_proj
            # Sizes spelled out: MLX makes no node for a reshape to the same
            # shape (a caller's tokens given as rows [T, D]), but does for one
            # with -1.
            tokens = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
            hidden = _grouped_kernel(self.gate_proj, tokens, plan_rows,
                                     row_tokens=plan_rows.row_tokens,
                                     up=(up.weight, up.scales, up.biases))
        else:
            if rows is None:
                rows = moe_gather(x, plan)
            x_up = self._grouped_projection(self.up_proj, rows, plan_rows)
            x_gate = self._grouped_projection(self.gate_proj, rows, plan_rows)
            hidden = self.activation(x_up, x_gate)
        return self._grouped_projection(self.down_proj, hidden, plan_rows)

    def _expert_rows(self, x: mx.array, plan, formulation: Formulation) -> mx.array:
        """The expert MLP of every row of the plan, `[capacity, D]`."""
        x = self._sharded_input(x)
        if formulation is GROUPED_ROWS:
            return self._grouped_mlp(x, _PlanRows(plan))
        rows = moe_gather(x, plan)
        static = self._static_rows(plan, x.dtype)
        if static is not None:
            out = self._expert_rows_used(rows[:static], plan, static)
            if static == plan.capacity:
                return out
            rest = self._grouped_mlp(x, _PlanRows(plan, static), rows[static:])
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
        # rows) takes that stride for the distance between rows: on the H200
        # it read expand_dims' rows wrongly (max error 7.2 in a 32-wide
        # product) and reshaped ones right (1e-6).
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
            return self._mlx_lm(x, indices)
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
            y = self._mlx_lm(x, indices)
            weighted = (y * scores[..., None]).sum(-2)
            return weighted.astype(y.dtype) if in_rows_dtype else weighted
        plan = self._plan(indices, formulation)
        rows = self._expert_rows(x, plan, formulation)
        dtype = rows.dtype if in_rows_dtype else mx.result_type(rows.dtype, scores.dtype)
        return self._summed(moe_combine(rows, plan, weights=scores, dtype=dtype))


def patch_model(model: nn.Module, *, tile_m: int | None = None, fuse: bool = True) -> int:
    """Replace every mlx-lm `SwitchGLU` in `model`, in place, keeping its weights.

    Float and quantized layers alike: the projections are kept as they are.
    With `fuse`, the MoE blocks of `FUSED_BLOCKS` whose `__call__` is the one
    their fused forward was written against then sum their experts' weighted
    outputs with one `moe_combine` (`SwitchGLU.weighted_sum`); they become
    instances of a subclass of their own class and of `FusedMoEBlock`.

    Args:
        model (Module): A loaded mlx-lm model (or any module tree).
        tile_m (int, optional): The GEMM formulation of every new layer (see
          `SwitchGLU`). Default: `default_tile_m`, per call.
        fuse (bool): Fuse the weighted sums where that is known to be safe.
          Default: ``True``.

    Returns:
        int: How many layers were replaced.
    """
    replacements = [(path, SwitchGLU.from_mlx_lm(module, tile_m=tile_m))
                    for path, module in model.named_modules()
                    if path and isinstance(module, _mlx_lm_switch.SwitchGLU)]
    if replacements:  # MLX's own walk of lists and dicts of modules, and swap
        model.update_modules(tree_unflatten(replacements))
    if fuse:
        for _, module in model.named_modules():
            entry = fused_blocks.entry_for(module)
            if entry is not None and isinstance(module.get(entry.experts), SwitchGLU):
                fused_blocks.fuse(module, entry)
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
    if any(isinstance(m, _mlx_lm_switch.SwitchGLU) for _, m in model.named_modules()):
        patch_model(model)
    named = [(path, m) for path, m in model.named_modules()
             if isinstance(m, SwitchGLU) and m.expert_group is None]
    ranges = [expert_parallel.expert_range(layer.num_experts, group) for _, layer in named]
    if tensor_parallel and named:  # all checked before anything is cut
        if any("." not in path for path, _ in named):
            raise ValueError("expert parallelism with tensor-parallel attention: the MoE "
                             "layers must sit in blocks of a model, not at its top")
        # A layer's parent is its MoE block (`mlp`), which stays whole.
        expert_parallel.shard_all_but(model, sorted({path.rpartition(".")[0]
                                                     for path, _ in named}), group)
    for (_, layer), (start, stop) in zip(named, ranges):
        expert_parallel.keep_experts(layer, start, stop)
        layer.expert_offset = start
        layer.expert_group = group
    return len(named)
