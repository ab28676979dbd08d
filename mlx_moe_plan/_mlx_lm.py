"""mlx-lm as the layer found it at import, and the mirror of its SwitchGLU call.

mlx-lm's switch layer classes are captured here once, when the package's
layer is first imported. A user may then replace
`mlx_lm.models.switch_layers.SwitchGLU` with `nn.SwitchGLU`, so that every
model built afterwards has the package's layer: the layer still reaches
mlx-lm's own classes through these names, never through the module it
replaced one of, which would be itself.

`mlx_lm_call` is mlx-lm's `SwitchGLU` call, op for op, with the GEMMs' lhs
indices given. MLX makes those indices at every call of mlx-lm's (an arange
over the rows, copied to a contiguous array, and sliced ids copied by each
GEMM on CUDA): small kernels around the GEMMs, which a decoding step pays
for in time (benchmarks/HISTORY.md, "The index kernels around mlx-lm's
call"). Given as constants made once a shape, the GEMMs are the same on the
same rows, the bits are mlx-lm's, and a compiled step runs fewer kernels. The mirror holds
while mlx-lm's code is the code mirrored (`CALL_DIGESTS`); where it differs,
`mlx_lm_call` runs mlx-lm's call itself. Likewise `clamped_swiglu` names
gpt-oss's activation to the grouped kernel, which computes it itself, while
mlx-lm's is the code mirrored (`SWIGLU_OAI_DIGESTS`).

This module changes when mlx-lm's switch layers or gpt-oss's activation change.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

try:
    from mlx_lm.models import switch_layers
except ImportError as error:  # the layer is an mlx-lm drop-in; the ops are not
    raise ImportError(
        "mlx_moe_plan.nn replaces mlx-lm's SwitchGLU and needs mlx-lm: "
        "pip install mlx-lm (or this package's [bench] extra)"
    ) from error

from mlx_lm.models import activations

from .fused_blocks import source_digest
from .rules import MLX_LM_SORTS_FROM_ENTRIES

SwitchGLU = switch_layers.SwitchGLU
SwitchLinear = switch_layers.SwitchLinear
QuantizedSwitchLinear = switch_layers.QuantizedSwitchLinear
SwiGLU = switch_layers.SwiGLU
_CLASSES = {"SwitchGLU": SwitchGLU, "SwitchLinear": SwitchLinear,
            "QuantizedSwitchLinear": QuantizedSwitchLinear}

# SHA-256 prefixes of the `__call__` sources `mlx_lm_call` mirrors (mlx-lm 0.32.2).
CALL_DIGESTS = {"SwitchGLU": "a2f36b7d7e9640a8", "SwitchLinear": "1c91ef16afb139a8",
                "QuantizedSwitchLinear": "797f197172695142"}


# SHA-256 prefixes of gpt-oss's activation as the grouped kernel's clamped
# SwiGLU mirrors it (kernels/qmm_store.h, mlx-lm 0.32.2): the class's call and
# the function it calls.
SWIGLU_OAI_DIGESTS = ("17afdd4f51677454", "9848780f19264e0f")


def clamped_swiglu(activation: nn.Module) -> tuple[float, float] | None:
    """`(alpha, limit)` of `activation` where it is mlx-lm's gpt-oss SwiGLU
    (`SwigluOAI`) as the grouped kernel mirrors it, else None."""
    oai = getattr(activations, "SwigluOAI", None)
    if oai is None or type(activation) is not oai or not _swiglu_oai_is_mirrored():
        return None
    return float(activation._alpha), float(activation._limit)


@functools.cache
def _swiglu_oai_is_mirrored() -> bool:
    return (source_digest(activations.SwigluOAI.__call__),
            source_digest(activations.swiglu_oai)) == SWIGLU_OAI_DIGESTS


@functools.cache
def call_is_mirrored() -> bool:
    """Whether mlx-lm's SwitchGLU and projection calls are the code mirrored."""
    return all(source_digest(_CLASSES[name].__call__) == digest
               for name, digest in CALL_DIGESTS.items())


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
    if isinstance(projection, QuantizedSwitchLinear):
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


def mlx_lm_call(layer: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
    """mlx-lm's own `SwitchGLU` call on `layer`'s projections and activation.

    Below mlx-lm's sort threshold, its code with the GEMMs' lhs indices
    given; else, or where mlx-lm's code is not the code mirrored, mlx-lm's
    call itself.

    Args:
        layer (Module): A layer with mlx-lm's `gate_proj`, `up_proj`,
          `down_proj` and `activation`.
        x (array): `[..., D]`.
        indices (array): `[..., K]`.

    Returns:
        array: `[..., K, D]`.
    """
    projections = (layer.up_proj, layer.gate_proj, layer.down_proj)
    if (indices.size >= MLX_LM_SORTS_FROM_ENTRIES or x.shape[:-1] != indices.shape[:-1]
            or not all(type(p) in (SwitchLinear, QuantizedSwitchLinear) for p in projections)
            or not call_is_mirrored()):
        return SwitchGLU.__call__(layer, x, indices)
    lead, k = indices.shape[:-1], indices.shape[-1]
    token_rows, entry_rows = _gemm_rows(lead, k, False), _gemm_rows(lead, k, True)
    x = mx.expand_dims(x, (-2, -3))
    # One copy of sliced ids (argpartition's) at most, not one a GEMM.
    indices = mx.contiguous(mx.stop_gradient(indices).astype(mx.uint32))
    x_up = _switch_projection(layer.up_proj, x, indices, token_rows)
    x_gate = _switch_projection(layer.gate_proj, x, indices, token_rows)
    x = _switch_projection(layer.down_proj, layer.activation(x_up, x_gate), indices, entry_rows)
    return x.squeeze(-2)
