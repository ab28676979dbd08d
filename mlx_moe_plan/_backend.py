"""Backend dispatch: the stream's device picks the implementation.

Every implementation offers the same three functions: `plan` (its output
arrays, and a function `field(name, shape)` that views one of the plan's
fields in them), `gather_rows` and `combine_rows`, all lazy (see `_cpu.py`). The GPU ones
run the kernel texts in `kernels/` through `mx.fast.metal_kernel` or
`mx.fast.cuda_kernel`; the CPU ones are the C++ primitives in `src/`.
"""

from __future__ import annotations

import mlx.core as mx


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


def implementation(stream: mx.Stream):
    if stream.device.type == mx.DeviceType.cpu:
        from . import _cpu

        return _cpu
    backend = gpu_backend()
    if backend is None:
        raise RuntimeError(
            "stream: a GPU stream was given but this MLX has neither Metal nor CUDA"
        )
    from . import _gpu

    return _gpu.for_backend(backend)

