"""The measured rules: which formulation a computation takes on which backend.

Each rule is a pure function of sizes and backend facts, measured on the
backend it speaks for (benchmarks/RESULTS.md), and the same inputs answer
alike on every call.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from . import _backend

# A decoding batch's rows as one matrix, for a dense quantized projection
# (projections.py). MLX's CUDA quantized_matmul computes fewer than 8 rows as
# matrix-vector products, one matrix or many alike, and from 8 rows computes
# `[B, 1, D]` as B products of one row, each reading the whole weight matrix,
# where one matrix of B rows reads it once. Its tiles are 128 columns wide and
# a matrix of few tiles leaves most of the GPU idle, where B products of one
# row spread over it: below DENSE_ROWS_FROM_OUT_DIMS columns the B products
# were measured faster (a router of 128 experts), from there the one matrix.
DENSE_ROWS_FROM_ROWS = 8
DENSE_ROWS_FROM_OUT_DIMS = 256
_DENSE_ROWS_DTYPES = (mx.float16, mx.bfloat16)


@functools.cache
def _cuda_build() -> bool:
    return _backend.gpu_backend() == "cuda"


def _cuda_stream(stream: mx.Stream | mx.Device | None) -> bool:
    """Whether `stream` runs on MLX's CUDA backend."""
    return _backend.resolve_stream(stream).device.type == mx.gpu and _cuda_build()


def dense_as_rows(out_dims: int, in_dims: int, rows: int, bits: int, dtype: mx.Dtype,
                  mode: str = "affine", stream: mx.Stream | mx.Device | None = None) -> bool:
    """Whether a dense quantized projection takes a decoding batch as one matrix.

    The batch's rows `[rows, 1, in_dims]` as rows `[rows, in_dims]` of one
    GEMM, rather than `rows` GEMMs of one row. On MLX's CUDA backend, where
    measured faster: 16-bit rows, affine 4 or 8 bits, from
    `DENSE_ROWS_FROM_ROWS` rows and `DENSE_ROWS_FROM_OUT_DIMS` output columns
    (whole tiles of 128). Elsewhere (the CPU, Metal: not measured) never, so
    a patched model computes there what mlx-lm's does.

    Args:
        out_dims (int): Output columns N of the projection.
        in_dims (int): Input dimension D.
        rows (int): Rows of the batch (sequences decoding together).
        bits (int): Bits a weight.
        dtype (Dtype): The rows' dtype.
        mode (str): The quantization mode. Default: ``"affine"``.
        stream (Stream or Device, optional): Where it runs. Default: the
          default device's stream.

    Returns:
        bool: True for one matrix of rows.
    """
    if rows < DENSE_ROWS_FROM_ROWS or mode != "affine" or bits not in (4, 8) \
            or dtype not in _DENSE_ROWS_DTYPES:
        return False
    if out_dims < DENSE_ROWS_FROM_OUT_DIMS or out_dims % 128 or in_dims % 64:
        return False
    return _cuda_stream(stream)
