"""The measured rules: how the MoE layer computes, chosen from measurements.

Each rule is a pure function of sizes and of facts about the backend, whose
thresholds come from the runs recorded in benchmarks/RESULTS.md and
benchmarks/HISTORY.md; the layer (`nn.SwitchGLU`, `projections.py`) gathers
the facts and applies the choice. The rules here are the expert GEMMs' formulation
(`formulation_for`), and how a dense quantized projection computes a
decoding batch (`dense_decoding_expert`, else `dense_as_rows`, and
`dense_joins_siblings` for projections that share their input) and a
prefill (`dense_as_expert`), which fused blocks submit early
(`submits_block`), where a router's top k renormalizes its scores
(`top_k_normalizes`), where an attention's queries and keys are
normalized and rotated in one launch (`fuses_head_norm_rope`), where a
decoding step's attention runs in the package's launches
(`decodes_attention`), and where a decoder layer's residual adds and the
norms after them are one launch each (`fuses_add_rms_norm`).

A formulation is a `Formulation`. The layer's public `tile_m` names one as an
int (`MLX_LM`, `GROUPED`, 1 or a tile height), converted once, where it is
given (`Formulation.from_tile_m`); the plan's own `tile_m` is the padding
multiple of its rows (`Formulation.plan_tile_m`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

# The public names of the formulations that are not a tile height.
MLX_LM = 0
GROUPED = -1

# mlx-lm's SwitchGLU sorts its rows from this many routed entries
# (`do_sort = indices.size >= 64` in mlx-lm 0.32.2's switch_layers).
MLX_LM_SORTS_FROM_ENTRIES = 64
# On CUDA, tiles pay off once experts average this many rows; larger tiles
# once they average the second (benchmarks/HISTORY.md, "The rule").
TILED_FROM_ROWS_PER_EXPERT = 2
LARGE_TILES_FROM_ROWS_PER_EXPERT = 64
# On CUDA, the grouped kernel wins over mlx-lm's call and over tiles for a
# few rows an expert: from mlx-lm's sort threshold (below it, they tied)
# until experts average the second (benchmarks/HISTORY.md, "The grouped
# kernel in the rule").
GROUPED_FROM_ENTRIES = MLX_LM_SORTS_FROM_ENTRIES
GROUPED_BELOW_ROWS_PER_EXPERT = 16
# On CUDA, the grouped kernel wins again from this many rows an expert, in
# block tiles (kernels/grouped_qmm_tiles.h): faster than MLX's tiles of 64
# at every shape measured, from 128 rows an expert up (benchmarks/RESULTS.md,
# "The expert GEMM at prefill sizes"); between 16 and this, MLX's tiles stay
# until measured.
GROUPED_TILES_FROM_ROWS_PER_EXPERT = LARGE_TILES_FROM_ROWS_PER_EXPERT
# MLX's CUDA gather_qmm computes mlx-lm's unsorted call (one row a matrix)
# from 8 entries by tensor cores only where a projection's output columns
# are a multiple of `MLX_TENSOR_CORE_COLUMNS`, and elsewhere (gpt-oss's
# 2880) by a naive kernel, a tile of at least 16 rows for each row: there
# the grouped kernel won from 16 entries (gpt-oss-20b decoding 4 and 8
# sequences; at 2, 8 entries, MLX's call was still the faster, and below 8
# it computes matrix-vector products: benchmarks/RESULTS.md, "Whole models
# on one GPU").
MLX_TENSOR_CORE_COLUMNS = 128
GROUPED_OFF_TENSOR_CORES_FROM_ENTRIES = 16


@dataclass(frozen=True)
class Formulation:
    """How the layer computes its expert GEMMs.

    One of: mlx-lm's own call (no plan), sorted single rows through MLX's
    `gather_mm` / `gather_qmm`, tiles of `plan_tile_m` rows of one expert
    each, or sorted single rows through this package's grouped kernel.
    Compare with `is`: each is made once (`MLX_LM_CALL`, `SORTED_ROWS`,
    `GROUPED_ROWS`, `tiles`).
    """

    kind: str
    """"mlx_lm", "sorted_rows", "tiles" or "grouped"."""
    plan_tile_m: int
    """The plan's padding multiple (its `tile_m`); 0 for mlx-lm's call, which plans nothing."""

    @property
    def tile_m(self) -> int:
        """The layer's public int for this formulation."""
        return GROUPED if self.kind == "grouped" else self.plan_tile_m

    # Each formulation is one object, copies and pickles included.
    def __copy__(self) -> Formulation:
        return self

    def __deepcopy__(self, memo) -> Formulation:
        return self

    def __reduce__(self):
        return Formulation.from_tile_m, (self.tile_m,)

    @staticmethod
    def from_tile_m(tile_m: int | None) -> Formulation | None:
        """The formulation the layer's public `tile_m` names; None stays None (the rule).

        Raises:
            TypeError: `tile_m` is not an int.
            ValueError: `tile_m` is below `GROUPED`.
        """
        if tile_m is None:
            return None
        if isinstance(tile_m, bool) or not isinstance(tile_m, int):
            raise TypeError(f"tile_m: expected an int or None, got {type(tile_m).__name__}")
        if tile_m < GROUPED:
            raise ValueError(f"tile_m: must be MLX_LM (0), GROUPED (-1), 1 (sorted rows) or a "
                             f"tile height above 1, got {tile_m}")
        if tile_m == MLX_LM:
            return MLX_LM_CALL
        if tile_m == GROUPED:
            return GROUPED_ROWS
        return SORTED_ROWS if tile_m == 1 else tiles(tile_m)


MLX_LM_CALL = Formulation("mlx_lm", 0)
SORTED_ROWS = Formulation("sorted_rows", 1)
GROUPED_ROWS = Formulation("grouped", 1)


@functools.cache
def tiles(height: int) -> Formulation:
    """Tiles of `height` rows (above 1), one expert a tile."""
    return Formulation("tiles", height)


_SMALL_TILES, _LARGE_TILES = tiles(16), tiles(64)


def formulation_for(num_entries: int, num_experts: int, *, cuda: bool,
                    grouped: bool, out_dims: Sequence[int] = ()) -> Formulation:
    """The expert GEMMs' formulation the measurements favour.

    On CUDA, for a layer the grouped kernel can compute, the grouped kernel
    from `GROUPED_FROM_ENTRIES` routed entries
    (`GROUPED_OFF_TENSOR_CORES_FROM_ENTRIES` where a projection's output
    columns are not a multiple of `MLX_TENSOR_CORE_COLUMNS`) until experts average
    `GROUPED_BELOW_ROWS_PER_EXPERT`, and again from
    `GROUPED_TILES_FROM_ROWS_PER_EXPERT` (its block tiles); otherwise there,
    tiles once experts average `TILED_FROM_ROWS_PER_EXPERT` (16 rows, 64 from
    `LARGE_TILES_FROM_ROWS_PER_EXPERT`), mlx-lm's call below, whose host time
    is the least. Elsewhere (the CPU, whose `gather_qmm` pays for every
    padding row of a tile, and Metal, not yet measured) mlx-lm's call below
    `MLX_LM_SORTS_FROM_ENTRIES`, where mlx-lm does not sort, and sorted
    single rows from there.

    Args:
        num_entries (int): Routed entries, `T * K`.
        num_experts (int): Number of experts E.
        cuda (bool): Whether the layer runs on MLX's CUDA backend.
        grouped (bool): Whether the grouped kernel can compute the layer there.
        out_dims (Sequence[int]): Output columns of the layer's projections
          (the hidden dimension, the model's). Default: none, taken as
          multiples of `MLX_TENSOR_CORE_COLUMNS`.

    Returns:
        Formulation: `MLX_LM_CALL`, `GROUPED_ROWS`, `SORTED_ROWS`, `tiles(16)`
        or `tiles(64)`.
    """
    if cuda:
        from_entries = GROUPED_FROM_ENTRIES
        if any(dims % MLX_TENSOR_CORE_COLUMNS for dims in out_dims):
            from_entries = GROUPED_OFF_TENSOR_CORES_FROM_ENTRIES
        if grouped and (from_entries <= num_entries
                        < GROUPED_BELOW_ROWS_PER_EXPERT * num_experts
                        or num_entries >= GROUPED_TILES_FROM_ROWS_PER_EXPERT * num_experts):
            return GROUPED_ROWS
        if num_entries < TILED_FROM_ROWS_PER_EXPERT * num_experts:
            return MLX_LM_CALL
        return _LARGE_TILES if num_entries >= LARGE_TILES_FROM_ROWS_PER_EXPERT * num_experts \
            else _SMALL_TILES
    return MLX_LM_CALL if num_entries < MLX_LM_SORTS_FROM_ENTRIES else SORTED_ROWS


# A decoding batch's rows as one matrix for a dense quantized projection
# (projections.py). MLX's CUDA quantized_matmul computes fewer than 8 rows as
# matrix-vector products, one matrix or many alike, and from 8 rows computes
# `[B, 1, D]` as B products of one row, each reading the whole weight matrix,
# where one matrix `[B, D]` reads it once. But one matrix spreads over the
# GPU by its tiles of output columns only, where the B products spread B
# times as wide: a narrow projection (attention's keys and values, a router)
# ran no faster as one matrix from 8 rows, and slower at the largest batches;
# a wide one (queries, the attention's output, the lm_head) faster as one
# matrix once the batch's outputs fill the GPU (benchmarks/RESULTS.md,
# "Dense projections of a decoding batch"). The same bounds held at 8 bits and
# in float16 as in 4-bit bfloat16, where this rule was first measured (the
# same section, "8 bits and float16"), so it takes both widths.
DENSE_ROWS_FROM_ROWS = 8
DENSE_ROWS_FROM_OUT_DIMS = 2048
DENSE_ROWS_FROM_OUTPUTS = 32768
DENSE_ROWS_BITS = (4, 8)


def _dense_measured(in_dims: int, bits: int, dtype_bits: int, mode: str, cuda: bool,
                    measured_bits: tuple[int, ...] = (4,)) -> bool:
    """The dense projections the dense rules were measured on: on CUDA,
    16-bit rows against affine weights of `measured_bits` bits, inputs in
    whole groups of 64."""
    return (cuda and mode == "affine" and bits in measured_bits and dtype_bits == 16
            and in_dims % 64 == 0)


def dense_as_rows(out_dims: int, in_dims: int, rows: int, bits: int, dtype_bits: int,
                  mode: str, *, cuda: bool) -> bool:
    """Whether a dense quantized projection takes a decoding batch as one matrix.

    The batch's rows `[rows, 1, in_dims]` as rows `[rows, in_dims]` of one
    GEMM, rather than `rows` GEMMs of one row. On CUDA, as measured: 16-bit
    rows, affine 4 or 8 bits (`DENSE_ROWS_BITS`), projections of
    `DENSE_ROWS_FROM_OUT_DIMS` output columns and more, from
    `DENSE_ROWS_FROM_ROWS` rows and `DENSE_ROWS_FROM_OUTPUTS` outputs (rows
    times columns). Elsewhere (other widths and modes; the CPU and Metal)
    never until measured, so a patched model computes there what mlx-lm's
    does.

    Args:
        out_dims (int): Output columns N of the projection.
        in_dims (int): Input dimension D.
        rows (int): Rows of the batch (sequences decoding together).
        bits (int): Bits a weight.
        dtype_bits (int): Bits of an element of the rows (16 for float16
          and bfloat16).
        mode (str): The quantization mode (`"affine"`, ...).
        cuda (bool): Whether the projection runs on MLX's CUDA backend.

    Returns:
        bool: True for one matrix of rows.
    """
    return (_dense_measured(in_dims, bits, dtype_bits, mode, cuda, DENSE_ROWS_BITS)
            and rows >= DENSE_ROWS_FROM_ROWS and out_dims >= DENSE_ROWS_FROM_OUT_DIMS
            and rows * out_dims >= DENSE_ROWS_FROM_OUTPUTS)


# Projections that a module calls on one input one after another (attention's
# queries, keys and values; a dense MLP's gate and up) as one GEMM of their
# stacked matrices, a decoding step's: MLX's CUDA quantized_matmul spreads a
# narrow projection (keys and values of 512 columns) over few tiles of
# columns, so it took about as long as the queries' 4096, and each launch is
# a graph node the host builds. The parts are views of one output, which the
# norms and rotary embedding after them copy where they need whole rows: one
# row (matrix-vector products, short either way) measured slower, and
# gpt-oss-20b's inputs of 2880 values (the grouped kernel's from 8 rows) no
# faster at 4, 8 and 32 rows (benchmarks/RESULTS.md, "Whole models on
# one GPU").
SIBLINGS_FROM_ROWS = 8
SIBLINGS_BELOW_IN_DIMS = 2880


def dense_joins_siblings(in_dims: int, rows: int, bits: int, dtype_bits: int, mode: str, *,
                         cuda: bool) -> bool:
    """Whether dense quantized projections called on the same decoding batch
    `[rows, 1, in_dims]` compute it as one GEMM of their stacked matrices.

    On CUDA, as measured (16-bit rows, affine 4 bits): from
    `SIBLINGS_FROM_ROWS` rows, inputs below `SIBLINGS_BELOW_IN_DIMS` values.
    Elsewhere never until measured.

    Args:
        in_dims (int): Input dimension D.
        rows (int): Rows of the batch (sequences decoding together).
        bits (int): Bits a weight.
        dtype_bits (int): Bits of an element of the rows.
        mode (str): The quantization mode (`"affine"`, ...).
        cuda (bool): Whether the projections run on MLX's CUDA backend.

    Returns:
        bool: True for one GEMM.
    """
    return (_dense_measured(in_dims, bits, dtype_bits, mode, cuda)
            and rows >= SIBLINGS_FROM_ROWS and in_dims < SIBLINGS_BELOW_IN_DIMS)


# A decoding batch's rows of a dense projection through the grouped kernel as
# one expert (kernels/grouped_qmm.h, its warps sharing each row where the
# columns are few: launch.grouped_qmm_k_splits; its block tiles from 32 rows).
# Its call costs tens of microseconds at any size, so it pays where MLX's CUDA
# quantized_matmul is slow: below 8 rows its matrix-vector products read a
# wide projection (an lm_head) once a row; from 8 rows its GEMM runs each tile
# of 128 columns through the whole input, a long chain where the input is
# long; from 64 rows the block tiles pass it on wide projections too
# (benchmarks/RESULTS.md, "Dense projections of a decoding batch"). At one
# row both read the head once: the kernel's own call was faster, but whole
# steps were not, so a single row keeps MLX's (RESULTS, "Batch 1 to 4").
DENSE_DECODING_WIDE_OUT_DIMS = 100_000
DENSE_DECODING_WIDE_LEAST_ROWS = 2
DENSE_DECODING_WIDE_BELOW_ROWS = 8
DENSE_DECODING_WIDE_FROM_ROWS = 64
DENSE_DECODING_FROM_ROWS = 8
DENSE_DECODING_FROM_IN_DIMS = 2880
DENSE_DECODING_TILES_FROM_ROWS = 32
DENSE_DECODING_TILES_FROM_IN_DIMS = 4096


def dense_decoding_expert(out_dims: int, in_dims: int, rows: int, bits: int, dtype_bits: int,
                          mode: str, *, cuda: bool) -> bool:
    """Whether a dense quantized projection computes a decoding batch's rows
    `[rows, 1, in_dims]` through the grouped kernel as one expert.

    On CUDA, as measured (16-bit rows, affine 4 bits): a projection of
    `DENSE_DECODING_WIDE_OUT_DIMS` columns and more from
    `DENSE_DECODING_WIDE_LEAST_ROWS` rows below `DENSE_DECODING_WIDE_BELOW_ROWS`
    and from `DENSE_DECODING_WIDE_FROM_ROWS`;
    any other from `DENSE_DECODING_FROM_ROWS` rows where its input has
    `DENSE_DECODING_FROM_IN_DIMS` values and more, and from
    `DENSE_DECODING_TILES_FROM_ROWS` rows (the block tiles) where it has
    `DENSE_DECODING_TILES_FROM_IN_DIMS`. Elsewhere never until measured.

    Args:
        out_dims (int): Output columns N of the projection.
        in_dims (int): Input dimension D.
        rows (int): Rows of the batch (sequences decoding together).
        bits (int): Bits a weight.
        dtype_bits (int): Bits of an element of the rows.
        mode (str): The quantization mode (`"affine"`, ...).
        cuda (bool): Whether the projection runs on MLX's CUDA backend.

    Returns:
        bool: True for the grouped kernel.
    """
    if not _dense_measured(in_dims, bits, dtype_bits, mode, cuda) or rows < 1:
        return False
    if out_dims >= DENSE_DECODING_WIDE_OUT_DIMS:
        return (DENSE_DECODING_WIDE_LEAST_ROWS <= rows < DENSE_DECODING_WIDE_BELOW_ROWS
                or rows >= DENSE_DECODING_WIDE_FROM_ROWS)
    if rows < DENSE_DECODING_FROM_ROWS:
        return False
    if rows < DENSE_DECODING_TILES_FROM_ROWS:
        return in_dims >= DENSE_DECODING_FROM_IN_DIMS
    return in_dims >= DENSE_DECODING_TILES_FROM_IN_DIMS


# patch_model(dense=True): a prefill's rows of a dense projection through the
# grouped kernel's block tiles as one expert. Their blocks of 64 rows by 128
# columns fill the GPU from few rows only for wide projections (the lm_heads'
# vocabularies): narrower ones pay only from thousands of rows.
DENSE_EXPERT_FROM_ROWS = 512
DENSE_EXPERT_FROM_OUT_DIMS = 100_000


def dense_as_expert(out_dims: int, in_dims: int, rows: int, bits: int, dtype_bits: int,
                    mode: str, *, cuda: bool) -> bool:
    """Whether a dense quantized projection computes a prefill's rows through
    the grouped kernel as one expert (`patch_model(dense=True)`).

    On CUDA, as measured: 16-bit rows, affine 4 bits, from
    `DENSE_EXPERT_FROM_ROWS` rows, projections of `DENSE_EXPERT_FROM_OUT_DIMS`
    output columns and more. Elsewhere never until measured.

    Args:
        out_dims (int): Output columns N of the projection.
        in_dims (int): Input dimension D.
        rows (int): Rows of the input (a prefill's tokens).
        bits (int): Bits a weight.
        dtype_bits (int): Bits of an element of the rows.
        mode (str): The quantization mode (`"affine"`, ...).
        cuda (bool): Whether the projection runs on MLX's CUDA backend.

    Returns:
        bool: True for the grouped kernel.
    """
    return (_dense_measured(in_dims, bits, dtype_bits, mode, cuda)
            and rows >= DENSE_EXPERT_FROM_ROWS and out_dims >= DENSE_EXPERT_FROM_OUT_DIMS)


def dense_from_rows(out_dims: int) -> int:
    """The fewest rows of an input, a decoding batch's or a prefill's, that
    any of the dense rules (`dense_as_rows`, `dense_joins_siblings`,
    `dense_decoding_expert`, `dense_as_expert`) may take for a dense
    projection of `out_dims` output columns: below it every one keeps MLX's
    call, whatever the other sizes, widths and backend.

    A model's projections are called several times a layer at every step,
    and asking the rules, even with a cached route, cost a step's host more
    than it gained where none took the rows (benchmarks/RESULTS.md, "Whole
    models on one GPU"): an input of fewer rows does not ask.

    Args:
        out_dims (int): Output columns N of the projection.

    Returns:
        int: Rows; 1 where a rule may take a single row.
    """
    floor = min(DENSE_ROWS_FROM_ROWS, SIBLINGS_FROM_ROWS, DENSE_DECODING_FROM_ROWS,
                DENSE_EXPERT_FROM_ROWS)
    if out_dims >= DENSE_DECODING_WIDE_OUT_DIMS:
        return min(floor, DENSE_DECODING_WIDE_LEAST_ROWS)
    return floor


# A Qwen3 attention's queries and keys, normalized and rotated in one launch
# of kernels/head_norm_rope.h (`fused_attention`), a decoding step's: mlx-lm
# makes them with four launches (each one's norm and rotary embedding), six
# where the projections are one GEMM's parts, whose rows the norms copy
# first. At batch 8 a step's length follows its launches more than their GPU
# time (benchmarks/HISTORY.md, "The whole step at batch 8"). But each launch
# of the package's costs the host more than one of MLX's ops (its glue), so it
# pays only where it replaces several. It does not: timed alone in a whole
# step, its step built 2.8 to 5.5 ms more slowly and ran 0.86x to 0.90x at
# batch 4 and 8, slower at 1 (benchmarks/HISTORY.md, "The fused attention's
# launch alone in a step"). Bound once a size since, as the decoding
# attention's, it and the residual norms' launch beside the decoding
# attention's still built those steps more slowly than that launch alone, at
# 4 and 8 sequences ("The decoding attention's kernels alone under Nsight
# Compute"). Without the custom function that carried its gradient (which a
# step outside every transform no longer makes), it lost every round at 4
# sequences; at 8 a second machine gave back the gain a first had shown, and
# there it lost at 64 and ran level at 16 ("Both models decoding, three
# processes, and the norms' launches without the custom functions"). Off
# (`HEAD_NORM_ROPE_FROM_ROWS` out of reach); `benchmarks.step_kernels
# --interleave --variants "fused:HEAD_NORM_ROPE_FROM_ROWS=1"` times it again.
HEAD_NORM_ROPE_FROM_ROWS = 1 << 30


def fuses_head_norm_rope(rows: int, *, cuda: bool) -> bool:
    """Whether a Qwen3 attention's queries and keys of a decoding step are
    normalized and rotated in one launch.

    On CUDA, from `HEAD_NORM_ROPE_FROM_ROWS` rows (measured slower: never).
    Elsewhere never until measured.

    Args:
        rows (int): Rows of the step (sequences decoding together).
        cuda (bool): Whether the attention runs on MLX's CUDA backend.

    Returns:
        bool: True for the one launch.
    """
    return cuda and rows >= HEAD_NORM_ROPE_FROM_ROWS


# A decoding step's attention in the package's own launches
# (kernels/decode_attention.h, `fused_attention`): one group a sequence,
# key-value head and split of the keys, the query heads that share the
# key-value head as the rows of the tensor cores' multiply-adds, so each key
# and value is read once; then the splits merged. MLX's CUDA backend hands a
# decoding query to cuDNN (or, where the cache's length is not a multiple of
# 256, to a vector kernel that reads the keys once a query head). The same
# scheme as CUDA text of the benchmark's own (benchmarks.decode_attention's
# sketch), timed in whole steps, shortened them from 4 sequences and
# lengthened them at 2, where its launches' host work outweighs their GPU
# time (benchmarks/HISTORY.md, "A decoding attention of the package's own in
# whole steps"). The package's launches take less GPU time than the
# sketch's; their glue (the checks, and then the custom function that carried
# their gradient, which a step outside every transform no longer makes: not
# timed since) gave back part of the gain to the host. Timed with each side's
# steps interleaved one by one (whole turns spread too much on these hosts to
# tell the sides apart), they shortened the patch's steps from 8 sequences
# and ran within the spread at 4: from 8. With a mask (mlx-lm's batch cache,
# as batch generation and the server decode) they lost at 8 sequences and
# won at 32: from 32 (benchmarks/HISTORY.md, "The decoding attention's
# launches in interleaved steps"). The two are independent: a masked step
# asks only the masked rows. Elsewhere than CUDA not measured: never.
# `benchmarks.step_kernels --interleave --variants
# "off:DECODE_ATTENTION_FROM_ROWS=1000000"` times them against the patch
# without them (`tests/gpu_suite.sh R decode-attention`).
DECODE_ATTENTION_FROM_ROWS = 8
DECODE_ATTENTION_MASKED_FROM_ROWS = 32


def decodes_attention(rows: int, *, cuda: bool, masked: bool = False) -> bool:
    """Whether a decoding step's attention runs in the package's launches.

    On CUDA, from `DECODE_ATTENTION_FROM_ROWS` sequences, or with a mask
    from `DECODE_ATTENTION_MASKED_FROM_ROWS`. Elsewhere never until measured.

    Args:
        rows (int): Rows of the step (sequences decoding together).
        cuda (bool): Whether the attention runs on MLX's CUDA backend.
        masked (bool): Whether the step has a mask (mlx-lm's batch cache's).

    Returns:
        bool: True for the package's launches.
    """
    return cuda and rows >= (DECODE_ATTENTION_MASKED_FROM_ROWS if masked
                             else DECODE_ATTENTION_FROM_ROWS)


# A decoder layer's residual adds and the RMS norms after them, each pair in
# one launch of kernels/add_rms_norm.h (`fused_model`), a decoding step's:
# mlx-lm makes each with two (an add, `mx.fast.rms_norm`), four a layer; the
# one launch makes two, 96 launches fewer a step of Qwen3-30B-A3B's 48
# layers. Off (`ADD_RMS_NORM_FROM_ROWS` out of reach): its glue builds more
# slowly than the add and the norm it replaces, and with the fused attention
# a step at batch 8 lost 1.22x (benchmarks/HISTORY.md, "The fused attention's
# and residual norms' launches in a step"; bound once a size since, it still
# built slower, with the fused attention's launch, in "The decoding
# attention's kernels alone under Nsight Compute"; without its custom
# function, it lost at 4, 8 and 32 sequences in "Both models decoding, three
# processes, and the norms' launches without the custom functions").
ADD_RMS_NORM_FROM_ROWS = 1 << 30


def fuses_add_rms_norm(rows: int, *, cuda: bool) -> bool:
    """Whether a decoding step's residual adds and the RMS norms after them
    are one launch each.

    On CUDA, from `ADD_RMS_NORM_FROM_ROWS` rows (measured slower: never).
    Elsewhere never until measured.

    Args:
        rows (int): Rows of the step (sequences decoding together).
        cuda (bool): Whether the model runs on MLX's CUDA backend.

    Returns:
        bool: True for the one launch.
    """
    return cuda and rows >= ADD_RMS_NORM_FROM_ROWS


# A router that renormalizes its top k (Qwen3-MoE's and Qwen3-Next's blocks,
# `routing.top_k_scores(normalize=True)`) divides the picked scores by their
# sum inside the top k's launch, instead of by MLX's sum and divide after it,
# where this is True: two launches fewer a layer, and at batch 8 a decoding
# step's length follows its launches more than their GPU time
# (benchmarks/RESULTS.md, "A decoding step's kernels"). The whole
# Qwen3-30B-A3B decoded with it never slower beyond the runs' spread, and
# faster at batch 1, 4, 32 and 64 (benchmarks/RESULTS.md, "Whole models on
# one GPU"). Its quotients round the sum once, where MLX's CUDA sum of
# 16-bit scores rounds each addition (kernels/argsort_slice.h).
TOP_K_NORMALIZES_IN_LAUNCH = True


def top_k_normalizes(*, cuda: bool) -> bool:
    """Whether the router's top k renormalizes its scores in its own launch.

    On CUDA, where `TOP_K_NORMALIZES_IN_LAUNCH` (measured: True).
    Elsewhere never until measured.

    Args:
        cuda (bool): Whether the top k runs on MLX's CUDA backend.

    Returns:
        bool: True for the launch's division, False for MLX's ops after it.
    """
    return cuda and bool(TOP_K_NORMALIZES_IN_LAUNCH)


# A decoding step's fused MoE blocks hand their output to MLX's evaluation
# as they are built (`mx.async_eval`): on CUDA, from `SUBMIT_BLOCKS_FROM_TOKENS`
# tokens, the blocks at positions `SUBMIT_EVERY_BLOCKS` - 1, 2 *
# `SUBMIT_EVERY_BLOCKS` - 1, ... of the model's layers. Without it a step's
# GPU waits for the host to build the whole step and to encode its first CUDA
# graph (up to 100 of MLX's operations) before its first kernel runs: the
# build, about a fifth of a 48-layer step, is serial. Submitted every 16
# layers, the GPU computes the layers built so far while the host builds the
# rest. In the run that chose it, at batch 8 and 32 every 16 layers beat
# every 8, every 4 and every layer, and every layer (48 submissions a step)
# was slower than none; batch 1 was not faster (benchmarks/HISTORY.md,
# "Where the step's GPU waits, and a step's blocks submitted as they are
# built"). A later run, on a noisier host, found every 16, every 8 and none
# alike in their fastest turns at batch 8, and every 16 the best at 32 and 64
# (HISTORY, "The whole step at batch 8").
SUBMIT_BLOCKS_FROM_TOKENS = 8
SUBMIT_EVERY_BLOCKS = 16


# A prompt's chunk is built the same way, in Python, before any of it runs:
# in a patched prefill of 8192 tokens (chunks of 2048) the GPU waited about a
# quarter of the prefill for the chunks' graphs (on a host that built each
# layer's in about half a millisecond, a third of what the GPU then took for
# it). So a chunk's blocks at positions `SUBMIT_PROMPT_EVERY_BLOCKS` - 1,
# 2 * `SUBMIT_PROMPT_EVERY_BLOCKS` - 1, ... hand their output over as they are
# built too, from `SUBMIT_PROMPT_FROM_ROWS` rows: the first layers' GPU work
# starts after a few layers' building, and the rest is built while the GPU
# computes. A prompt's layer takes the GPU far longer than a decoding step's,
# so the CUDA graph each submission ends costs relatively less, and blocks
# submit more often than a step's: in the run that chose it (Qwen3-30B-A3B,
# 8192 tokens), every 4 blocks beat every 8 and every 16, and all three beat
# none by 1.2x to 1.3x (benchmarks/HISTORY.md, "A prompt's blocks submitted
# as they are built"). Chunks of 1024 to 2047 rows were not measured apart.
SUBMIT_PROMPT_FROM_ROWS = 1024
SUBMIT_PROMPT_EVERY_BLOCKS = 4


def submits_block(rows: int, position: int, *, cuda: bool, prompt: bool = False) -> bool:
    """Whether a fused MoE block submits its output of a decoding step, or
    of a prompt's chunk, for evaluation as soon as it is built
    (`_compiled.submit_as_built`).

    On CUDA, as measured: a decoding step's from `SUBMIT_BLOCKS_FROM_TOKENS`
    rows, the blocks at positions `SUBMIT_EVERY_BLOCKS` - 1,
    2 * `SUBMIT_EVERY_BLOCKS` - 1, ...; a prompt chunk's from
    `SUBMIT_PROMPT_FROM_ROWS` rows, every `SUBMIT_PROMPT_EVERY_BLOCKS`-th
    block alike. Elsewhere never until measured.

    Args:
        rows (int): Rows of the call: a step's tokens (sequences decoding
          together), or a chunk's (every sequence's).
        position (int): The block's position among the model's fused
          blocks, in layer order, 0 first.
        cuda (bool): Whether the block runs on MLX's CUDA backend.
        prompt (bool): Whether the rows are a prompt's chunk. Default:
          ``False``.

    Returns:
        bool: True to submit.
    """
    from_rows, every = ((SUBMIT_PROMPT_FROM_ROWS, SUBMIT_PROMPT_EVERY_BLOCKS) if prompt
                        else (SUBMIT_BLOCKS_FROM_TOKENS, SUBMIT_EVERY_BLOCKS))
    return cuda and rows >= from_rows and (position + 1) % every == 0
