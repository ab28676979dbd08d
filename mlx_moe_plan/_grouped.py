"""The layer's grouped path: its expert MLP by the backend's grouped kernel.

The grouped kernel (`_backend.GroupedQmm`, kernels/grouped_qmm.h on a GPU)
computes affine-quantized projections of 16-bit rows over a plan's sorted
single rows, reading each expert's span on the device: no host sync, and an
expert without rows costs nothing. `GroupedExperts` gives the layer
(`nn.SwitchGLU`) that path where the backend has the kernel and it computes
the layer's projections (`_can_group`); elsewhere the layer runs sorted rows
through MLX's `gather_qmm`.

This module changes when the grouped kernel's interface or its use does.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn

from . import _backend, _mlx_lm
from ._checks import check_tokens
from ._mlx_lm import QuantizedSwitchLinear, SwiGLU
from .gather import moe_gather


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


def grouped_kernel(projection: nn.Module, rows: mx.array, plan_rows: _PlanRows,
                   **fused) -> mx.array:
    """The backend's grouped kernel of `rows` against `projection`'s quantized
    matrices over `plan_rows`' spans; `fused`, its `row_tokens`, `up`,
    `bias`, `up_bias` and `clamped_swiglu` arguments."""
    stream = _backend.resolve_stream(None)
    return _backend.implementation(stream).grouped_qmm(
        rows, projection.weight, projection.scales, projection.biases,
        plan_rows.expert_offsets, plan_rows.row_experts, bits=projection.bits,
        group_size=projection.group_size, stream=stream, **fused)


def _kernel_computes(projection: nn.Module, backend: _backend.Backend, dtype: mx.Dtype) -> bool:
    """Whether `backend`'s grouped kernel computes `projection` on rows of `dtype`."""
    return (isinstance(projection, QuantizedSwitchLinear)
            and _backend.grouped_kernel_computes(projection, backend, dtype))


class GroupedExperts:
    """The grouped path of a layer with mlx-lm's `gate_proj`, `up_proj`,
    `down_proj` and `activation` (a mixin of `nn.SwitchGLU`)."""

    def _can_group(self, dtype: mx.Dtype) -> bool:
        """Whether the grouped kernel can compute this layer here, for rows of `dtype`."""
        stream = _backend.resolve_stream(None)
        if stream.device.type != mx.gpu:
            return False
        backend = _backend.implementation(stream)
        return all(_kernel_computes(p, backend, dtype)
                   for p in (self.gate_proj, self.up_proj, self.down_proj))

    def _gates_in_kernel(self, dtype: mx.Dtype) -> bool:
        """Whether the grouped kernel computes the activation of the gate and up
        projections too, for rows of `dtype`: mlx-lm's own SwiGLU or gpt-oss's
        clamped one (`_mlx_lm.clamped_swiglu`), of projections of one
        quantization, both without a bias or both with one the kernel adds
        (the kernel's rows from the tokens, its sums of both projections in
        one launch)."""
        gate, up = self.gate_proj, self.up_proj
        biases = [_backend.kernel_bias(p, dtype) is not None for p in (gate, up)]
        with_bias = ["bias" in p for p in (gate, up)]
        return ((type(self.activation) is SwiGLU
                 or _mlx_lm.clamped_swiglu(self.activation) is not None)
                and biases[0] == biases[1] == with_bias[0] == with_bias[1]
                and (gate.bits, gate.group_size, gate.weight.shape)
                == (up.bits, up.group_size, up.weight.shape))

    @staticmethod
    def _fuses_gate_up(gate: nn.Module, in_dims: int, capacity: int) -> bool:
        """Whether the backend's rule computes the gate projection `gate` and
        the up projection of rows of `in_dims` values over `capacity` plan rows
        in one launch (`_backend.Backend.grouped_qmm_fuses`), where
        `_gates_in_kernel` says it can. (The layer hands in the gate it has
        read: each read of a module's attribute costs about a microsecond.)"""
        num_experts, out_dims, _ = gate.weight.shape
        return _backend.implementation(_backend.resolve_stream(None)).grouped_qmm_fuses(
            num_experts=num_experts, in_dims=in_dims, out_dims=out_dims, capacity=capacity,
            bits=gate.bits, group_size=gate.group_size)

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
        bias = _backend.kernel_bias(projection, rows.dtype)
        out = grouped_kernel(projection, rows, plan_rows, bias=bias)
        if bias is None and "bias" in projection:
            out = out + projection["bias"][plan_rows.row_experts]
        return out

    def _grouped_mlp(self, x: mx.array, plan, first_row: int = 0,
                     rows: mx.array | None = None) -> mx.array:
        """The expert MLP of the plan's rows from `first_row` on, of tokens
        `x` `[..., D]`, by the grouped kernel: over the rows each expert has,
        which it reads on the device, so an expert-parallel layer needs no
        sync either. `rows`: those rows gathered already (given where
        `first_row` is past the first row). `[capacity - first_row, D]`."""
        plan_rows = _PlanRows(plan, first_row)
        gate = self.gate_proj
        if self._gates_in_kernel(x.dtype) and self._fuses_gate_up(gate, x.shape[-1],
                                                                  plan_rows.count):
            # One launch reads the tokens through the plan and gives the
            # activation of gate and up: no gathered rows, no separate
            # activation, no biases added apart.
            check_tokens(x, plan.indices_shape[:-1])  # as moe_gather checks them
            up = self.up_proj
            # Sizes spelled out: MLX makes no node for a reshape to the same
            # shape (a caller's tokens given as rows [T, D]), but does for one
            # with -1.
            tokens = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
            hidden = grouped_kernel(gate, tokens, plan_rows,
                                    row_tokens=plan_rows.row_tokens,
                                    up=(up.weight, up.scales, up.biases),
                                    bias=_backend.kernel_bias(gate, x.dtype),
                                    up_bias=_backend.kernel_bias(up, x.dtype),
                                    clamped_swiglu=_mlx_lm.clamped_swiglu(self.activation))
        else:
            if rows is None:
                rows = moe_gather(x, plan)
            x_up = self._grouped_projection(self.up_proj, rows, plan_rows)
            x_gate = self._grouped_projection(gate, rows, plan_rows)
            hidden = self.activation(x_up, x_gate)
        return self._grouped_projection(self.down_proj, hidden, plan_rows)
