"""A drop-in `SwitchGLU` for mlx-lm MoE models, built on plan, gather and unsort.

`SwitchGLU` takes the constructor arguments, parameter names and call of
`mlx_lm.models.switch_layers.SwitchGLU`, and reuses mlx-lm's own
`SwitchLinear` projections, so checkpoints load unchanged and `nn.quantize`
turns them into `QuantizedSwitchLinear` exactly as it does mlx-lm's.
`patch_model` swaps it into a loaded model in place.

Expert GEMMs use MLX's `gather_mm` / `gather_qmm` in one of two formulations:
sorted single rows (`tile_m=1`, mlx-lm's: one expert index a row) or tiles
(`tile_m` rows a tile, one expert a tile by the plan's construction, rows seen
as `[max_tiles, tile_m, D]` with `rhs_indices=tile_experts`). The default,
`default_tile_m`, is the rule measured per backend (benchmarks/RESULTS.md);
`tile_m` overrides it per layer. Needs mlx-lm installed.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

try:
    from mlx_lm.models import switch_layers as _mlx_lm_switch
except ImportError as error:  # the layer is an mlx-lm drop-in; the ops are not
    raise ImportError(
        "mlx_moe_plan.nn replaces mlx-lm's SwitchGLU and needs mlx-lm: "
        "pip install mlx-lm (or this package's [bench] extra)"
    ) from error

from . import _backend
from .combine import moe_combine
from .gather import moe_gather, moe_unsort
from .plan import moe_plan


# On MLX's CUDA backend (H200, MLX 0.32.4, 4-bit weights), tiles beat sorted
# single rows 3.5x to 24x at every measured shape from 4,096 routed entries up:
# 16-row tiles while experts average fewer than 64 rows, 64-row tiles from
# there (`python -m benchmarks.moe --layer --tile-m 1,16,32,64`, RESULTS.md).
TILED_FROM_ENTRIES = 4096
LARGE_TILES_FROM_ROWS_PER_EXPERT = 64


def default_tile_m(num_entries: int, num_experts: int, stream=None) -> int:
    """The GEMM formulation the layer uses unless told: the measured rule.

    Tiles on MLX's CUDA backend from `TILED_FROM_ENTRIES` routed entries (16
    rows, or 64 once experts average `LARGE_TILES_FROM_ROWS_PER_EXPERT` rows);
    mlx-lm's sorted single rows (1) elsewhere: on the CPU, whose `gather_qmm`
    pays for every padding row (16-row tiles ran 18x slower at T=8), on Metal,
    not yet measured, and below the measured sizes.
    """
    stream = _backend.resolve_stream(stream)
    if stream.device.type != mx.gpu or _backend.gpu_backend() != "cuda":
        return 1
    if num_entries < TILED_FROM_ENTRIES:
        return 1
    return 64 if num_entries >= LARGE_TILES_FROM_ROWS_PER_EXPERT * num_experts else 16


class SwitchGLU(nn.Module):
    """mlx-lm's `SwitchGLU` with the token dispatch of `mlx_moe_plan`.

    Args:
        input_dims (int): Model dimension D.
        hidden_dims (int): Expert hidden dimension I.
        num_experts (int): Number of experts E.
        activation (Module): `activation(x_up, x_gate)`. Default: SwiGLU.
        bias (bool): Projection biases. Default: ``False``.
        tile_m (int, optional): GEMM formulation: 1 for sorted single rows,
          more for tiles of that many rows. Default: `default_tile_m` per call.
    """

    # Rows a single sorted-rows GEMM call takes at most; larger batches run in
    # slices of sorted rows (still sorted). MLX's CUDA backend has failed to
    # launch sorted gather_qmm over 81,920 rows (cuGraphAddKernelNode: invalid
    # argument) where 20,480 ran.
    max_rows_per_gemm = 32768

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
    def num_experts(self) -> int:
        return self.gate_proj.num_experts

    def _plan(self, indices: mx.array):
        tile_m = self.tile_m
        if tile_m is None:
            tile_m = default_tile_m(indices.size, self.num_experts)
        return moe_plan(mx.stop_gradient(indices), self.num_experts, tile_m=tile_m)

    def _mlp(self, rows: mx.array, experts: mx.array) -> mx.array:
        """The expert MLP of `rows` `[n, m, D]`, expert `experts[i]` for `rows[i]`."""
        x_up = self.up_proj(rows, experts, sorted_indices=True)
        x_gate = self.gate_proj(rows, experts, sorted_indices=True)
        return self.down_proj(self.activation(x_up, x_gate), experts, sorted_indices=True)

    def _expert_rows(self, x: mx.array, plan) -> mx.array:
        """The expert MLP of every row of the plan, `[capacity, D]`."""
        rows = moe_gather(x, plan)
        if plan.tile_m > 1:
            # Tiles past num_tiles hold zero rows and expert -1: give them the
            # last expert, so the experts stay sorted as sorted_indices
            # promises (a wrong promise gives wrong weight gradients); nothing
            # reads their outputs.
            last = self.num_experts - 1
            experts = mx.where(plan.tile_experts < 0, last, plan.tile_experts)
            tiles = rows.reshape(plan.max_tiles, plan.tile_m, -1)
            return self._mlp(tiles, experts).reshape(plan.capacity, -1)
        rows = mx.expand_dims(rows, -2)  # [capacity, 1, D]
        experts = plan.row_experts  # sorted by construction
        step = self.max_rows_per_gemm
        if plan.capacity <= step:
            return self._mlp(rows, experts).squeeze(-2)
        parts = [self._mlp(rows[i : i + step], experts[i : i + step])
                 for i in range(0, plan.capacity, step)]
        return mx.concatenate(parts).squeeze(-2)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """Args: x `[..., D]`, indices `[..., K]`. Returns `[..., K, D]`, as mlx-lm's."""
        plan = self._plan(indices)
        return moe_unsort(self._expert_rows(x, plan), plan)

    def weighted_sum(self, x: mx.array, indices: mx.array, scores: mx.array) -> mx.array:
        """`(self(x, indices) * scores[..., None]).sum(-2)` with one `moe_combine`.

        The fused path for MoE blocks that weight and sum the experts' outputs
        themselves: no `[..., K, D]` intermediate. The sum runs in float32 over
        ascending k, so its last bits may differ from the unfused product-sum
        in the activations' dtype.
        """
        plan = self._plan(indices)
        return moe_combine(self._expert_rows(x, plan), plan, weights=scores)


def patch_model(model: nn.Module, *, tile_m: int | None = None) -> int:
    """Replace every mlx-lm `SwitchGLU` in `model`, in place, keeping its weights.

    Float and quantized layers alike: the projections are kept as they are.

    Args:
        model (Module): A loaded mlx-lm model (or any module tree).
        tile_m (int, optional): The GEMM formulation of every new layer (see
          `SwitchGLU`). Default: `default_tile_m`, per call.

    Returns:
        int: How many layers were replaced.
    """
    original = _mlx_lm_switch.SwitchGLU
    replaced = 0

    def visit(module: nn.Module) -> None:
        nonlocal replaced
        for key, value in list(module.items()):
            if isinstance(value, original):
                module[key] = SwitchGLU.from_mlx_lm(value, tile_m=tile_m)
                replaced += 1
            elif isinstance(value, nn.Module):
                visit(value)
            elif isinstance(value, (list, tuple)):
                for index, item in enumerate(value):
                    if isinstance(item, original):
                        value[index] = SwitchGLU.from_mlx_lm(item, tile_m=tile_m)
                        replaced += 1
                    elif isinstance(item, nn.Module):
                        visit(item)

    visit(model)
    return replaced
