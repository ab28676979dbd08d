"""The CPU implementation: thin calls into the C++ primitives of `src/`."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ._extension import REBUILD, _ext
from ._sizes import PLAN_FIELDS

# The Plan primitive returns the plan's fields in PLAN_FIELDS order (row_weights,
# the last, only with weights); the extension's plan_outputs is its C++ list
# (kPlanOutputs). Fields read by position from a primitive that orders them
# otherwise would be the wrong arrays, so a mismatch stops here.
if tuple(_ext.plan_outputs) != PLAN_FIELDS:
    raise ImportError(
        f"mlx_moe_plan's C++ extension returns the plan's fields as {_ext.plan_outputs}, "
        f"not in _sizes.PLAN_FIELDS order {PLAN_FIELDS}: the two lists must agree (after "
        f"a change to src/, rebuild with {REBUILD})"
    )


class CpuBackend:
    """The CPU backend: each operation is one C++ primitive (`src/`).

    An object, like the GPU backend, so that both are the same kind of thing
    to `_backend.implementation` and to the `_backend.Backend` protocol they
    satisfy (tests/test_structure.py); it holds no state.
    """

    plan_id_dtypes = (mx.int32,)  # src/plan.cpp reads int32
    # The GPU's optional kernels have no C++ counterpart: callers use MLX's ops.
    grouped_qmm = None
    argsort_slice = None
    head_norm_rope = None
    decode_attention = None
    add_rms_norm = None

    def grouped_qmm_computes(self, *, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
        return False

    def grouped_qmm_fuses(self, *, num_experts: int, in_dims: int, out_dims: int,
                          capacity: int, bits: int, group_size: int) -> bool:
        return False

    def argsort_slice_computes(self, *, row_size: int, dtype: mx.Dtype) -> bool:
        return False

    def head_norm_rope_computes(self, *, head_dim: int, dtype: mx.Dtype) -> bool:
        return False

    def decode_attention_computes(self, *, head_dim: int, heads: int, kv_heads: int,
                                  dtype: mx.Dtype) -> bool:
        return False

    def add_rms_norm_computes(self, *, dtype: mx.Dtype) -> bool:
        return False

    def plan(
        self,
        ids: mx.array,
        weights: mx.array | None,
        *,
        num_experts: int,
        tile_m: int,
        top_k: int,
        stream: mx.Stream,
    ) -> tuple[list[mx.array], Callable[[str, tuple[int, ...]], mx.array]]:
        if weights is not None:
            weights = weights.astype(mx.float32, stream=stream).reshape(-1, stream=stream)
        outputs = _ext.plan(ids.reshape(-1, stream=stream), weights, num_experts, tile_m, top_k,
                            stream=stream)
        fields = dict(zip(PLAN_FIELDS, outputs))  # without weights, row_weights is absent

        def field(name: str, shape: tuple[int, ...]) -> mx.array:
            array = fields[name]
            return array if array.shape == tuple(shape) else array.reshape(shape, stream=stream)

        return outputs, field

    def gather_rows(
        self,
        src: mx.array,
        index: mx.array,
        inverse: mx.array | None,
        *,
        dtype: mx.Dtype,
        stream: mx.Stream,
    ) -> mx.array:
        return _ext.gather_rows(src, index, inverse, dtype, stream=stream)

    def combine_rows(
        self,
        src: mx.array,
        index: mx.array,
        weights: mx.array | None,
        inverse: mx.array | None,
        *,
        dtype: mx.Dtype,
        stream: mx.Stream,
    ) -> mx.array:
        return _ext.combine_rows(src, index, weights, inverse, dtype, stream=stream)


CPU = CpuBackend()
