"""Backend dispatch: the stream's device picks the implementation.

`Backend` declares what an implementation offers the public ops: `plan`,
`gather_rows` and `combine_rows`, all lazy. Two satisfy it: `_cpu.CpuBackend`,
the C++ primitives of `src/`, and `_gpu.GpuBackend`, the kernel texts of
`kernels/` run through `mx.fast.metal_kernel` or `mx.fast.cuda_kernel`.
Neither imports this module (it imports them): they match the protocol by
their methods, which tests/test_structure.py compares with it.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import mlx.core as mx


@runtime_checkable
class Backend(Protocol):
    """The three operations every implementation provides.

    Arrays come in checked and sized by the public ops (`plan.py`,
    `gather.py`, `combine.py`); what comes back is lazy. The results are the
    same bits on every backend (docs/DESIGN.md).
    """

    plan_id_dtypes: tuple[mx.Dtype, ...]
    """The id dtypes `plan` reads as they are; `moe_plan` converts others to int32."""

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
        """The stable counting sort of the routing entries by expert.

        Args:
            ids (array): Expert ids of the indices' shape `[..., K]`, of a
              dtype in `plan_id_dtypes`: negative skips an entry,
              `>= num_experts` is invalid.
            weights (array, optional): Float weights of the same shape (any
              float dtype), carried to the rows as float32; or None.
            num_experts (int): Number of experts `E`.
            tile_m (int): Each expert's rows are padded to a multiple of this.
            top_k (int): Entries per token, `K`.
            stream (Stream): Where to run.

        Returns:
            tuple(list(array), Callable): Every array the backend computed
            (`MoEPlan.outputs`), and `field(name, shape)`, which views the
            plan's field `name` (one of `_sizes.PLAN_FIELDS`) with `shape`.
        """
        ...

    def gather_rows(
        self,
        src: mx.array,
        index: mx.array,
        inverse: mx.array | None,
        *,
        dtype: mx.Dtype,
        stream: mx.Stream,
    ) -> mx.array:
        """`out[r] = src[index[r]]` converted to `dtype`, zeros where `index[r]`
        is negative or `>= N`. Differentiable with respect to `src` given
        `inverse`, by the formula of `_gradients.gather_rows_vjp`.

        Args:
            src (array): Rows `[N, H]`, float32, float16 or bfloat16.
            index (array): int32 `[R]`.
            inverse (array, optional): int32 `[N, M]`: for each src row, the
              out rows that read it (`-1` for none); only the gradient reads
              it. None: no gradient with respect to `src` (for the gradient
              formulas' own row operations, `_gradients.py`).
            dtype (Dtype): The output's dtype.
            stream (Stream): Where to run.

        Returns:
            array: `[R, H]` of `dtype`.
        """
        ...

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
        """`out[n] = sum_m weights[n, m] * src[index[n, m]]`, summed in float32
        over ascending m and rounded once to `dtype`; an index that is
        negative or `>= R` adds nothing. Differentiable with respect to `src`
        (given `inverse`) and `weights`, by the formulas of
        `_gradients.combine_rows_vjp`.

        Args:
            src (array): Rows `[R, H]`, float32, float16 or bfloat16.
            index (array): int32 `[N, M]`.
            weights (array, optional): float32 `[N, M]`; None means 1.
            inverse (array, optional): int32 `[R]`: for each src row, the flat
              entry `n * M + m` that reads it (`-1` for none); only the
              gradient reads it. None: no gradient with respect to `src`.
            dtype (Dtype): The output's dtype.
            stream (Stream): Where to run.

        Returns:
            array: `[N, H]` of `dtype`.
        """
        ...


def resolve_stream(stream: mx.Stream | mx.Device | None) -> mx.Stream:
    if stream is None:
        return mx.default_stream(mx.default_device())
    if isinstance(stream, mx.DeviceType):  # mx.cpu / mx.gpu, as MLX's own ops accept
        return mx.default_stream(mx.Device(stream))
    if isinstance(stream, mx.Device):
        return mx.default_stream(stream)
    if isinstance(stream, mx.Stream):
        return stream
    raise TypeError(f"stream: expected a Stream, Device, DeviceType or None, got {type(stream).__name__}")


def gpu_backend() -> str | None:
    """'metal', 'cuda' or None: which GPU backend this MLX was built with."""
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


def implementation(stream: mx.Stream) -> Backend:
    """The backend of `stream`'s device."""
    if stream.device.type == mx.DeviceType.cpu:
        from . import _cpu

        return _cpu.CPU
    backend = gpu_backend()
    if backend is None:
        raise RuntimeError(
            "stream: a GPU stream was given but this MLX has neither Metal nor CUDA"
        )
    from . import _gpu

    return _gpu.for_backend(backend)

