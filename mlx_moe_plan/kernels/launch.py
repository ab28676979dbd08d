"""How each kernel body is run, as plain Python values: its arguments
(INPUTS_OUTPUTS), the names of its run-time sizes (PARAMS), and for given
sizes its `Launch`: grid, group size, sizes, template constants and outputs.

One source for every instantiation: `_gpu.py` launches these through MLX on
Metal and CUDA, and the tests launch the same through OpenCL on PoCL. Dtypes
are named ("float32", "float16", "bfloat16", "int32", "uint16", "uint32").
"""

from __future__ import annotations

import math
import struct
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from .._sizes import MAX_EXPERTS, PLAN_FIELDS, WEIGHT_FIELD, capacity_for, field_sizes

# Entries per plan block, which a group ranks and places at once (plan.h says
# why 512). MAX_EXPERTS must be a multiple of it.
PLAN_BLOCK = 512
# Plan groups at most: past PLAN_MAX_GROUPS blocks, each group places several
# blocks in turn, so the plan's reads (every group reads every id) grow
# linearly in N, not as N * N / PLAN_BLOCK (plan.h). 64 was the fastest cap
# measured at 163,840 entries (`bash tests/gpu_suite.sh results plan-groups`;
# the figures: benchmarks/RESULTS.md, "The ops on the H200", and every cap in
# benchmarks/HISTORY.md); below 64 blocks the cap changes nothing. Other caps are
# asked for with `plan_max_groups` (the benchmark's --plan-max-groups measures them).
PLAN_MAX_GROUPS = 64
# The cap of the innermost `plan_max_groups` block; None outside any.
_plan_max_groups: ContextVar[int | None] = ContextVar("plan_max_groups", default=None)

# Groups loop over rows beyond this many, keeping every grid within limits.
MAX_GROUPS = 1 << 16
# Row kernels stay at or under 512 threads a group: heavy register use can
# lower a Metal pipeline's thread limit below 1024.
MAX_ROW_GROUP = 512
# Threads an SM runs at once at most (compute capability 8.0 and 9.0; fewer
# on others): a launch bound past it, ptxas ignores.
MAX_SM_THREADS = 2048
REGISTER_FILE = 65536  # an SM's 32-bit registers (CUDA)
# SMs of the GPUs the bounds in groups an SM were timed on (an H100's or
# H200's): a GPU of other SMs takes the same groups, not timed there.
TIMED_GPU_SMS = 132
GATHER_ROWS = 4  # rows a gather group copies at a time

# The affine quantizations grouped_qmm.h reads: bits whose values a uint32
# word holds whole, and the quantization groups MLX makes; and its rows'
# dtypes, those of a 16-bit matrix multiply-add.
GROUPED_QMM_BITS = (4, 8)
GROUPED_QMM_QUANT_GROUPS = (32, 64, 128)
GROUPED_QMM_DTYPES = ("float16", "bfloat16")

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
ROW_KINDS = ("float32", "float16", "bfloat16")  # the bodies' IN_KIND codes


# Both grouped GEMM bodies take the same arguments.
_GROUPED_QMM_ARGUMENTS = (("rows", "row_tokens", "weight", "scales", "biases", "up_weight",
                           "up_scales", "up_biases", "bias", "up_bias", "expert_offsets",
                           "params"), ("out",))

# Each body's arguments, as `_gpu.py` and the OpenCL harness pass them: its
# input arrays, the last always `params`, then its outputs.
INPUTS_OUTPUTS = {
    "plan": (("ids", "weights", "params"), ("plan_data", "row_weights")),
    "gather": (("src", "index", "params"), ("out",)),
    "combine": (("src", "index", "weights", "params"), ("out",)),
    "grouped_qmm": _GROUPED_QMM_ARGUMENTS,
    "grouped_qmm_tiles": _GROUPED_QMM_ARGUMENTS,  # grouped_qmm.h's GEMM in block tiles
    "grouped_qmm_roles": _GROUPED_QMM_ARGUMENTS,  # the same, its making warpgroup apart
    "argsort_slice": (("values", "params"), ("indices", "slice_values")),
    "head_norm_rope": (("queries_in", "keys_in", "q_weight", "k_weight", "offsets", "params"),
                       ("queries", "keys")),
    "decode_attention": (("queries", "keys", "values", "mask", "params"),
                         ("part_out", "part_max", "part_sum")),
    "decode_attention_merge": (("part_out", "part_max", "part_sum", "sinks", "params"),
                               ("out",)),
    "add_rms_norm": (("residual", "update", "norm_weight", "params"), ("sums", "normed")),
}

# Bodies that read their inputs where they lie, through the shapes and
# strides MLX hands with them (`keys_shape`, `keys_strides`): a decoding
# step's keys and values are a slice of a cache's longer buffer, which a
# row-contiguous copy would read and write once more.
STRIDED_BODIES = frozenset({"decode_attention"})


# Each body's run-time sizes, the int32 values of its `params` array, by name.
# A body reads them by position at its top, each into a constant of the same
# name (`const int hidden = params[1];`), in this order: tests/test_structure.py
# checks those lines against these fields.
class PlanParams(NamedTuple):
    num_entries: int
    num_experts: int
    tile_m: int
    top_k: int
    capacity: int
    max_tiles: int
    blocks_per_group: int  # the chunk of blocks each group places


class GatherParams(NamedTuple):
    num_src: int
    hidden: int
    num_rows: int
    row_vectors: int  # 16-byte units in a row, 0 off the vector path


class CombineParams(NamedTuple):
    num_src: int
    hidden: int
    num_out: int
    row_vectors: int  # 16-byte units in a row, 0 off the vector path


@dataclass(frozen=True)
class GroupedQmmTiling:
    """How grouped_qmm.h splits its work: the kernel's template constants of
    that name, and the grid's cap. Any tiling gives the same sums up to float
    rounding; `grouped_qmm_tiling` runs another one (the benchmark compares them)."""

    threads: int = 128  # a group's threads, a multiple of the warp's 32: THREADS
    # sets of the group's warps, each set the block's columns and a share of
    # a row (K_SPLITS, dividing threads / 32); None: by the launch's items
    # (grouped_qmm_k_splits)
    k_splits: int | None = None
    tiles: int = 2  # 16-column tiles a warp: TILES
    gated_tiles: int = 2  # gated (gate and up in one warp): each projection's, TILES twice it
    row_tiles: int = 1  # 8-row tiles a pass: ROW_TILES
    # quantization groups a lane loads before using any: STEPS; None: by the
    # row's length and the fusion (grouped_qmm_loads)
    steps: int | None = None
    max_groups: int = 512  # groups at most, sharing the items
    # a lane's words of a column, and its steps' scales, in one load each
    # where the matrices allow it (1), or one load a word and a value (0): WIDE_LOADS
    wide_loads: int = 1
    # a pass's loads are the next pass's, issued before its multiply-adds (1),
    # or its own, waited for first (0): LOADS_AHEAD; None: by the row, as
    # steps, where steps is None too (else 0)
    loads_ahead: int | None = None
    # a warp's words through a ring of this many stages of its own in shared
    # memory, copied in runs of each column (WORD_STAGES; 0: each lane loads
    # its own, as the fragment holds them); with it, rows are not split
    # (k_splits 1), rows and scales load a pass ahead only where loads_ahead
    # says 1, and steps, where not given, make a column's run a stage
    # RING_RUN_BYTES long
    word_stages: int = 0
    # grouped_qmm_tiles.h, from this many rows an expert on average (the
    # plan's capacity over its experts; 0: always, a large value: never)
    tiles_from_rows: int = 32
    # its block: warps over the rows and over the columns (ROW_WARPS,
    # COLUMN_WARPS), each of block_tiles 16-column tiles (block_gated_tiles
    # each of gate and up, gated) by block_row_tiles 8-row tiles. Every warp
    # takes all the block's rows: a weight a warp makes 16-bit serves them
    # all, and no two warps make the same one.
    block_row_warps: int = 1
    block_column_warps: int = 4
    block_tiles: int = 2
    block_gated_tiles: int = 1
    block_row_tiles: int = 8
    # 1: an experts' launch in that block (by the rule, or block_warpgroup 0;
    # not a dense projection's, not the tall gated blocks) takes as few of
    # those row tiles as reach the rows an expert holds on average plus their
    # square root (_fitted_row_tiles); 0: block_row_tiles at every size
    block_fitted_rows: int = 1
    # gated blocks of this many 8-row tiles from block_gated_tall_rows rows an
    # expert on average (the plan's capacity over its experts), 4 bits in
    # groups of 64 (_tall_gated_blocks says why only there)
    block_gated_row_tiles: int = 16
    block_gated_tall_rows: int = 512
    # a dense projection (the launch's `dense`) of at most block_halved_up_to_rows rows
    # whose full blocks number fewer than block_halved_below_blocks: blocks of
    # half the tiling's rows and columns (_halved_blocks says why; 0: never)
    block_halved_up_to_rows: int = 64
    block_halved_below_blocks: int = 128
    # a dense projection's launch of fewer blocks than this splits each block's input
    # among groups (INPUT_SPLITS, _input_splits; 0: never); block_input_splits:
    # that many splits instead, any ungated launch's but on Metal (None: by
    # the launch)
    block_split_below_groups: int = 256
    block_input_splits: int | None = None
    # stages in flight at most (STAGES), fewer where memory is short: 2, not
    # 3, since the warps' own block at 128 values a stage ran faster in 2 at
    # every shape that takes it, and no slower elsewhere (the made weights
    # keep block_shared_stages; benchmarks/RESULTS.md, "The warps' own block
    # in two stages")
    block_stages: int = 2
    # input values wanted a stage, in whole quantization groups that divide the
    # row (STAGE_GROUPS, _stage_groups): more, fewer barriers and longer runs
    # of each column's row read at a time, more memory
    block_stage_values: int = 128
    block_max_groups: int = 4096
    # 1: as many groups (at most block_max_groups) as the fewest items a plan
    # of the launch's capacity makes, its rows in whole blocks (any plan
    # makes at least those, so every group finds one, and the groups from the
    # first take the items past them); 0: as many as the most, a partial
    # block an expert, where the groups past a plan's items scan its counts
    # and exit. Off: it ran level with the most, within a few percent either
    # way, at every shape (benchmarks/RESULTS.md, "The grid of the fewest
    # items, and two groups an SM"), where a grid capped at two groups an SM
    # helped the made weights' launches more.
    block_least_groups: int = 0
    # 1: the block's multiply-adds as one warpgroup's (WARPGROUP: Hopper's
    # wgmma), where the block is 4 warps side by side, each of
    # WARPGROUP_ROW_TILES row tiles, on a GPU that has them (the launch's
    # `warpgroup`) or a prelude that emulates them (OpenCL, Metal); 0, never.
    # Off by default: on the H200 it ran 1.3x to 1.6x slower than the warps'
    # own (benchmarks/RESULTS.md, "The block tiles through Hopper's warpgroup
    # multiply-add").
    # 2: the same with the stage's weights made 16-bit by the whole group into
    # shared memory, where the warpgroups read both operands (SHARED_WEIGHTS),
    # where the block is 4 or 8 warps side by side, each of one 16-column tile
    # a matrix (block_tiles, block_gated_tiles 1) and SHARED_WEIGHTS_ROW_TILES
    # row tiles, in 3 stages or more of a multiple of 64 values, within
    # SHARED_WEIGHTS_BYTES.
    # None: by the rule (_shared_weights_tiling): 2 in SHARED_WEIGHTS_TILING's
    # block where the GPU has wgmma, for the experts' gated launches (4 bits,
    # groups of 64) from block_shared_gated_rows rows an expert on average and
    # their ungated ones from block_shared_rows, or from block_shared_whole_rows
    # where the projection is whole blocks (_whole_blocks) and then also from
    # block_shared_gated_rows up to block_shared_sized_up_to_rows, and a dense
    # projection's (one expert) from block_shared_dense_rows rows; 2 in
    # ONE_WARPGROUP_TILING's block between those ranges (block_one_warpgroup);
    # else 0.
    block_warpgroup: int | None = None
    # 1: with SHARED_WEIGHTS, a stage's weights made a step before its
    # multiply-adds, one barrier a stage instead of two (WEIGHTS_AHEAD, which
    # grouped_qmm_tiles.h says more of); 0: made, then multiplied, in one step.
    # Off: on an H100, in blocks of 128 rows, 0.99x to 1.03x the step's own
    # (benchmarks/RESULTS.md, "The made weights' block rows").
    block_weights_ahead: int = 0
    block_shared_gated_rows: int = 64
    block_shared_rows: int = 512
    block_shared_whole_rows: int = 256
    block_shared_sized_up_to_rows: int = 128
    block_shared_dense_rows: int = 512
    # the experts' made-weights block's 8-row tiles where the rule takes that
    # block, one of SHARED_WEIGHTS_ROW_TILES; None: by the rows an expert holds
    # on average (_shared_weights_row_tiles)
    block_shared_row_tiles: int | None = None
    # the stages that block keeps in flight at most where the rule takes it
    # (its block_stages; at least 3): where memory is short its stages fall
    # to 3, then its values a stage fall and its stages start again from
    # these (_grouped_qmm_tiles_launch). None: by the rule, 3, and an ungated
    # launch's smaller stages start again from UNGATED_MADE_SMALLER_STAGES.
    block_shared_stages: int | None = None
    # the groups at most of an experts' launch in that block where the rule
    # takes it (block_max_groups caps it too; a dense projection's launch
    # keeps block_max_groups). Uncapped, the grid holds the most items any plan
    # of the capacity makes, and the groups past a plan's items scan its
    # counts and exit; capped, each group takes several items in turn. Two
    # groups an SM (TIMED_GPU_SMS): on the H200 Qwen3-30B-A3B's made weights'
    # launches ran 1.02x to 1.18x faster at T = 2048, its and Qwen3-Next's
    # 0.97x to 1.05x at 8192, and Qwen3-30B-A3B's whole prefill 1.01x to
    # 1.02x in each of three turns (benchmarks/RESULTS.md, "The made weights'
    # grid at two groups an SM"); the warps' own block, 0.96x to 1.01x under
    # the same cap on an H100, keeps block_max_groups.
    block_shared_max_groups: int = 2 * TIMED_GPU_SMS
    # 1: each group's items of the experts' rows one run of stages
    # (ACROSS_ITEMS): an item's first copies in flight while the item before
    # is multiplied and stored, with block_max_groups then a group or so an
    # SM, each of many items; a launch whose input is split keeps its items
    # apart. 0: each item's stages alone (copies, products, then the store).
    # Off: slower than the same groups each item alone, or level
    # (benchmarks/RESULTS.md, "Each group's items one run").
    block_across_items: int = 0
    # CUDA: the warps' own block's launches of experts (not the tall gated
    # blocks, whose sums alone fill half a warp's registers, nor a dense
    # projection's, not timed) compiled for this many groups an SM at once
    # (`__launch_bounds__`' minimum blocks, `Launch.min_groups`) where their
    # blocks have up to block_min_groups_up_to_rows rows and their input up to
    # block_min_groups_up_to_in_dims values: the compiler keeps a thread's
    # registers to what they leave. Where an expert holds few rows that block
    # is latency-bound, and its registers, not its shared memory, hold it to
    # two groups an SM; three ran faster there, where the rows are short, at 4
    # bits (MIN_GROUPS_BITS). Taller blocks and longer inputs ran slower with
    # three (benchmarks/RESULTS.md, "Launch bounds for the warps' own block").
    # 0: the compiler's own choice everywhere; an SM runs 2048 threads at most.
    block_min_groups: int = 3
    block_min_groups_up_to_rows: int = 48
    block_min_groups_up_to_in_dims: int = 2048
    # CUDA: the made weights' launches (SHARED_WEIGHTS, any rows, gated or
    # not, the experts' and a dense projection's) compiled for this many groups
    # an SM at once, as block_min_groups does the warps' own; 0: the compiler's
    # choice. The rule's two-warpgroup block, in up to 227 KB, runs one group
    # an SM; one warpgroup's block in stages of 64 values fits three to four
    # in an SM's memory where its registers allow, and the rule's
    # (ONE_WARPGROUP_TILING, which says where it was timed) asks for 3.
    block_shared_min_groups: int = 0
    # 1: the experts' ungated launches of whole blocks (_whole_blocks) from
    # more than block_shared_sized_up_to_rows to fewer than
    # block_shared_whole_rows rows an expert on average, between the made
    # weights' two ranges, where the warps' own block ran otherwise, take
    # ONE_WARPGROUP_TILING's block (4 bits, groups of 64, CUDA with wgmma)
    # where an expert's rows fill at most ONE_WARPGROUP_EXPERT_BLOCKS of its
    # blocks; 0: the warps' own block there.
    block_one_warpgroup: int = 1
    # 1: a layer's gate and up as two launches of one projection each where
    # the fused launch's made weights take a block of fewer rows than one
    # projection's (`fuses_gate_up`); 0: fused wherever the layer can be.
    block_gated_apart: int = 1
    # 1: the made weights' block (SHARED_WEIGHTS) with a warpgroup more that
    # only copies the stages and makes their weights while the block's
    # warpgroups only multiply (PRODUCER_WARPGROUPS: the making of a stage no
    # longer waits while the same warps issue the last one's wgmma), not
    # with block_weights_ahead or block_across_items, its input never split;
    # compiled for one group an SM (`Launch.min_groups`), a thread's registers
    # then at most 65536 / the group's threads. 0: the same warps make and
    # multiply.
    block_specialized: int = 0

    def check(self) -> None:
        """Raises ValueError where grouped_qmm.h could not run this tiling."""
        if min(self.threads, self.tiles, self.gated_tiles, self.row_tiles,
               1 if self.steps is None else self.steps, 1 if self.k_splits is None
               else self.k_splits, self.max_groups, self.block_row_warps,
               self.block_column_warps, self.block_tiles, self.block_gated_tiles,
               self.block_row_tiles, self.block_gated_row_tiles, self.block_max_groups,
               self.block_shared_max_groups, self.block_stage_values) < 1:
            raise ValueError(f"grouped_qmm tiling: every field but wide_loads, loads_ahead, "
                             f"tiles_from_rows, block_gated_tall_rows, the block_halved and "
                             f"block_split fields, block_input_splits, block_stages and "
                             f"block_shared_stages must be at least 1: {self}")
        if self.k_splits is not None and (self.threads // 32) % self.k_splits:
            raise ValueError(f"grouped_qmm tiling: k_splits must divide the group's warps, "
                             f"threads / 32: {self}")
        if min(self.tiles_from_rows, self.block_gated_tall_rows, self.block_halved_up_to_rows,
               self.block_halved_below_blocks, self.block_split_below_groups,
               self.block_shared_gated_rows, self.block_shared_rows,
               self.block_shared_whole_rows, self.block_shared_sized_up_to_rows,
               self.block_shared_dense_rows, self.block_min_groups,
               self.block_min_groups_up_to_rows, self.block_min_groups_up_to_in_dims,
               self.block_shared_min_groups) < 0 \
                or self.block_stages < 2 or (self.block_shared_stages is not None
                                              and self.block_shared_stages < 3) or (
                    self.block_input_splits is not None and self.block_input_splits < 1):
            raise ValueError(f"grouped_qmm tiling: tiles_from_rows, block_gated_tall_rows, "
                             f"block_split_below_groups, the min_groups fields and the "
                             f"block_halved and block_shared row fields are at least 0, "
                             f"block_input_splits at least 1, block_stages at least 2 and "
                             f"block_shared_stages at least 3: {self}")
        block_threads = 32 * self.block_row_warps * self.block_column_warps
        if MAX_EXPERTS % block_threads:
            raise ValueError(f"grouped_qmm tiling: the block's threads must divide MAX_EXPERTS "
                             f"({MAX_EXPERTS}): {self}")
        # the made weights' groups bound at the rule's block's threads, which
        # the rule may give a tiling of fewer
        made_threads = max(block_threads, 32 * SHARED_WEIGHTS_TILING["block_column_warps"])
        if self.block_min_groups * block_threads > MAX_SM_THREADS \
                or self.block_shared_min_groups * made_threads > MAX_SM_THREADS:
            raise ValueError(f"grouped_qmm tiling: block_min_groups groups of the block's "
                             f"threads, and block_shared_min_groups of the made weights' "
                             f"block's, are at most an SM's {MAX_SM_THREADS}: {self}")
        if self.wide_loads not in (0, 1) or self.loads_ahead not in (None, 0, 1) \
                or self.block_warpgroup not in (None, 0, 1, 2) \
                or self.block_weights_ahead not in (0, 1) or self.block_across_items not in (0, 1) \
                or self.block_fitted_rows not in (0, 1) or self.block_least_groups not in (0, 1) \
                or self.block_one_warpgroup not in (0, 1) or self.block_gated_apart not in (0, 1) \
                or self.block_specialized not in (0, 1):
            raise ValueError(f"grouped_qmm tiling: wide_loads, loads_ahead, block_weights_ahead, "
                             f"block_across_items, block_fitted_rows, block_least_groups, "
                             f"block_one_warpgroup, block_gated_apart and block_specialized "
                             f"are 0 or 1, block_warpgroup None, 0, 1 or 2: {self}")
        if self.block_shared_row_tiles not in (None, *SHARED_WEIGHTS_ROW_TILES):
            raise ValueError(f"grouped_qmm tiling: block_shared_row_tiles is None or one of "
                             f"{SHARED_WEIGHTS_ROW_TILES}: {self}")
        if self.word_stages == 1 or self.word_stages < 0 or (
                self.word_stages and (self.k_splits or 1) > 1):
            raise ValueError(f"grouped_qmm tiling: word_stages is 0 or at least 2, and takes "
                             f"rows unsplit (k_splits 1): {self}")
        if self.threads % 32 or MAX_EXPERTS % self.threads:
            raise ValueError(f"grouped_qmm tiling: threads must be a multiple of 32 that "
                             f"divides MAX_EXPERTS ({MAX_EXPERTS}): {self}")


GROUPED_QMM_TILING = GroupedQmmTiling()


def grouped_qmm_loads(row_groups: int, gated: bool, k_splits: int = 1) -> tuple[int, bool]:
    """How a lane loads a row where the tiling leaves it to the row: the
    quantization groups it loads before using any (STEPS), and whether a
    pass loads the next pass's groups before its multiply-adds
    (LOADS_AHEAD), for a row of `row_groups` groups, gate and up fused or
    not (`gated`), split among `k_splits` sets of warps.

    A warp's loads of one group wait on memory before its multiply-adds, and
    long rows make long chains of such waits: more groups a pass, or the
    next pass's loads in flight during this pass's multiply-adds, keep more
    bytes in flight. Measured on the H200 (benchmarks/HISTORY.md, "Loads
    ahead by the row's length" and "Loads a pass ahead"):
    - rows of up to 32 groups: one group a pass for one projection, 2 for
      the fused gate and up, waited for; loads ahead gained nothing;
    - rows of 33 to 63 groups (gpt-oss-20b's 45): 2 groups a pass loaded
      ahead, 7% to 23% faster than 4 waited for;
    - rows of 64 groups and more (Mixtral's, DeepSeek-V3's): 4 groups a pass
      waited for, 5% to 12% faster than 2 loaded ahead. 4 loaded ahead need
      more registers than a thread has.
    A split row is split for want of bytes in flight (`grouped_qmm_k_splits`):
    up to 4 groups of each share, in one load each where they are 2 or 4,
    waited for.
    """
    if k_splits > 1:
        share = -(-row_groups // k_splits)
        return (4 if share >= 4 else 2 if share >= 2 else 1), False
    if row_groups >= 64:
        return 4, False
    if row_groups > 32:
        return 2, True
    return (2 if gated else 1), False


# A launch of fewer warps than this splits its rows (K_SPLITS): a dense
# projection as one expert has a few dozen column blocks, and each warp's row
# is a chain of waits on memory. Splitting makes the blocks narrower and the
# warps more, each with a shorter chain.
SPLIT_BELOW_WARPS = 1024


def grouped_qmm_k_splits(experts: int, out_dims: int, tile_columns: int, warps: int,
                         row_groups: int) -> int:
    """The sets of a group's `warps` warps (K_SPLITS) that share a row's
    `row_groups` quantization groups, where the tiling leaves it to the
    launch: for at most `experts` experts with rows, of `out_dims` columns, a
    warp `tile_columns` of them, the fewest sets, doubling, that reach
    `SPLIT_BELOW_WARPS` warps, each set's share 4 groups or more."""
    splits = 1
    while (splits * 2 <= warps and row_groups >= 8 * splits
           and experts * -(-out_dims // (warps // splits * tile_columns)) * warps
           < SPLIT_BELOW_WARPS):
        splits *= 2
    return splits


_grouped_qmm_tiling: ContextVar[GroupedQmmTiling] = ContextVar("grouped_qmm_tiling",
                                                               default=GROUPED_QMM_TILING)


@contextmanager
def grouped_qmm_tiling(**changes):
    """Run grouped_qmm.h with `GROUPED_QMM_TILING`'s fields changed, within the block.

    Like `plan_max_groups`, it applies to the calls made inside the block (a
    launch is fixed when the GEMM is called, not when the graph is evaluated).

    Args:
        **changes: Fields of `GroupedQmmTiling`, say `tiles=1, steps=4`.
    """
    tiling = replace(GROUPED_QMM_TILING, **changes)
    tiling.check()
    token = _grouped_qmm_tiling.set(tiling)
    try:
        yield tiling
    finally:
        _grouped_qmm_tiling.reset(token)


class GroupedQmmParams(NamedTuple):
    num_experts: int
    in_dims: int
    out_dims: int
    capacity: int
    column_blocks: int  # blocks of a group's columns that cover out_dims
    num_rows: int  # rows of the rows array: tokens with token_rows, else capacity


class ArgsortSliceParams(NamedTuple):
    num_rows: int
    row_size: int
    start: int  # the first position of each row's sort taken
    count: int  # positions taken


class HeadNormRopeParams(NamedTuple):
    rows: int  # batch * length
    length: int
    q_heads: int
    k_heads: int
    q_row: int  # values a row of queries_in
    q_at: int  # the column of a row's first query head
    k_row: int
    k_at: int
    offset_stride: int  # 1: an offset a sequence; 0: one for all
    eps_bits: int  # the norms' epsilon, float32 bits
    log2_base_bits: int  # log2 of RoPE's base, float32 bits
    scale_bits: int  # RoPE's position scale, float32 bits


class DecodeAttentionParams(NamedTuple):
    batch: int
    heads: int  # query heads
    kv_heads: int
    splits: int  # groups a sequence's key-value head, each a split of its keys
    scale_bits: int  # the scores' scale, float32 bits


class AddRmsNormParams(NamedTuple):
    rows: int
    dims: int  # values a row
    eps_bits: int  # the norm's epsilon, float32 bits


PARAMS = {"plan": PlanParams, "gather": GatherParams, "combine": CombineParams,
          "grouped_qmm": GroupedQmmParams, "grouped_qmm_tiles": GroupedQmmParams,
          "grouped_qmm_roles": GroupedQmmParams,
          "argsort_slice": ArgsortSliceParams, "head_norm_rope": HeadNormRopeParams,
          "decode_attention": DecodeAttentionParams,
          "decode_attention_merge": DecodeAttentionParams, "add_rms_norm": AddRmsNormParams}


@dataclass(frozen=True)
class Launch:
    """How to run one body: its grid, sizes, template constants and outputs."""

    body: str  # the body run (grouped_qmm's launch picks one of two)
    groups: int
    group_size: int
    params: (PlanParams | GatherParams | CombineParams | GroupedQmmParams | ArgsortSliceParams
             | HeadNormRopeParams | DecodeAttentionParams | AddRmsNormParams)
    template: tuple[tuple[str, object], ...]
    outputs: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype name)
    # bytes of the body's SHARED_WORDS, requested at launch where the
    # backend allocates it (CUDA's dynamic shared memory)
    shared_bytes: int = 0
    # CUDA: groups an SM the compiled kernel must leave registers for
    # (`kernels.launch_bounds`); 0: the compiler's own choice
    min_groups: int = 0


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _bits_type(dtype: str) -> str:
    """The unsigned integer type of a row dtype's width: a body's BitsT, in
    which it moves or compares the values' bits."""
    return "uint16" if ELEMENT_BYTES[dtype] == 2 else "uint32"


# The fields plan.h writes into its one int32 output, plan_data, in order:
# every field of the plan but row_weights, its second output. The last three
# are plan.h's `totals`.
PLAN_DATA_FIELDS = tuple(name for name in PLAN_FIELDS if name != WEIGHT_FIELD)


@lru_cache(maxsize=256)
def plan_layout(
    num_entries: int, num_experts: int, tile_m: int
) -> tuple[dict[str, tuple[int, int]], int]:
    """Each integer field's (offset, size) in plan.h's int32 output, and its total size.

    Cached, as the launches are: every GPU plan call reads it (the dict is
    shared: read only)."""
    sizes = field_sizes(num_entries, num_experts, tile_m)
    layout, offset = {}, 0
    for name in PLAN_DATA_FIELDS:
        layout[name] = (offset, sizes[name])
        offset += sizes[name]
    return layout, offset


@contextmanager
def plan_max_groups(cap: int):
    """Cap the GPU plan's groups at `cap` instead of PLAN_MAX_GROUPS, within the block.

    The cap applies to plans built inside the block (a plan's launch is fixed
    when `moe_plan` is called, not when the graph is evaluated). It changes
    how the work is split, never the result.

    Args:
        cap (int): Plan groups at most; at least 1.
    """
    if cap < 1:
        raise ValueError(f"cap: must be at least 1, got {cap}")
    token = _plan_max_groups.set(cap)
    try:
        yield
    finally:
        _plan_max_groups.reset(token)


def plan_launch(
    num_entries: int, num_experts: int, tile_m: int, top_k: int, has_weights: bool
) -> Launch:
    """The plan kernel, for `num_entries >= 1`: outputs plan_data, row_weights.

    Its groups are capped at the cap of an enclosing `plan_max_groups` block,
    else at PLAN_MAX_GROUPS.
    """
    cap = _plan_max_groups.get()
    return _plan_launch(num_entries, num_experts, tile_m, top_k, has_weights,
                        PLAN_MAX_GROUPS if cap is None else cap)


@lru_cache(maxsize=256)
def _plan_launch(
    num_entries: int, num_experts: int, tile_m: int, top_k: int, has_weights: bool,
    max_groups: int,
) -> Launch:
    capacity = capacity_for(num_entries, num_experts, tile_m)
    _, data_size = plan_layout(num_entries, num_experts, tile_m)
    blocks = -(-num_entries // PLAN_BLOCK)
    blocks_per_group = -(-blocks // max_groups)
    return Launch(
        "plan", -(-blocks // blocks_per_group), PLAN_BLOCK,
        PlanParams(num_entries=num_entries, num_experts=num_experts, tile_m=tile_m, top_k=top_k,
                   capacity=capacity, max_tiles=capacity // tile_m,
                   blocks_per_group=blocks_per_group),
        (("BLOCK", PLAN_BLOCK), ("MAX_EXPERTS", MAX_EXPERTS), ("HAS_WEIGHTS", has_weights)),
        (((data_size,), "int32"), ((capacity if has_weights else 1,), "float32")),
    )


@lru_cache(maxsize=256)
def gather_launch(
    num_src: int, hidden: int, num_rows: int, in_dtype: str, out_dtype: str
) -> Launch:
    """For `num_rows >= 1`, `hidden >= 1`, and src padded to 8 elements (gather.h)."""
    same_dtype = in_dtype == out_dtype
    row_bytes = hidden * ELEMENT_BYTES[in_dtype]
    vectors = same_dtype and row_bytes % 16 == 0
    row_vectors = row_bytes // 16 if vectors else 0
    per_row = row_vectors if vectors else hidden
    group_size = min(MAX_ROW_GROUP if vectors else 256, _round_up(per_row, 32))
    return Launch(
        "gather", min(-(-num_rows // GATHER_ROWS), MAX_GROUPS), group_size,
        GatherParams(num_src=num_src, hidden=hidden, num_rows=num_rows, row_vectors=row_vectors),
        (("InT", in_dtype), ("OutT", out_dtype), ("SAME_DTYPE", same_dtype),
         ("BitsT", _bits_type(in_dtype)), ("VECTORS", vectors), ("ROWS", GATHER_ROWS)),
        (((num_rows, hidden), out_dtype),),
    )


@lru_cache(maxsize=256)
def combine_launch(
    num_src: int, hidden: int, num_out: int, fan_in: int, has_weights: bool,
    in_dtype: str, out_dtype: str,
) -> Launch:
    """For `num_out >= 1`, `hidden >= 1`, and src padded to 8 elements (combine.h)."""
    row_bytes = hidden * ELEMENT_BYTES[in_dtype]
    vectors = row_bytes % 16 == 0
    row_vectors = row_bytes // 16 if vectors else 0
    per_row = row_vectors if vectors else hidden
    group_size = min(MAX_ROW_GROUP if vectors else 256, _round_up(per_row, 32))
    in_kind = ROW_KINDS.index(in_dtype)
    return Launch(
        "combine", min(num_out, MAX_GROUPS), group_size,
        CombineParams(num_src=num_src, hidden=hidden, num_out=num_out, row_vectors=row_vectors),
        (("InT", in_dtype), ("OutT", out_dtype), ("IN_KIND", in_kind), ("FAN_IN", fan_in),
         ("HAS_WEIGHTS", has_weights), ("VECTORS", vectors)),
        (((num_out, hidden), out_dtype),),
    )


def grouped_qmm_launch(
    num_experts: int, in_dims: int, out_dims: int, capacity: int, bits: int,
    quant_group: int, dtype: str, *, backend: str, num_rows: int | None = None,
    gated: bool = False, out_bias: bool = False,
    clamped_swiglu: tuple[float, float] | None = None, dense: bool = False,
    warpgroup: bool = False,
) -> Launch:
    """For `capacity >= 1`, `out_dims >= 1`, `num_experts <= MAX_EXPERTS`, bits
    in GROUPED_QMM_BITS, a quant group of GROUPED_QMM_QUANT_GROUPS dividing
    `in_dims`, a dtype of GROUPED_QMM_DTYPES, on `backend` (of BACKENDS), in
    the tiling of an enclosing `grouped_qmm_tiling` block, else
    `GROUPED_QMM_TILING`.

    The body is grouped_qmm.h, or grouped_qmm_tiles.h from the tiling's
    `tiles_from_rows` rows an expert on average where its block fits the
    backend's shared memory (`Launch.body`); both take the same arguments
    and compute the same GEMM (grouped_qmm_tiles.h rounds the dequantized
    weights to the rows' format). Where grouped_qmm_tiles.h splits the input
    (INPUT_SPLITS, `_input_splits`), its output is each split's float sums,
    float32 `[splits, capacity, out_dims]`, for the caller to add in split
    order (`_gpu._grouped_qmm`: combine.h).

    `num_rows`: the rows are `num_rows >= 1` tokens, row r read from token
    `row_tokens[r]` (TOKEN_ROWS); None: the plan's `capacity` rows themselves.
    `gated`: silu(gate) * up of two projections (GATED), each with the
    tiling's gated_tiles (block_gated_tiles); `clamped_swiglu`: (alpha,
    limit) of gpt-oss's clamped form in its place (CLAMPED, qmm_store.h).
    `out_bias`: each projection's bias added to its sums (OUT_BIAS).
    `dense`: the one expert is a dense projection (projections.py), whose
    blocks may be halved (`_halved_blocks`) and whose input may be split
    (`_input_splits`); an expert-parallel rank's single expert is not one,
    and keeps the experts' launch.
    The tiling's `block_warpgroup=1` has grouped_qmm_tiles.h's blocks of 4
    warps side by side multiply as one warpgroup (WARPGROUP), and
    `block_warpgroup=2` as warpgroups that read the weights the group made
    16-bit in shared memory (SHARED_WEIGHTS): on CUDA where the GPU has the
    instruction (`warpgroup`, `_gpu.warpgroup_mma`: Hopper's wgmma;
    elsewhere on CUDA it raises ValueError), on Metal and OpenCL through
    their preludes' emulation; `block_warpgroup=None` (the default), by
    `_shared_weights_tiling`."""
    if dense and num_experts != 1:
        raise ValueError(f"dense: a dense projection is one expert, got {num_experts}")
    tiling = _shared_weights_tiling(_grouped_qmm_tiling.get(), gated, backend, warpgroup, bits,
                                    quant_group, capacity, num_experts, dense, in_dims, out_dims)
    store = (out_bias, clamped_swiglu if gated else None)
    if tiling.block_warpgroup and backend == "cuda" and not warpgroup:
        raise ValueError(f"grouped_qmm tiling: block_warpgroup={tiling.block_warpgroup}, but "
                         f"this GPU has no warpgroup multiply-add (wgmma: sm_90a)")
    if grouped_qmm_body(capacity, num_experts) == "grouped_qmm_tiles":
        tall = _tall_gated_blocks(gated, backend, bits, quant_group, capacity, num_experts,
                                  tiling)
        halved = _halved_blocks(gated, backend, out_dims, capacity, dense, tiling)
        # The input split among groups (_input_splits): a dense projection's
        # by default, never gated (SwiGLU needs whole sums); Metal keeps
        # whole rows (none measured there).
        splits_input = not gated and backend != "metal"
        tiles = _grouped_qmm_tiles_launch(num_experts, in_dims, out_dims, capacity, bits,
                                          quant_group, dtype, num_rows, gated, tiling,
                                          (SHARED_WEIGHTS_BYTES if tiling.block_warpgroup == 2
                                           else SHARED_BYTES)[backend], backend != "cuda", tall,
                                          halved, splits_input, dense, store,
                                          tiling.block_warpgroup)
        if tiles is not None:
            return tiles
    return _grouped_qmm_launch(num_experts, in_dims, out_dims, capacity, bits, quant_group,
                               dtype, num_rows, gated, tiling, SHARED_BYTES[backend], store)


# The row tiles a block through wgmma takes (N = 8 * row tiles: widths the
# CUDA prelude spells, tests/test_cuda_source.py checks): the warps' A from
# registers in 8 or 16; the made weights' in 6, 10, 12, 20 and 24 too, blocks
# that an expert of about as many rows fills once (a half-empty block of 6
# multiplies 3, N of 24, as one of 8 multiplies 4; at 32 to 40 rows an expert
# 48 rows ran 0.62x to 0.80x the warps' own, so no rule takes them:
# benchmarks/RESULTS.md, "The made weights in 48 rows"). Their gated sums take a
# register a row a thread: nvcc 13.0, as the launch builds them (16-byte and
# plain copies both), spills none up to 20 (255 registers there); at 24, 48
# bytes, loaded at an item's beginning, none in the stage loop (92 bytes and 9
# loads a stage in it before tiles_weights.h took one place a run's stores).
WARPGROUP_ROW_TILES = (8, 16)
SHARED_WEIGHTS_ROW_TILES = (6, 8, 10, 12, 16, 20, 24)

# SHARED_WEIGHTS' block where the rule takes it (_shared_weights_tiling): two
# warpgroups side by side (128 columns), each warp one 16-column tile a
# matrix, 128 rows, 128 values a stage (fewer where memory is short: a
# gated block's 64), in 3 stages, the fewest it runs in: the rule's block
# takes its stages from block_shared_stages, a tiling naming this block from
# block_stages, whose default (the warps' own) is fewer.
SHARED_WEIGHTS_TILING = dict(block_warpgroup=2, block_column_warps=8, block_tiles=1,
                             block_gated_tiles=1, block_row_tiles=16, block_gated_row_tiles=16,
                             block_stage_values=128, block_stages=3)

# The stages an ungated launch of that block starts again from by the rule
# (block_shared_stages None) where its values a stage fall below those wanted
# to fit: 5, four of copies in flight. On an H100, in both orders, one process
# each, 5 against 3 ran those launches (blocks of 192 rows, 64 values a stage:
# Qwen3-30B-A3B's and gpt-oss-20b's T = 8192, uniform and skewed, Mixtral's
# 2048) 1.01x to 1.14x faster, where the fused gate and up lost 0.68x to 0.84x
# in the 4 or 5 that fit it, and launches of 128 values a stage gained nothing
# (benchmarks/RESULTS.md, "Five stages for one projection's made weights").
UNGATED_MADE_SMALLER_STAGES = 5


# The made weights in one warpgroup (4 warps, 64 columns, 96 rows, stages of
# 64 values, 3 in flight), compiled for 3 groups an SM (block_shared_min_groups)
# where the rule takes it (_shared_weights_tiling, block_one_warpgroup): the
# two-warpgroup block runs one group an SM, latency-bound, and this one's
# memory and registers leave room for three. Where an expert's rows
# (_held_rows) fill at most ONE_WARPGROUP_EXPERT_BLOCKS of its blocks: on an
# H100, in four turns (two orders each of two runs), at Qwen3-Next's T = 8192
# (160 rows an expert, whole blocks) it ran the down projection 1.13x to
# 1.16x faster than the warps' own 64-row block the rule gave it, the gate
# alone 1.08x to 1.11x, and the layer 1.07x; at 187.5 rows an expert
# (Qwen3-30B-A3B's T = 3000), whose experts often take a third block, the
# gate 0.93x and the down projection 0.99x to 1.01x. At 256 and 512 rows an
# expert it ran 0.70x to 0.87x the two-warpgroup block, in 48-row blocks at
# 40 rows an expert 0.75x to 0.90x the warps' own, and the fused gate and
# up 0.78x at 160 (benchmarks/RESULTS.md, "The made weights in one
# warpgroup"): gated launches keep theirs.
ONE_WARPGROUP_TILING = dict(block_warpgroup=2, block_column_warps=4, block_tiles=1,
                            block_gated_tiles=1, block_row_tiles=12, block_gated_row_tiles=12,
                            block_stage_values=64, block_stages=3, block_shared_min_groups=3)
ONE_WARPGROUP_EXPERT_BLOCKS = 2


def _shared_weights_tiling(tiling: GroupedQmmTiling, gated: bool, backend: str,
                           warpgroup: bool, bits: int, quant_group: int, capacity: int,
                           num_experts: int, dense: bool, in_dims: int,
                           out_dims: int) -> GroupedQmmTiling:
    """`tiling` with its `block_warpgroup` decided where it is None: the
    experts' launches of 4 bits in groups of 64 on CUDA where the GPU has
    wgmma (`warpgroup`) take SHARED_WEIGHTS_TILING's block (its rows by
    `block_shared_row_tiles`, or `_shared_weights_row_tiles`), gated from
    `block_shared_gated_rows` rows an expert on average (the plan's capacity
    over its experts), ungated from `block_shared_whole_rows` where the
    projection is whole blocks (`_whole_blocks`), and there also from
    `block_shared_gated_rows` up to `block_shared_sized_up_to_rows`, and else
    from `block_shared_rows`; a dense projection's (`dense`, one expert) from
    `block_shared_dense_rows` rows. The ungated launches of whole blocks
    between those two ranges of theirs take ONE_WARPGROUP_TILING's block
    (`block_one_warpgroup`) where an expert's rows fill at most
    ONE_WARPGROUP_EXPERT_BLOCKS of its blocks. Every other launch, and one
    whose tiling says 0, the warps' own multiply-adds (0) in the rows
    `_own_block_tiling` gives them.

    On the H200, against the warps' own at every shape's T = 512 to 8192
    (benchmarks/RESULTS.md, "The expert GEMM at prefill sizes"), those blocks,
    of 128 rows then, ran the fused gate and up 1.07x to 1.44x faster from 64
    rows an expert (DeepSeek-V3's T = 2048) but 0.99x at 64 (gpt-oss-20b's T =
    512) and 0.95x at 160 (Qwen3-Next's T = 8192), where their 128 rows leave
    more of an expert's last block empty, and 0.69x at 40 (Qwen3-Next's T =
    2048); one projection 1.04x to 1.46x from 512 rows an expert; at 256,
    1.00x to 1.23x where it is whole blocks (Qwen3-30B-A3B's T = 4096,
    Mixtral's 1024, DeepSeek-V3's 8192) and 0.91x where it is not
    (gpt-oss-20b's 2880 values and columns, T = 2048); bfloat16 rows (float16
    takes the same instructions). A dense projection's prefill of 512 to 8192
    rows (attention's, DeepSeek-V3's shared expert's, an lm_head's) ran 1.04x
    to 1.28x faster in them, but 0.96x for Qwen3-30B-A3B's keys and values at
    T = 2048 and 1.00x for gpt-oss-20b's queries at 512
    (benchmarks/RESULTS.md, "Dense projections at prefill sizes"). In blocks
    sized to an expert's rows (`_shared_weights_row_tiles`), on an H100, one
    projection of whole blocks ran 1.17x to 1.49x faster than the warps' own
    at 64 to 128 rows an expert (DeepSeek-V3's T = 2048, Qwen3-Next's 4096,
    Qwen3-30B-A3B's 2048), hence from `block_shared_gated_rows` up to
    `block_shared_sized_up_to_rows`; at 160 (Qwen3-Next's 8192) 1.07x and
    0.99x in blocks of 160 rows, so not there (benchmarks/RESULTS.md, "The
    made weights' block rows"). The other formats, which the tests run in
    these blocks, keep theirs until timed in them, and so do Metal and OpenCL
    (no wgmma)."""
    if tiling.block_warpgroup is not None:
        return tiling if tiling.block_warpgroup else _own_block_tiling(
            tiling, backend, capacity / num_experts, dense)
    whole = not dense and not gated and _whole_blocks(_decided_tiling(tiling, True), in_dims,
                                                      out_dims)
    rows = (tiling.block_shared_dense_rows if dense
            else tiling.block_shared_gated_rows if gated
            else tiling.block_shared_whole_rows if whole
            else tiling.block_shared_rows)
    sized = whole and (tiling.block_shared_gated_rows * num_experts <= capacity
                       <= tiling.block_shared_sized_up_to_rows * num_experts)
    made = backend == "cuda" and warpgroup and (bits, quant_group) == (4, 64)
    if not (made and (capacity >= rows * num_experts or sized)):
        # A whole launch not in the made weights holds fewer than
        # block_shared_whole_rows rows an expert: between their two ranges.
        one_rows = 8 * ONE_WARPGROUP_TILING["block_row_tiles"]
        if (made and whole and tiling.block_one_warpgroup
                and capacity > tiling.block_shared_sized_up_to_rows * num_experts
                and _held_rows(capacity / num_experts)
                <= ONE_WARPGROUP_EXPERT_BLOCKS * one_rows):
            return _one_warpgroup_tiling(tiling)
        return _own_block_tiling(tiling, backend, capacity / num_experts, dense)
    if dense:
        return _decided_tiling(tiling, True)
    row_tiles = (tiling.block_shared_row_tiles
                 or _shared_weights_row_tiles(capacity / num_experts, gated, in_dims))
    return _decided_tiling(tiling, True, row_tiles,
                           min(tiling.block_max_groups, tiling.block_shared_max_groups))


@lru_cache(maxsize=64)
def _one_warpgroup_tiling(tiling: GroupedQmmTiling) -> GroupedQmmTiling:
    """`tiling` in ONE_WARPGROUP_TILING's block, made once a tiling (as
    `_decided_tiling` says why)."""
    return replace(tiling, **ONE_WARPGROUP_TILING)


def _own_block_tiling(tiling: GroupedQmmTiling, backend: str, rows_per_expert: float,
                      dense: bool) -> GroupedQmmTiling:
    """`tiling` in the warps' own block (block_warpgroup 0), an experts'
    launch's (not `dense`, not on Metal) in `_fitted_row_tiles` where
    `block_fitted_rows` says so. The tall gated blocks take
    `block_gated_row_tiles`, which this leaves as it is."""
    fitted = tiling.block_fitted_rows and not dense and backend != "metal"
    return _decided_tiling(tiling, False, _fitted_row_tiles(
        rows_per_expert, tiling.block_row_tiles, tiling.block_row_warps)
        if fitted else tiling.block_row_tiles)


def _fitted_row_tiles(rows_per_expert: float, row_tiles: int, row_warps: int = 1) -> int:
    """The warps' own block's 8-row tiles a warp for the experts' launches
    where an expert holds `rows_per_expert` rows on average: the fewest
    whose rows, over the block's `row_warps`, reach the average plus its
    square root, at most `row_tiles` (the tiling's).

    Each warp of the block holds the sums of all the block's rows, so rows
    no expert fills still cost registers (in 64 rows Qwen3-Next's launches
    spill), while an expert of more rows than the block takes a second
    block, nearly empty, whose weights are read and made again. Routed
    counts spread about the average by about its square root, so a block of
    the average itself leaves many experts a second block, and one of the
    average plus its square root holds most whole. Measured against 64 rows
    at 32 and 40 rows an expert, 4 and 8 bits (benchmarks/RESULTS.md, "The
    warps' own block in fewer rows"); fewer sums a warp cannot spill where
    more did not, so the formats not timed take the same block. Metal keeps
    its blocks (none measured there)."""
    wanted = rows_per_expert + math.sqrt(rows_per_expert)
    return max(1, min(row_tiles, math.ceil(wanted / (8 * row_warps))))


def _held_rows(rows_per_expert: float) -> float:
    """The rows that hold most experts' whole where an expert holds
    `rows_per_expert` on average: the average plus 1.5 of its square root,
    about how far routed counts spread above it."""
    return rows_per_expert + 1.5 * math.sqrt(rows_per_expert)


def _shared_weights_row_tiles(rows_per_expert: float, gated: bool, in_dims: int) -> int:
    """The made weights' block's 8-row tiles for the experts' launches where
    an expert holds `rows_per_expert` rows on average: the fewest of
    SHARED_WEIGHTS_ROW_TILES whose rows reach `_held_rows`; where none does,
    the tallest from TALLEST_MADE_WEIGHTS_FROM_ROWS rows an expert, else
    OVERFULL_MADE_WEIGHTS_ROW_TILES. A gated launch takes the tallest only
    for inputs of at most TALLEST_GATED_MADE_WEIGHTS_UP_TO_IN_DIMS values
    (else 16, 128 rows).

    Routed counts spread about the average by about its square root, so a
    block of exactly the average leaves many experts a second block, nearly
    empty, whose weights are made again; a block a little taller holds most
    experts whole. On an H100 (benchmarks/RESULTS.md, "The made weights'
    block rows"), against blocks of 128 rows, the fused gate and up ran
    1.04x to 1.47x faster in blocks of 80 rows at 64 an expert (DeepSeek-V3,
    T = 2048), 96 at 80 (Qwen3-Next, 4096), 160 at 128 (Qwen3-30B-A3B,
    2048), 192 at 160 (Qwen3-Next, 8192) and 192 at 512 and 1024
    (Qwen3-30B-A3B's and gpt-oss-20b's T = 8192), and one projection 1.04x
    to 1.23x in blocks of 192 from 512 rows (those two and Mixtral's T =
    2048 and 8192); at 256 rows, where none fits, blocks of 160 ran 1.11x
    to 1.18x faster than 128 (DeepSeek-V3's T = 8192, gated and not;
    gpt-oss-20b's fused T = 2048), and 96 0.92x to 1.01x. Slower: blocks of
    exactly the average (64 at 64, 0.86x; 80 at 80, 0.84x), blocks of 192
    at 256 rows (DeepSeek-V3's T = 8192, 0.64x to 0.89x; gpt-oss-20b's
    fused T = 2048, 0.97x), and Mixtral's fused gate and up (4096 values a
    row) in 192-row blocks, 0.91x and 0.94x: the gated sums of 24 row tiles
    spill (SHARED_WEIGHTS_ROW_TILES' comment), which the shorter rows
    outweighed; not taken apart. A dense projection's block keeps its 128
    rows (not timed in others)."""
    wanted = _held_rows(rows_per_expert)
    fitting = [row_tiles for row_tiles in SHARED_WEIGHTS_ROW_TILES if 8 * row_tiles >= wanted]
    tallest = SHARED_WEIGHTS_ROW_TILES[-1]
    row_tiles = fitting[0] if fitting else (
        tallest if rows_per_expert >= TALLEST_MADE_WEIGHTS_FROM_ROWS
        else OVERFULL_MADE_WEIGHTS_ROW_TILES)
    if gated and row_tiles == tallest and in_dims > TALLEST_GATED_MADE_WEIGHTS_UP_TO_IN_DIMS:
        return SHARED_WEIGHTS_TILING["block_row_tiles"]
    return row_tiles


# _shared_weights_row_tiles' tallest block past the widths an expert's rows
# would fill, and the inputs its gated launch takes it for, as measured; below
# those rows, the block there (160 rows; only 256 an expert was timed).
TALLEST_MADE_WEIGHTS_FROM_ROWS = 512
OVERFULL_MADE_WEIGHTS_ROW_TILES = 20
TALLEST_GATED_MADE_WEIGHTS_UP_TO_IN_DIMS = 2880


def fuses_gate_up(num_experts: int, in_dims: int, out_dims: int, capacity: int, bits: int,
                  quant_group: int, *, backend: str, warpgroup: bool = False) -> bool:
    """Whether a layer's gate and up projections (each `num_experts` experts of
    `out_dims` by `in_dims`, over a plan of `capacity` rows) run as one gated
    launch (`grouped_qmm_launch`'s `gated`), in the tiling of an enclosing
    `grouped_qmm_tiling` block, else `GROUPED_QMM_TILING`. False, by
    `block_gated_apart`, where the gated launch's made weights take a block
    of fewer rows than one projection's: an expert holds rows enough for the
    tallest block, but the gated launch's inputs are too long for it
    (TALLEST_GATED_MADE_WEIGHTS_UP_TO_IN_DIMS; Mixtral's from T = 2048). The
    layer then runs a launch a projection over the gathered rows, and the
    activation apart.

    There, on an H100, medians of three processes, the pair apart (gate and
    up each in 192-row blocks of the rule's five stages, the gather, MLX's
    activation) with the down projection ran 1.08x faster than the fused
    launch's 128-row blocks at Mixtral's T = 2048 and 8192 under uniform
    routing, 1.02x and 1.08x under skewed, faster in each of the twelve
    processes (1.01x to 1.09x); where both take the same block (DeepSeek-V3's
    160 rows at T = 8192, Qwen3-30B-A3B's and gpt-oss-20b's 192) the fused
    launch ran 1.13x to 1.19x faster (benchmarks/RESULTS.md, "Every shape's
    layer, medians of three processes"). The same blocks' sizes not timed
    apart take the rule too: Mixtral's T = 4096 and 16384, DeepSeek-V3's
    16384 (7168 values, 512 rows an expert)."""
    tiling = _grouped_qmm_tiling.get()
    # A layer asks at every call, and the tilings below cost it about 10 us:
    # first what they need, the gated launch in the made weights, and its
    # inputs long enough for a shorter block (_shared_weights_row_tiles).
    if (not tiling.block_gated_apart or capacity < tiling.block_shared_gated_rows * num_experts
            or in_dims <= TALLEST_GATED_MADE_WEIGHTS_UP_TO_IN_DIMS):
        return True
    gated, single = (_shared_weights_tiling(tiling, is_gated, backend, warpgroup, bits,
                                            quant_group, capacity, num_experts, False,
                                            in_dims, out_dims)
                     for is_gated in (True, False))
    return not (gated.block_warpgroup == single.block_warpgroup == 2
                and gated.block_row_tiles < single.block_row_tiles)


def _whole_blocks(shared: GroupedQmmTiling, in_dims: int, out_dims: int) -> bool:
    """Whether a projection's input is whole stages of the `shared` tiling's
    block (the made weights') and its output whole blocks of its columns: no
    stage of fewer values, no block part empty. gpt-oss-20b's 2880 are
    neither; which of the two costs it the block at 256 rows an expert was
    not measured apart."""
    _, columns = _block_shape(shared, shared.block_row_tiles, shared.block_tiles)
    return in_dims % shared.block_stage_values == 0 and out_dims % columns == 0


@lru_cache(maxsize=64)
def _decided_tiling(tiling: GroupedQmmTiling, shared_weights: bool,
                    row_tiles: int = SHARED_WEIGHTS_TILING["block_row_tiles"],
                    max_groups: int | None = None) -> GroupedQmmTiling:
    """`tiling` in SHARED_WEIGHTS_TILING's block of `row_tiles` 8-row tiles
    and `max_groups` groups at most (None: its block_max_groups), or else
    with block_warpgroup 0 and its block of `row_tiles` (the ungated and the
    not tall gated blocks'), made once a tiling: a launch is built at every
    uncompiled call, where a new dataclass a call would cost several times
    the rest of the launch."""
    return replace(tiling, **dict(SHARED_WEIGHTS_TILING, block_row_tiles=row_tiles,
                                  block_gated_row_tiles=row_tiles,
                                  block_stages=tiling.block_shared_stages
                                  or SHARED_WEIGHTS_TILING["block_stages"],
                                  block_max_groups=max_groups or tiling.block_max_groups)) \
        if shared_weights else replace(tiling, block_warpgroup=0, block_row_tiles=row_tiles)


def _store_template(store: tuple[bool, tuple[float, float] | None]) -> tuple:
    """The template constants of qmm_store.h, which either body takes alike
    and no tiling depends on, for `store`: (out_bias, clamped_swiglu)."""
    out_bias, clamped_swiglu = store
    alpha, limit = clamped_swiglu or (0.0, 0.0)
    return (("OUT_BIAS", out_bias), ("CLAMPED", clamped_swiglu is not None),
            ("ALPHA_BITS", _float_bits(alpha)), ("LIMIT_BITS", _float_bits(limit)))


def _float_bits(value: float) -> int:
    """A float32's bits as the int32 a template constant holds (the bodies
    read it back with BITS_TO_FLOAT)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def grouped_qmm_body(capacity: int, num_experts: int) -> str:
    """The body `grouped_qmm_launch` runs for a plan of `capacity` rows over
    `num_experts` experts, in the current tiling: grouped_qmm_tiles.h from
    its `tiles_from_rows` rows an expert on average, else grouped_qmm.h."""
    tiling = _grouped_qmm_tiling.get()
    return ("grouped_qmm_tiles" if capacity >= tiling.tiles_from_rows * num_experts
            else "grouped_qmm")


def _tall_gated_blocks(gated: bool, backend: str, bits: int, quant_group: int, capacity: int,
                       num_experts: int, tiling: GroupedQmmTiling) -> bool:
    """Whether grouped_qmm_tiles.h's launch takes the tiling's
    `block_gated_row_tiles` (tall blocks): gated, not on Metal, from
    `block_gated_tall_rows` rows an expert on average, 4 bits in groups of 64.

    Twice the rows a block (128 by 64 columns of gate and up, against 64 by
    64) make each weight made 16-bit serve twice the rows. Measured on the
    H200 (benchmarks/HISTORY.md, "Neighbour pairs and tall gated blocks"):
    1.13x and 1.23x faster at a capacity of 575 and 1088 rows an expert
    (Qwen3-30B-A3B's and gpt-oss-20b's T = 8192), 0.97x and 0.98x at 191 and
    320 (T = 2048), where more blocks are part empty. The sums then take half
    a warp's registers: ptxas (sm_90) fits 4 and 8 bits in groups of 64
    without spills, and spills 4 bits in groups of 32 (56 bytes) and of 128
    (284); only 4 bits in groups of 64 were timed. Metal keeps its blocks
    (none measured there)."""
    return (gated and backend != "metal" and (bits, quant_group) == (4, 64)
            and capacity >= tiling.block_gated_tall_rows * num_experts)


def _halved_blocks(gated: bool, backend: str, out_dims: int, capacity: int, dense: bool,
                   tiling: GroupedQmmTiling) -> bool:
    """Whether grouped_qmm_tiles.h's launch halves its block's rows and
    columns (32 by 64 in the default tiling): a dense projection, not gated,
    not on Metal, of at most `block_halved_up_to_rows` rows, whose full
    blocks number fewer than `block_halved_below_blocks`.

    That is a decoding batch of a dense projection (projections.py) of few
    columns: the full blocks give it a few dozen blocks (16 for 2048
    columns), each walking the whole input with its rows half empty, far
    from filling the GPU; four times the blocks fill it better. An lm_head's
    thousand blocks fill it already, and halved at 64 rows each weight is
    read by two row blocks: it ran slower (benchmarks/RESULTS.md, "Dense
    projections of a decoding batch", both measured). Experts fill the GPU
    with their own blocks, and an expert-parallel rank's single expert keeps
    the experts' blocks (none measured halved); Metal keeps its blocks (none
    measured there)."""
    if (gated or backend == "metal" or not dense
            or capacity > tiling.block_halved_up_to_rows):
        return False
    block_rows, block_columns = _block_shape(tiling, tiling.block_row_tiles, tiling.block_tiles)
    full_blocks = -(-out_dims // block_columns) * -(-capacity // block_rows)
    return full_blocks < tiling.block_halved_below_blocks


def _block_shape(tiling: GroupedQmmTiling, row_tiles: int, column_tiles: int) -> tuple[int, int]:
    """grouped_qmm_tiles.h's block, (BLOCK_ROWS, BLOCK_COLUMNS): the tiling's
    warps over the rows and columns, each of `row_tiles` 8-row by
    `column_tiles` 16-column multiply-add tiles."""
    return (tiling.block_row_warps * 8 * row_tiles,
            tiling.block_column_warps * 16 * column_tiles)


# The shared memory a group may declare in its body (grouped_qmm.h's arrays):
# CUDA's limit for static shared memory.
STATIC_SHARED_BYTES = 48 * 1024
# grouped_qmm.h's word ring (`word_stages`): a column's bytes a stage where the
# tiling leaves its steps to the launch, a whole line (benchmarks/RESULTS.md,
# "Loads alone": memory rewards runs of 128 bytes of a column and more).
RING_RUN_BYTES = 128
# The shared memory a group of the block tiles may take. Metal's 32 KB. On
# CUDA, 99 KB, past the 48 KB a group may declare statically (its stages are
# dynamic, SHARED_WORDS): the least of the sm_80-and-later GPUs' limits a
# group (sm_86 and sm_89), and two groups an SM on an A100, H100 or H200.
# The OpenCL tests run CUDA's sizes.
SHARED_BYTES = {"cuda": 99 * 1024, "metal": 32 * 1024, "opencl": 99 * 1024}
# The same for the blocks that make their weights in shared memory
# (`block_warpgroup=2`): one group an SM takes its most on CUDA (227 KB on
# sm_90, the only GPU that runs them), where their eight warps and the
# asynchronous multiply-adds keep it busy; two buffers of made weights
# besides the stages would leave two groups too few stages.
SHARED_WEIGHTS_BYTES = {"cuda": 227 * 1024, "metal": 32 * 1024, "opencl": 227 * 1024}
# SHARED_WEIGHTS' swizzled buffers start at a multiple of 1024 bytes (the
# swizzle's period), which the body finds within this much more memory.
SWIZZLE_ALIGN_BYTES = 1024


def _scan_memory_bytes(threads: int, exchange: bool) -> int:
    """The group memory both GEMM bodies declare before their own: the
    experts' list (MAX_EXPERTS ints), the group's scan (`threads`), and the
    emulated multiply-add's exchange (6 words a thread) where `exchange`."""
    return 4 * (MAX_EXPERTS + threads + (6 * threads if exchange else 0))


def _most_groups_dividing(row_groups: int, at_most: int) -> int:
    """The most quantization groups, up to `at_most`, that divide a row of
    `row_groups` (1 divides any)."""
    return max(g for g in range(1, max(1, min(at_most, row_groups)) + 1) if row_groups % g == 0)


def _stage_groups(row_groups: int, wanted: int) -> int:
    """A block tile's stage: the most quantization groups, up to `wanted`, that
    divide a row of `row_groups`; where those are at most half of `wanted`,
    the fewest above it that divide the row, up to twice `wanted`. A stage far
    below the values wanted pays a barrier and a round of copies for each few
    values (gpt-oss-20b's 45 groups of 64 against 2 wanted: 3 a stage in 2
    stages ran 1.07x to 1.11x faster than 1 in 3, benchmarks/HISTORY.md)."""
    below = _most_groups_dividing(row_groups, wanted)
    if 2 * below > wanted:
        return below
    return next((g for g in range(wanted + 1, min(2 * wanted, row_groups) + 1)
                 if row_groups % g == 0), below)


def _conflict_free_stride(least: int, slot_words: int, width: int) -> int:
    """The least stride of at least `least` 4-byte words, a multiple of 4 (the
    16-byte copies' alignment), at which one load of grouped_qmm_tiles.h's
    warp meets no shared-memory bank conflict: lane l loads `width` words
    (1, 2 or 4) at `(l // 4) * stride + (l % 4) * slot_words`, and a load of
    `width` words serves 32 / `width` lanes at once from 32 banks."""
    lanes = 32 // width
    for stride in range(_round_up(least, 4), _round_up(least, 4) + 64, 4):
        if all(len({((lane // 4) * stride + (lane % 4) * slot_words + word) % 32
                    for lane in range(first, first + lanes) for word in range(width)})
               == lanes * width for first in range(0, 32, lanes)):
            return stride
    return _round_up(least, 4)  # none within 16 steps: conflicts, not errors


# The pad after each of WARPGROUP's core matrices (8 rows of a 16-byte chunk of
# the input, 32 words): a pass of 8 lanes' 16-byte copies writes 8 chunks of
# one row, one in each of 8 core matrices; 4 words put them in 8 different
# sets of 4 banks, where unpadded they all took the same 4 (8-way conflicts).
CORE_MATRIX_PAD_WORDS = 4


def _made_weights_word_stride(least: int) -> int:
    """The least stride of at least `least` words, a multiple of 4, at which
    SHARED_WEIGHTS' 16-byte loads of the words meet no bank conflict: 8 lanes
    load 16 bytes each of 8 columns, a stride apart, so a stride of an odd
    number of 16-byte chunks puts them in 8 different sets of 4 banks."""
    stride = _round_up(least, 4)
    return stride if stride // 4 % 2 else stride + 4


def _warpgroup_word_stride(least: int, bits: int) -> int:
    """The least stride of at least `least` words, a multiple of 4, at which
    the warpgroup's word loads (tiles_products.h) meet no bank conflict: lane l
    loads one word of column l // 4, the same for its 4 lanes at 4 bits (a
    byte each) and one of two at 8 (half a word each); lanes of one address
    share its load."""
    for stride in range(_round_up(least, 4), _round_up(least, 4) + 64, 4):
        addresses = {(lane // 4) * stride + (lane % 4 // 2 if bits == 8 else 0)
                     for lane in range(32)}
        if len({address % 32 for address in addresses}) == len(addresses):
            return stride
    return _round_up(least, 4)


@lru_cache(maxsize=256)
def _grouped_qmm_tiles_launch(
    num_experts: int, in_dims: int, out_dims: int, capacity: int, bits: int,
    quant_group: int, dtype: str, num_rows: int | None, gated: bool, tiling: GroupedQmmTiling,
    shared_bytes: int, exchange: bool, tall: bool, halved: bool, splits_input: bool,
    dense: bool, store: tuple, warpgroup: int,
) -> Launch | None:
    """grouped_qmm_tiles.h's launch, None where no block fits `shared_bytes`;
    `warpgroup`: the tiling's `block_warpgroup`, the block's multiply-adds a
    warpgroup's (WARPGROUP; 2: SHARED_WEIGHTS) where the block allows it (4
    warps side by side, or 8 with SHARED_WEIGHTS, of WARPGROUP_ROW_TILES row
    tiles, or SHARED_WEIGHTS_ROW_TILES with SHARED_WEIGHTS);
    `tall`: the gated block of `block_gated_row_tiles` (_tall_gated_blocks);
    `halved`: half the block's rows and columns (_halved_blocks);
    `splits_input`: the blocks' input split where they are few (_input_splits),
    by default a `dense` projection's only;
    `store`: `_store_template`'s."""
    values = 32 // bits
    lane_words = quant_group // (4 * values)
    row_groups = in_dims // quant_group
    groups_wanted = tiling.block_stage_values // quant_group
    stage_groups = _stage_groups(row_groups, groups_wanted)
    groups_up_to_wanted = _most_groups_dividing(row_groups, groups_wanted)
    threads = 32 * tiling.block_row_warps * tiling.block_column_warps
    # SPECIALIZED's making warpgroups, where the made weights' block may be
    # taken (else none, below)
    producers = tiling.block_specialized if (
        warpgroup == 2 and not tiling.block_weights_ahead and not tiling.block_across_items) \
        else 0
    matrices = 2 if gated else 1
    # Stages first, then their values, then the block's columns, then its
    # rows, until the shared memory fits (expert_blocks, group_scan, and the
    # emulated multiply-add's exchange where a prelude uses it, of the making
    # warpgroup's threads too where the block is the made weights').
    column_tiles = tiling.block_gated_tiles if gated else tiling.block_tiles
    row_tiles = tiling.block_gated_row_tiles if tall else tiling.block_row_tiles
    if halved:
        column_tiles, row_tiles = max(1, column_tiles // 2), max(1, row_tiles // 2)
    stages = tiling.block_stages
    while True:
        stage_values = stage_groups * quant_group
        shared_weights = (warpgroup == 2 and tiling.block_row_warps == 1
                          and tiling.block_column_warps in (4, 8) and column_tiles == 1
                          and row_tiles in SHARED_WEIGHTS_ROW_TILES and stages >= 3
                          and stage_values % 64 == 0)
        fixed = _scan_memory_bytes(threads + (128 * producers if shared_weights else 0),
                                   exchange)
        by_warpgroup = shared_weights or (
            warpgroup == 1 and (tiling.block_row_warps, tiling.block_column_warps) == (1, 4)
            and row_tiles in WARPGROUP_ROW_TILES)
        if shared_weights:  # the rows swizzled, 64 values (128 bytes) a row a slab
            row_stride = stage_values // 2
            word_stride = _made_weights_word_stride(stage_values // values)
        elif by_warpgroup:  # the rows in core matrices, each padded
            row_stride = stage_values // 8 * (32 + CORE_MATRIX_PAD_WORDS) // 8
            word_stride = _warpgroup_word_stride(stage_values // values, bits)
        else:
            row_stride = _conflict_free_stride(stage_values // 2, quant_group // 8, values // 2)
            word_stride = _conflict_free_stride(stage_values // values, lane_words,
                                                min(lane_words, 4))
        block_rows, block_columns = _block_shape(tiling, row_tiles, column_tiles)
        stage_bytes = 4 * (block_rows * row_stride + matrices * block_columns * word_stride
                           + 2 * matrices * block_columns * stage_groups)
        # SHARED_WEIGHTS' two buffers of made weights, 16 bits a value, and the
        # room to align the swizzled buffers
        made_bytes = (2 * 2 * matrices * block_columns * stage_values + SWIZZLE_ALIGN_BYTES
                      if shared_weights else 0)
        # the ring of begun items' places (grouped_qmm_tiles.h's item_places)
        ring_bytes = 4 * 3 * (stages + 1)
        if fixed + ring_bytes + stages * stage_bytes + made_bytes <= shared_bytes:
            break
        # The made weights' smaller stages start again from the stages
        # wanted: with one fewer in flight than the others (AHEAD), the 3
        # they fell to keep one stage of copies in flight, which at 64 values
        # a row leaves much of the memory unused; by the rule an ungated
        # launch's from more (UNGATED_MADE_SMALLER_STAGES).
        smaller_stages = UNGATED_MADE_SMALLER_STAGES if (
            shared_weights and tiling.block_shared_stages is None and not gated) \
            else tiling.block_stages
        if stages > (3 if shared_weights else 2):
            stages -= 1
        elif stage_groups > groups_up_to_wanted:  # above the values wanted: those, all stages
            stage_groups, stages = groups_up_to_wanted, smaller_stages
        elif stage_groups > 1:  # the next smaller count that divides the row
            stage_groups = stage_groups // 2 if stage_groups % 2 == 0 else \
                _most_groups_dividing(row_groups, stage_groups - 1)
            if shared_weights:
                stages = smaller_stages
        elif column_tiles > 1:
            column_tiles //= 2
        elif row_tiles > 1:
            row_tiles //= 2
        else:  # Metal's 32 KB, 8 bits in groups of 128: grouped_qmm.h runs it
            return None
    if not shared_weights:
        producers = 0
    column_blocks = -(-out_dims // block_columns)
    # Row blocks at least (every row in one), and at most: a plan's spans and
    # its tail are E + 1 runs of rows summing to the capacity, and each run
    # past the first adds at most one partial block, a run of a row at least.
    # Groups past the items scan the counts and exit; offsets that are no
    # plan's may make more items, which the groups then take several each.
    # block_least_groups launches the least: no group without an item.
    least_row_blocks = -(-capacity // block_rows)
    row_blocks = least_row_blocks if tiling.block_least_groups else \
        least_row_blocks + min(num_experts, capacity - 1)
    splits = 1 if not splits_input or producers else _input_splits(
        dense, least_row_blocks * column_blocks, row_groups // stage_groups, tiling)
    out = ((capacity, out_dims), dtype) if splits == 1 else \
        ((splits, capacity, out_dims), "float32")
    return Launch(
        "grouped_qmm_roles" if producers else "grouped_qmm_tiles",
        min(splits * row_blocks * column_blocks, tiling.block_max_groups),
        threads + 128 * producers,
        GroupedQmmParams(num_experts=num_experts, in_dims=in_dims, out_dims=out_dims,
                         capacity=capacity, column_blocks=column_blocks,
                         num_rows=capacity if num_rows is None else num_rows),
        (("InT", dtype), ("OutT", out[1]), ("IN_KIND", ROW_KINDS.index(dtype)),
         ("BITS", bits), ("VALUES", values), ("QUANT_GROUP", quant_group),
         ("LANE_WORDS", lane_words), ("THREADS", threads + 128 * producers),
         ("MAX_EXPERTS", MAX_EXPERTS),
         ("TILES", column_tiles * matrices), ("ROW_TILES", row_tiles),
         ("GATED", gated), ("TOKEN_ROWS", num_rows is not None),
         ("ROW_WARPS", tiling.block_row_warps), ("COLUMN_WARPS", tiling.block_column_warps),
         ("BLOCK_ROWS", block_rows), ("BLOCK_COLUMNS", block_columns),
         ("STAGE_GROUPS", stage_groups), ("STAGES", stages), ("ROW_STRIDE", row_stride),
         ("WORD_STRIDE", word_stride), ("INPUT_SPLITS", splits), ("WARPGROUP", by_warpgroup),
         ("SHARED_WEIGHTS", shared_weights),
         ("WEIGHTS_AHEAD", shared_weights and bool(tiling.block_weights_ahead)),
         ("ACROSS_ITEMS", splits == 1 and bool(tiling.block_across_items)),
         ("PRODUCER_WARPGROUPS", producers),
         *zip(("MMA_REGISTERS", "MAKING_REGISTERS"),
              _role_registers(threads, producers, column_tiles * matrices * row_tiles * 4)),
         *_store_template(store)),
        (out,),
        _dynamic_shared_bytes(fixed + ring_bytes, stages * stage_bytes + made_bytes),
        1 if producers else _min_groups(tiling, block_rows, in_dims, bits, shared_weights,
                                        dense or by_warpgroup or tall),
    )


# SPECIALIZED's multiplying warps' registers a thread beyond their sums (a
# register a sum: wgmma's accumulators), for its descriptors, places and the
# store's work: at 224 (192 rows, gated) and at 192 (160) nvcc 13.0 spilled
# none of theirs.
MMA_SPARE_REGISTERS = 32
MOST_REGISTERS = 248  # of a thread that WARP_REGISTERS gives (255 at most, 8 at a time)


def _role_registers(mma_threads: int, producers: int, sums: int) -> tuple[int, int]:
    """SPECIALIZED's (MMA_REGISTERS, MAKING_REGISTERS): the registers a thread
    of the multiplying warps (`mma_threads`, `sums` sums each) and of the
    `producers` making warpgroups take (WARP_REGISTERS) where one group an
    SM of both leaves a thread fewer than the multiplying warps need, their
    sums and MMA_SPARE_REGISTERS: those, and the making ones the rest of what
    the launch gave the group; else (0, 0), the launch's own.

    The rest of the group's, not of the SM's: a warp that asks for more
    (setmaxnreg.inc) waits until others have given back as many, and the
    group holds only what it was launched with (a thread's registers at
    launch, 8 at a time, times its threads; 64512 of 384 threads). Split from
    the SM's 65536, the multiplying warps waited for ever (on an H100)."""
    threads = mma_threads + 128 * producers
    launch_registers = REGISTER_FILE // threads // 8 * 8
    mma = min(MOST_REGISTERS, _round_up(sums + MMA_SPARE_REGISTERS, 8))
    if not producers or mma <= launch_registers:
        return 0, 0
    return mma, min(MOST_REGISTERS, (launch_registers * threads - mma_threads * mma)
                    // (128 * producers) // 8 * 8)


# The weights' bits whose launches `block_min_groups` binds: those it was timed at.
MIN_GROUPS_BITS = (4,)


def _min_groups(tiling: GroupedQmmTiling, block_rows: int, in_dims: int, bits: int,
                shared_weights: bool, unbound: bool) -> int:
    """The tiles launch's `Launch.min_groups`: the tiling's
    `block_shared_min_groups` for the made weights' block (`shared_weights`);
    else its `block_min_groups` for the warps' own block of experts (not
    `unbound`: a dense projection's, a warpgroup's, the tall gated block's) of
    up to `block_min_groups_up_to_rows` rows and
    `block_min_groups_up_to_in_dims` input values, at `MIN_GROUPS_BITS`; else 0."""
    if shared_weights:
        return tiling.block_shared_min_groups
    if unbound or bits not in MIN_GROUPS_BITS \
            or block_rows > tiling.block_min_groups_up_to_rows \
            or in_dims > tiling.block_min_groups_up_to_in_dims:
        return 0
    return tiling.block_min_groups


# A split of a block tile's input walks this many stages at least.
SPLIT_LEAST_STAGES = 2


def _input_splits(dense: bool, blocks: int, all_stages: int,
                  tiling: GroupedQmmTiling) -> int:
    """grouped_qmm_tiles.h's INPUT_SPLITS for `blocks` blocks (the fewest
    the plan's rows can take) of `all_stages` stages each: the tiling's
    `block_input_splits` where given (at most `all_stages`); else, for a
    dense projection (`dense`), the fewest, doubling, that reach
    `block_split_below_groups` groups, each split `SPLIT_LEAST_STAGES`
    stages or more; else 1.

    A block walks its whole input, one stage after another, each a wait on
    memory; a launch of a few dozen blocks (a dense projection of a decoding
    batch: 32 of Qwen3-30B-A3B's attention output at 32 rows, halved) leaves
    most of the GPU idle and each block's chain long. Splitting shortens the
    chains and multiplies the groups; the splits' float sums cost a write
    and a read of `splits` floats an output (combine.h adds them). Experts
    are not split unless the tiling says so: their launches have blocks
    enough from a few hundred rows (Mixtral's, of 8 experts, below about
    256 tokens have not), none measured split; nor is an expert-parallel
    rank's single expert."""
    if tiling.block_input_splits is not None:
        return max(1, min(tiling.block_input_splits, all_stages))
    if not dense:
        return 1
    splits = 1
    while (blocks * splits < tiling.block_split_below_groups
           and all_stages // (2 * splits) >= SPLIT_LEAST_STAGES):
        splits *= 2
    return splits


def _word_ring(tiling: GroupedQmmTiling, threads: int, tiles: int, group_words: int,
               lane_words: int, row_groups: int,
               free_bytes: int) -> tuple[int, int, int, int] | None:
    """grouped_qmm.h's word ring for `tiling.word_stages`: (WORD_STAGES, STEPS,
    WORD_STRIDE, bytes) of a group of `threads` whose warps take `tiles` tiles
    of 16 columns, a column's quantization group `group_words` words of which
    a lane reads `lane_words` (2 at a time where even), within `free_bytes`;
    fewer stages, then shorter runs, until it fits; None where none does."""
    stages = tiling.word_stages
    steps = tiling.steps or min(max(1, RING_RUN_BYTES // (4 * group_words)), row_groups)
    while True:
        stride = _conflict_free_stride(steps * group_words, lane_words,
                                       2 if lane_words % 2 == 0 else 1)
        ring_bytes = 4 * threads // 32 * stages * tiles * 16 * stride
        if ring_bytes <= free_bytes:
            return stages, steps, stride, ring_bytes
        if stages > 2:
            stages -= 1
        elif steps > 1 and tiling.steps is None:
            steps //= 2
        else:
            return None


# A CUDA group's static and dynamic shared memory together pass 48 KB only
# where the kernel allows more dynamic memory than that, which MLX's
# cuda_kernel does when asked for more than 48,000 bytes.
CUDA_OPT_IN_BYTES = 48_001


def _dynamic_shared_bytes(static_bytes: int, dynamic_bytes: int) -> int:
    """The dynamic shared memory to ask for: `dynamic_bytes`, or
    CUDA_OPT_IN_BYTES where the two together pass 48 KB."""
    if static_bytes + dynamic_bytes > 48 * 1024:
        return max(dynamic_bytes, CUDA_OPT_IN_BYTES)
    return dynamic_bytes


@lru_cache(maxsize=256)
def _grouped_qmm_launch(
    num_experts: int, in_dims: int, out_dims: int, capacity: int, bits: int,
    quant_group: int, dtype: str, num_rows: int | None, gated: bool, tiling: GroupedQmmTiling,
    shared_bytes: int, store: tuple,
) -> Launch:
    column_tiles = tiling.gated_tiles if gated else tiling.tiles  # a warp's distinct columns
    row_groups = in_dims // quant_group
    # Experts with rows at most: as many as rows.
    k_splits = 1 if tiling.word_stages else tiling.k_splits or grouped_qmm_k_splits(
        min(num_experts, capacity), out_dims, 16 * column_tiles, tiling.threads // 32, row_groups)
    # The body's arrays: active_experts, group_scan, mma_exchange (declared on
    # every backend) and split_sums.
    threads, tiles = tiling.threads, column_tiles * (2 if gated else 1)
    memory = _scan_memory_bytes(threads, exchange=True) + 4 * (
        (threads - threads // k_splits) * tiles * tiling.row_tiles * 4 + 1)
    static_bytes = min(shared_bytes, STATIC_SHARED_BYTES)  # the arrays are declared, not dynamic
    if memory > static_bytes:
        raise ValueError(f"grouped_qmm tiling: {tiling} needs {memory} bytes of group memory"
                         f"{' gated' if gated else ''}, over the backend's {static_bytes}")
    columns = tiling.threads // 32 // k_splits * 16 * column_tiles
    column_blocks = -(-out_dims // columns)
    values = 32 // bits
    lane_words = quant_group // (4 * values)
    steps, loads_ahead = grouped_qmm_loads(row_groups, gated, k_splits)
    if tiling.steps is not None:  # the row's loads ahead go with the row's steps only
        steps, loads_ahead = tiling.steps, False
    if tiling.loads_ahead is not None:
        loads_ahead = bool(tiling.loads_ahead)
    word_stages, word_stride, ring_bytes = 0, 4, 0
    ring = tiling.word_stages and _word_ring(tiling, threads, tiles, quant_group // values,
                                             lane_words, row_groups, shared_bytes - memory)
    if ring:  # else none fits: each lane loads its own words, as without it
        word_stages, steps, word_stride, ring_bytes = ring
        loads_ahead = bool(tiling.loads_ahead)
    return Launch(
        "grouped_qmm", min((num_experts + 1) * column_blocks, tiling.max_groups), tiling.threads,
        GroupedQmmParams(num_experts=num_experts, in_dims=in_dims, out_dims=out_dims,
                         capacity=capacity, column_blocks=column_blocks,
                         num_rows=capacity if num_rows is None else num_rows),
        (("InT", dtype), ("OutT", dtype), ("IN_KIND", ROW_KINDS.index(dtype)), ("BITS", bits),
         ("VALUES", values), ("QUANT_GROUP", quant_group), ("LANE_WORDS", lane_words),
         ("THREADS", threads), ("MAX_EXPERTS", MAX_EXPERTS), ("K_SPLITS", k_splits),
         ("TILES", tiles), ("ROW_TILES", tiling.row_tiles),
         ("STEPS", steps), ("GATED", gated), ("TOKEN_ROWS", num_rows is not None),
         ("WIDE_LOADS", bool(tiling.wide_loads)), ("LOADS_AHEAD", loads_ahead),
         ("WORD_STAGES", word_stages), ("WORD_STRIDE", word_stride), *_store_template(store)),
        (((capacity, out_dims), dtype),),
        _dynamic_shared_bytes(memory, ring_bytes),
    )


# The longest row argsort_slice.h sorts: its keys are in shared memory (4 KB),
# and each thread compares its elements with the whole row. Routers' rows are
# their experts (MAX_EXPERTS at most).
ARGSORT_SLICE_MAX_ROW = MAX_EXPERTS


@lru_cache(maxsize=256)
def argsort_slice_launch(num_rows: int, row_size: int, start: int, count: int,
                         dtype: str, normalize: bool = False) -> Launch:
    """For `num_rows >= 1`, `1 <= row_size <= ARGSORT_SLICE_MAX_ROW`, `0 <= start`
    and `1 <= count` with `start + count <= row_size`, and values padded to 8
    elements (argsort_slice.h); with `normalize`, the slice's values over
    their sum."""
    return Launch(
        "argsort_slice", min(num_rows, MAX_GROUPS), min(256, _round_up(row_size, 32)),
        ArgsortSliceParams(num_rows=num_rows, row_size=row_size, start=start, count=count),
        (("InT", dtype), ("OutT", dtype), ("BitsT", _bits_type(dtype)),
         ("IN_KIND", ROW_KINDS.index(dtype)), ("MAX_ROW", ARGSORT_SLICE_MAX_ROW),
         ("NORMALIZE", bool(normalize))),
        (((num_rows, count), "uint32"), ((num_rows, count), dtype)),
    )


# The longest head head_norm_rope.h takes: a thread a pair of its values, one
# group a head.
HEAD_NORM_ROPE_MAX_HEAD = 2 * MAX_ROW_GROUP


@lru_cache(maxsize=256)
def head_norm_rope_launch(batch: int, length: int, q_heads: int, k_heads: int, head_dim: int,
                          q_row: int, q_at: int, k_row: int, k_at: int, per_sequence: bool,
                          eps: float, base: float, scale: float, dtype: str) -> Launch:
    """For `batch, length >= 1`, `q_heads + k_heads >= 1`, an even `head_dim` of
    at most HEAD_NORM_ROPE_MAX_HEAD, rows of queries_in (keys_in) of `q_row`
    (`k_row`) values holding the heads from `q_at` (`k_at`), and an offset
    a sequence (`per_sequence`) or one for all (head_norm_rope.h)."""
    rows = batch * length
    return Launch(
        "head_norm_rope", min(rows * (q_heads + k_heads), MAX_GROUPS),
        _round_up(head_dim // 2, 32),
        HeadNormRopeParams(rows=rows, length=length, q_heads=q_heads, k_heads=k_heads,
                           q_row=q_row, q_at=q_at, k_row=k_row, k_at=k_at,
                           offset_stride=int(per_sequence), eps_bits=_float_bits(eps),
                           log2_base_bits=_float_bits(math.log2(base)),
                           scale_bits=_float_bits(scale)),
        (("InT", dtype), ("OutT", dtype), ("HEAD_DIM", head_dim)),
        (((batch, q_heads, length, head_dim), dtype), ((batch, k_heads, length, head_dim), dtype)),
    )


# decode_attention.h's head sizes (a lane loads 16-byte runs of 8 values,
# the values' tiles come 64 dimensions at a time) and query heads a key-value
# head (the rows of the tensor cores' 16, and at most 1024 values of the
# group's merged rows in group memory a warp, 16 KB for its four).
DECODE_ATTENTION_HEAD_DIMS = (64, 128)
DECODE_ATTENTION_MAX_ROWS = 1024
DECODE_ATTENTION_DTYPES = ("float16", "bfloat16")
DECODE_ATTENTION_WARPS = 4
# Groups the keys' splits aim at: four an SM (TIMED_GPU_SMS) at heads of 64,
# so that a step of few sequences keeps enough loads in flight to meet the
# memory's latency (at heads of 128 three fit an SM, 168 registers a thread:
# 528 groups are then a wave and a third, as the benchmark's sketch ran them).
DECODE_ATTENTION_GROUPS = 4 * TIMED_GPU_SMS


def decode_attention_computes(head_dim: int, heads: int, kv_heads: int, dtype: str) -> bool:
    """Whether decode_attention.h takes these heads: `kv_heads` of `head_dim`
    values, each for the same number of query heads, at most 16 and 1024
    values in all, of a 16-bit `dtype`."""
    return (kv_heads >= 1 and heads % kv_heads == 0 and 1 <= heads // kv_heads <= 16
            and head_dim in DECODE_ATTENTION_HEAD_DIMS
            and heads // kv_heads * head_dim <= DECODE_ATTENTION_MAX_ROWS
            and dtype in DECODE_ATTENTION_DTYPES)


# Keys a group of decode_attention.h takes a step (16 a warp; the body's STEP,
# from its WARPS).
DECODE_ATTENTION_STEP = 16 * DECODE_ATTENTION_WARPS


def decode_attention_most_splits(batch: int, kv_heads: int) -> int:
    """The most splits of each sequence's key-value head: enough for
    `DECODE_ATTENTION_GROUPS` groups over the sequences' key-value heads
    (rounded up)."""
    return max(1, -(-DECODE_ATTENTION_GROUPS // (batch * kv_heads)))


def decode_attention_splits(batch: int, kv_heads: int, keys: int) -> int:
    """Splits of each sequence's key-value head for `keys >= 1` keys: whole
    steps of a group each, the same count of steps in each but the last,
    none empty, and at most `decode_attention_most_splits`. Few keys make
    few splits: with the groups' splits at every context, a short one left
    most of them empty, each still a group that writes its parts, and the
    merge read every one, one after another."""
    steps = -(-keys // DECODE_ATTENTION_STEP)
    steps_a_split = -(-steps // decode_attention_most_splits(batch, kv_heads))
    return -(-steps // steps_a_split)


@lru_cache(maxsize=256)
def decode_attention_launches(batch: int, heads: int, kv_heads: int, head_dim: int,
                              has_sinks: bool, scale: float, dtype: str,
                              has_mask: bool = False,
                              splits: int | None = None) -> tuple[Launch, Launch]:
    """decode_attention.h's launch, then decode_attention_merge.h's, for `batch
    >= 1` sequences of heads `decode_attention_computes` takes, with a mask
    or not (`has_mask`), each sequence's key-value head in `splits` splits of
    its keys (`decode_attention_splits`'; None: the most,
    `decode_attention_most_splits`, which takes any context, the last
    splits empty where the keys are few). The body reads the keys' count from
    the keys' shape: one pair of launches for every context of a split
    count."""
    sequences = batch * kv_heads
    if splits is None:
        splits = decode_attention_most_splits(batch, kv_heads)
    params = DecodeAttentionParams(batch=batch, heads=heads, kv_heads=kv_heads, splits=splits,
                                   scale_bits=_float_bits(scale))
    parts = batch * heads * splits
    in_kind = ROW_KINDS.index(dtype)
    return (
        Launch("decode_attention", min(sequences * splits, MAX_GROUPS),
               32 * DECODE_ATTENTION_WARPS, params,
               (("InT", dtype), ("IN_KIND", in_kind), ("D", head_dim),
                ("G", heads // kv_heads), ("WARPS", DECODE_ATTENTION_WARPS),
                ("HAS_MASK", bool(has_mask))),
               (((parts, head_dim), "float32"), ((parts,), "float32"), ((parts,), "float32"))),
        Launch("decode_attention_merge", min(batch * heads, MAX_GROUPS), head_dim, params,
               (("InT", dtype), ("OutT", dtype), ("D", head_dim),
                ("HAS_SINKS", bool(has_sinks))),
               (((batch, heads, 1, head_dim), dtype),)),
    )


# add_rms_norm.h's group: about 8 values a thread, from a warp to this many
# threads (a power of two, for its tree of sums).
ADD_RMS_NORM_MAX_GROUP = 256


@lru_cache(maxsize=256)
def add_rms_norm_launch(rows: int, dims: int, eps: float, dtype: str) -> Launch:
    """For `rows, dims >= 1` (add_rms_norm.h)."""
    threads = min(max(32, 1 << max(0, (dims - 1) // 8).bit_length()), ADD_RMS_NORM_MAX_GROUP)
    return Launch(
        "add_rms_norm", min(rows, MAX_GROUPS), threads,
        AddRmsNormParams(rows=rows, dims=dims, eps_bits=_float_bits(eps)),
        (("InT", dtype), ("OutT", dtype), ("THREADS", threads)),
        (((rows, dims), dtype), ((rows, dims), dtype)),
    )
