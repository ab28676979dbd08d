"""Backend dispatch: the stream's device picks the implementation.

`Backend` declares what an implementation offers the public ops: `plan`,
`gather_rows` and `combine_rows`, all lazy; and five optional kernels that
the layer, the routers, the attention and the decoder layers use where a
backend has them, `grouped_qmm`, `argsort_slice`, `head_norm_rope`,
`decode_attention` and `add_rms_norm` (None where it has not, with a
predicate saying which inputs it computes). Two satisfy it:
`_cpu.CpuBackend`, the C++ primitives of `src/`, and `_gpu.GpuBackend`, the
kernel texts of `kernels/` run through `mx.fast.metal_kernel` or
`mx.fast.cuda_kernel`. Neither imports this module
(it imports them): they match the protocol by their methods, which
tests/test_structure.py compares with it.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Callable, Protocol, runtime_checkable

import mlx.core as mx


class GroupedQmm(Protocol):
    """A backend's grouped expert GEMM over a plan's sorted rows, where it has one."""

    def __call__(
        self,
        rows: mx.array,
        weight: mx.array,
        scales: mx.array,
        biases: mx.array,
        expert_offsets: mx.array,
        row_experts: mx.array,
        *,
        bits: int,
        group_size: int,
        stream: mx.Stream,
        row_tokens: mx.array | None = None,
        up: tuple[mx.array, mx.array, mx.array] | None = None,
        bias: mx.array | None = None,
        up_bias: mx.array | None = None,
        clamped_swiglu: tuple[float, float] | None = None,
        dense: bool = False,
    ) -> mx.array:
        """`out[r] = rows[r] @ dequantize(weight[e]).T (+ bias[e])` for the
        rows of expert e's span, zeros on the tail rows. With `row_tokens`,
        `rows` are the tokens and row r is `rows[row_tokens[r]]`; with `up`,
        the result is `silu(out) * up_out`, `up_out` the same GEMM with `up`'s
        matrices (and `up_bias`): mlx-lm's SwiGLU of a gate and an up
        projection, or with `clamped_swiglu` gpt-oss's clamped one.
        Differentiable with respect to `rows` (through MLX's `gather_qmm`,
        `row_experts` naming each row's expert) and the biases; quantized
        weights get no gradient, as in MLX.

        Args:
            rows (array): `[capacity, D]`, or `[T, D]` with `row_tokens`, of a
                dtype `grouped_qmm_computes` accepts, the dtype of `scales`
                and `biases`.
            weight (array): uint32 `[E, N, D * bits / 32]`, MLX's affine packing.
            scales (array): `[E, N, D / group_size]`.
            biases (array): `[E, N, D / group_size]`.
            expert_offsets (array): int32 `[E + 1]`, the plan's.
            row_experts (array): int32 `[capacity]`, the plan's (non-decreasing).
            bits (int): Bits a weight, as `grouped_qmm_computes` accepts.
            group_size (int): The quantization group, as `grouped_qmm_computes` accepts.
            stream (Stream): Where to run.
            row_tokens (array, optional): int32 `[capacity]`, the plan's, of
                single rows (`tile_m=1`: no padding in the spans). A token
                outside `[0, T)` reads the nearest one inside.
            up (tuple, optional): weight, scales and biases of the up
                projection, shaped and typed as `weight`, `scales` and `biases`.
            bias (array, optional): `[E, N]` in the rows' dtype, the
                projection's own bias (mlx-lm's `SwitchLinear.bias`).
            up_bias (array, optional): The up projection's, with `up` and `bias`.
            clamped_swiglu (tuple, optional): With `up`, `(alpha, limit)`:
                `(clip(up_out, -limit, limit) + 1) * g * sigmoid(alpha * g)`
                of `g = min(out, limit)` (mlx-lm's `swiglu_oai`) in place of
                silu's.
            dense (bool, optional): The one expert is a dense projection
                (`weight` of one expert): the launch may shape its blocks
                for it (`launch.grouped_qmm_launch`). An expert-parallel
                rank's single expert is not one. Default: ``False``.

        Returns:
            array: `[capacity, N]` in the rows' dtype.
        """
        ...


class ArgsortSlice(Protocol):
    """A backend's slice of a row-wise argsort in one launch, where it has one."""

    def __call__(self, values: mx.array, start: int, count: int, *,
                 normalize: bool = False,
                 stream: mx.Stream) -> tuple[mx.array, mx.array]:
        """`mx.argsort(values)[..., start:start + count]`, uint32, and the
        values at those indices, `mx.take_along_axis(values, indices,
        axis=-1)`: positions of each row's stable ascending sort, NaN last, as
        MLX's GPU `argpartition` orders a row. For rows `argsort_slice_computes`
        accepts, `0 <= start`, `1 <= count`, `start + count <= values.shape[-1]`.
        With `normalize`, the values divided by their sum
        (`picked / picked.sum(-1, keepdims=True)`; kernels/argsort_slice.h says
        how it rounds). The values' gradient is that expression's; the
        indices have none.
        """
        ...


class HeadNormRope(Protocol):
    """A backend's queries and keys of an attention, normalized and rotated
    in one launch, where it has one."""

    def __call__(self, queries_in: mx.array, keys_in: mx.array, q_weight: mx.array,
                 k_weight: mx.array, offsets: mx.array, *, batch: int, q_heads: int,
                 k_heads: int, q_at: int, k_at: int, eps: float, base: float, scale: float,
                 stream: mx.Stream) -> tuple[mx.array, mx.array]:
        """Qwen3's attention's queries and keys from its projections' outputs:
        `rope(rms_norm(heads, weight, eps))` of each, transposed to `[batch,
        heads, length, head_dim]`, as `mx.fast.rms_norm` and `mx.fast.rope`
        (non-traditional, over the whole head, `base`, `scale`, the
        positions from `offsets`) compute them, within their rounding
        (kernels/head_norm_rope.h says how it rounds). For heads
        `head_norm_rope_computes` accepts. Differentiable with respect to
        the inputs and weights, through those ops.

        Args:
            queries_in (array): `[batch, length, q_row]`, the query heads one
                after another from column `q_at`.
            keys_in (array): `[batch, length, k_row]` of the same dtype, the
                key heads from `k_at`; may be `queries_in` itself.
            q_weight (array): `[head_dim]`, the queries' norm's weight.
            k_weight (array): `[head_dim]`, the keys'.
            offsets (array): int32 `[batch]` or `[1]`: the position of each
                sequence's first row (or of every sequence's).
            batch, q_heads, k_heads, q_at, k_at (int): As above.
            eps (float): The norms' epsilon.
            base (float): RoPE's base.
            scale (float): RoPE's position scale.
            stream (Stream): Where to run.

        Returns:
            tuple(array, array): queries `[batch, q_heads, length, head_dim]`
            and keys `[batch, k_heads, length, head_dim]`, in the inputs' dtype.
        """
        ...


class DecodeAttention(Protocol):
    """A backend's attention of a decoding step, where it has one."""

    def __call__(self, queries: mx.array, keys: mx.array, values: mx.array,
                 sinks: mx.array | None, *, scale: float, stream: mx.Stream,
                 mask: mx.array | None = None) -> mx.array:
        """Each sequence's one query a head attending to its keys, as
        `mx.fast.scaled_dot_product_attention(queries, keys, values,
        scale=scale, mask=mask, sinks=sinks)` computes it, within the
        rounding kernels/decode_attention.h states (the softmax's weights
        rounded to the inputs' 16-bit format before they multiply the
        values). The keys and values are read where they lie: a slice of a
        cache's longer buffer costs no copy. For shapes and dtypes
        `decode_attention_computes` accepts. Differentiable with respect to
        the queries, keys, values and sinks, through MLX's attention.

        Args:
            queries (array): `[batch, heads, 1, head_dim]`.
            keys (array): `[batch, kv_heads, keys, head_dim]`, of the queries'
                dtype, `keys >= 1`; each key-value head serves `heads //
                kv_heads` query heads in order.
            values (array): The keys' shape and dtype.
            sinks (array, optional): `[heads]` of the queries' dtype: a logit
                a head with no value (gpt-oss's), or None.
            scale (float): The scores' scale.
            stream (Stream): Where to run.
            mask (array, optional): bool `[batch or 1, heads or 1, 1, keys]`,
                false where a key is not attended (mlx-lm's batch cache's
                left padding), or None.

        Returns:
            array: `[batch, heads, 1, head_dim]` in the queries' dtype.
        """
        ...


class AddRmsNorm(Protocol):
    """A backend's residual add and the RMS norm after it in one launch,
    where it has one."""

    def __call__(self, residual: mx.array, update: mx.array, weight: mx.array, *, eps: float,
                 stream: mx.Stream) -> tuple[mx.array, mx.array]:
        """`sums = residual + update` and `mx.fast.rms_norm(sums, weight, eps)`,
        as a decoder layer computes them: the sums bit for bit, the norm
        within its rounding (kernels/add_rms_norm.h says how it rounds). For
        a dtype `add_rms_norm_computes` accepts. Differentiable with respect
        to the three arrays, through those ops.

        Args:
            residual (array): `[..., dims]`, the layer's residual stream.
            update (array): The same shape and dtype, what a block adds to it.
            weight (array): `[dims]` of the same dtype, the norm's weight.
            eps (float): The norm's epsilon.
            stream (Stream): Where to run.

        Returns:
            tuple(array, array): the sums and their norm, each of the
            inputs' shape and dtype.
        """
        ...


@runtime_checkable
class Backend(Protocol):
    """The three operations every implementation provides, and four it may.

    Arrays come in checked and sized by the public ops (`plan.py`,
    `gather.py`, `combine.py`); what comes back is lazy. The results are the
    same bits on every backend (docs/DESIGN.md).
    """

    plan_id_dtypes: tuple[mx.Dtype, ...]
    """The id dtypes `plan` reads as they are; `moe_plan` converts others to int32."""

    grouped_qmm: GroupedQmm | None
    """The grouped expert GEMM (kernels/grouped_qmm.h); None where the backend has none."""

    argsort_slice: ArgsortSlice | None
    """A row-wise argsort's slice (kernels/argsort_slice.h); None where the backend has none."""

    head_norm_rope: HeadNormRope | None
    """An attention's queries and keys normalized and rotated (kernels/head_norm_rope.h);
    None where the backend has none."""

    def grouped_qmm_computes(self, *, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
        """Whether `grouped_qmm` computes affine-quantized weights of `bits`
        and `group_size` on rows of `dtype`; False where there is none."""
        ...

    def grouped_qmm_fuses(self, *, num_experts: int, in_dims: int, out_dims: int,
                          capacity: int, bits: int, group_size: int) -> bool:
        """Whether `grouped_qmm` should compute a layer's gate and up projections
        (each `num_experts` experts of `out_dims` by `in_dims`, over a plan of
        `capacity` rows) in one call, its `up`, rather than each apart; False
        where there is none."""
        ...

    def argsort_slice_computes(self, *, row_size: int, dtype: mx.Dtype) -> bool:
        """Whether `argsort_slice` sorts rows of `row_size` values of `dtype`;
        False where there is none."""
        ...

    add_rms_norm: AddRmsNorm | None
    """A residual add and the RMS norm after it (kernels/add_rms_norm.h); None
    where the backend has none."""

    def head_norm_rope_computes(self, *, head_dim: int, dtype: mx.Dtype) -> bool:
        """Whether `head_norm_rope` takes heads of `head_dim` values of `dtype`;
        False where there is none."""
        ...

    decode_attention: DecodeAttention | None
    """A decoding step's attention (kernels/decode_attention.h); None where the
    backend has none."""

    def decode_attention_computes(self, *, head_dim: int, heads: int, kv_heads: int,
                                  dtype: mx.Dtype) -> bool:
        """Whether `decode_attention` takes `heads` query heads over `kv_heads`
        key-value heads of `head_dim` values of `dtype`; False where there is
        none."""
        ...

    def add_rms_norm_computes(self, *, dtype: mx.Dtype) -> bool:
        """Whether `add_rms_norm` takes rows of `dtype`; False where there is none."""
        ...

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
    raise TypeError(f"stream: expected a Stream, Device, DeviceType or None, "
                    f"got {type(stream).__name__}")


@functools.cache  # what MLX was built with does not change while it runs
def gpu_backend() -> str | None:
    """'metal', 'cuda' or None: which GPU backend this MLX was built with."""
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return None


def on_cuda(stream: mx.Stream | mx.Device | None = None) -> bool:
    """Whether `stream` (default: the default device's) runs on MLX's CUDA
    backend: a fact the measured rules take."""
    return resolve_stream(stream).device.type == mx.gpu and gpu_backend() == "cuda"


def grouped_kernel_computes(layer, backend: Backend, dtype: mx.Dtype) -> bool:
    """Whether `backend`'s grouped kernel computes the quantized matrices of
    `layer` (a quantized layer of MLX's or mlx-lm's: `scales`, `biases`,
    `bits`, `group_size`, `mode`) on rows of `dtype`: affine, with biases,
    its scales in the rows' dtype."""
    return (getattr(layer, "mode", "affine") == "affine"
            and getattr(layer, "global_scale", None) is None
            and layer.get("biases") is not None
            and layer["scales"].dtype == dtype
            and backend.grouped_qmm_computes(bits=layer.bits, group_size=layer.group_size,
                                             dtype=dtype))


def kernel_bias(layer, dtype: mx.Dtype) -> mx.array | None:
    """`layer`'s own bias where the grouped kernel adds it (`GroupedQmm`'s
    `bias`: in the rows' `dtype`, as the kernel reads it), else None (no
    bias, or one to add apart)."""
    bias = layer.get("bias")
    return bias if bias is not None and bias.dtype == dtype else None


def implementation(stream: mx.Stream) -> Backend:
    """The backend of `stream`'s device."""
    if stream.device.type is _CPU_DEVICE:
        return _cpu_module().CPU
    backend = gpu_backend()
    if backend is None:
        raise RuntimeError(
            "stream: a GPU stream was given but this MLX has neither Metal nor CUDA"
        )
    return _gpu_module().for_backend(backend)


_CPU_DEVICE = mx.DeviceType.cpu


# The backends' modules, imported at their first use, not with this one
# (`_cpu` needs the C++ extension, which a tree built for the GPU suite
# lacks), then looked up: every launch of every layer asks for its backend,
# and an import statement at each call cost the host more than the rest of
# the question.
@functools.cache
def _cpu_module() -> ModuleType:
    from . import _cpu

    return _cpu


@functools.cache
def _gpu_module() -> ModuleType:
    from . import _gpu

    return _gpu

