"""A drop-in `SwitchGLU` for mlx-lm MoE models, built on plan, gather and unsort.

`SwitchGLU` takes the constructor arguments, parameter names and call of
`mlx_lm.models.switch_layers.SwitchGLU`, and reuses mlx-lm's own
`SwitchLinear` projections, so checkpoints load unchanged and `nn.quantize`
turns them into `QuantizedSwitchLinear` exactly as it does mlx-lm's.
`patch_model` swaps it into a loaded model in place.

Expert GEMMs use MLX's `gather_mm` / `gather_qmm` over expert-sorted single
rows (`sorted_indices=True`, mlx-lm's formulation). Needs mlx-lm installed.
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

from .combine import moe_combine
from .gather import moe_gather, moe_unsort
from .plan import moe_plan


class SwitchGLU(nn.Module):
    """mlx-lm's `SwitchGLU` with the token dispatch of `mlx_moe_plan`.

    Args:
        input_dims (int): Model dimension D.
        hidden_dims (int): Expert hidden dimension I.
        num_experts (int): Number of experts E.
        activation (Module): `activation(x_up, x_gate)`. Default: SwiGLU.
        bias (bool): Projection biases. Default: ``False``.
    """

    def __init__(
        self,
        input_dims: int,
        hidden_dims: int,
        num_experts: int,
        activation: nn.Module | None = None,
        bias: bool = False,
    ):
        super().__init__()
        linear = _mlx_lm_switch.SwitchLinear
        self.gate_proj = linear(input_dims, hidden_dims, num_experts, bias=bias)
        self.up_proj = linear(input_dims, hidden_dims, num_experts, bias=bias)
        self.down_proj = linear(hidden_dims, input_dims, num_experts, bias=bias)
        self.activation = _mlx_lm_switch.SwiGLU() if activation is None else activation

    @classmethod
    def from_mlx_lm(cls, layer: nn.Module) -> "SwitchGLU":
        """A `SwitchGLU` sharing `layer`'s projections and activation (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.gate_proj = layer.gate_proj
        new.up_proj = layer.up_proj
        new.down_proj = layer.down_proj
        new.activation = layer.activation
        return new

    @property
    def num_experts(self) -> int:
        return self.gate_proj.num_experts

    def _expert_rows(self, x: mx.array, plan) -> mx.array:
        """The expert MLP of every row of the plan, `[capacity, D]`."""
        rows = mx.expand_dims(moe_gather(x, plan), -2)  # [capacity, 1, D]
        experts = plan.row_experts  # sorted by construction
        x_up = self.up_proj(rows, experts, sorted_indices=True)
        x_gate = self.gate_proj(rows, experts, sorted_indices=True)
        out = self.down_proj(self.activation(x_up, x_gate), experts, sorted_indices=True)
        return out.squeeze(-2)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """Args: x `[..., D]`, indices `[..., K]`. Returns `[..., K, D]`, as mlx-lm's."""
        plan = moe_plan(mx.stop_gradient(indices), self.num_experts)
        return moe_unsort(self._expert_rows(x, plan), plan)

    def weighted_sum(self, x: mx.array, indices: mx.array, scores: mx.array) -> mx.array:
        """`(self(x, indices) * scores[..., None]).sum(-2)` with one `moe_combine`.

        The fused path for MoE blocks that weight and sum the experts' outputs
        themselves: no `[..., K, D]` intermediate. The sum runs in float32 over
        ascending k, so its last bits may differ from the unfused product-sum
        in the activations' dtype.
        """
        plan = moe_plan(mx.stop_gradient(indices), self.num_experts)
        return moe_combine(self._expert_rows(x, plan), plan, weights=scores)


def patch_model(model: nn.Module) -> int:
    """Replace every mlx-lm `SwitchGLU` in `model`, in place, keeping its weights.

    Float and quantized layers alike: the projections are kept as they are.

    Args:
        model (Module): A loaded mlx-lm model (or any module tree).

    Returns:
        int: How many layers were replaced.
    """
    original = _mlx_lm_switch.SwitchGLU
    replaced = 0

    def visit(module: nn.Module) -> None:
        nonlocal replaced
        for key, value in list(module.items()):
            if isinstance(value, original):
                module[key] = SwitchGLU.from_mlx_lm(value)
                replaced += 1
            elif isinstance(value, nn.Module):
                visit(value)
            elif isinstance(value, (list, tuple)):
                for index, item in enumerate(value):
                    if isinstance(item, original):
                        value[index] = SwitchGLU.from_mlx_lm(item)
                        replaced += 1
                    elif isinstance(item, nn.Module):
                        visit(item)

    visit(model)
    return replaced
