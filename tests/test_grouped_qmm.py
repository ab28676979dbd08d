# The grouped GEMM (kernels/grouped_qmm.h) on the GPU, through _gpu.py, against
# the float64 reference within the rounding of a float32 sum: every output
# poisoned first, experts with no rows, one, and more than a pass; its input
# gradient; compiled. The PoCL tests run the same body as OpenCL C on any
# machine (tests/test_kernels_pocl.py).

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import (_NO_GPU, EVERY_SIZE_MIN_GROUPS, OTHER_MADE_WEIGHTS_ROW_TILES,
                      SHARED_WEIGHTS_BLOCK, assert_gemm_close, check_grouped_qmm,
                      grouped_qmm_by_mlx_ops, grouped_qmm_case, grouped_qmm_cases,
                      quantized_experts, token_rows)
from hypothesis import given
from hypothesis import strategies as st
from mlx.utils import tree_map

from mlx_moe_plan import MAX_EXPERTS, _backend, _gpu, moe_plan
from mlx_moe_plan import reference as ref
from mlx_moe_plan.kernels import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_backend.gpu_backend() is None, reason=_NO_GPU)]


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(_gpu, "POISON", -7777.0)


def _as_mlx(values: np.ndarray, name: str) -> mx.array:
    if name == "bfloat16":
        return mx.array(values).view(mx.bfloat16)
    return mx.array(values)


def _run(offsets, weight, scales, biases, rows, row_experts, bits, group_size, name,
         dense=False):
    gpu = _gpu.for_backend(_backend.gpu_backend())
    return gpu.grouped_qmm(_as_mlx(rows, name), mx.array(weight), _as_mlx(scales, name),
                           _as_mlx(biases, name), mx.array(offsets), mx.array(row_experts),
                           bits=bits, group_size=group_size, stream=mx.default_stream(mx.gpu),
                           dense=dense)


def _run_fused(x, offsets, weight, scales, biases, row_experts, row_tokens, up, name):
    """The layer's fused form through _gpu.py: rows from the tokens `x` (an
    MLX array) by `row_tokens`, silu(gate) * up of `up`'s (weight, scales,
    biases); the rest as `_run` takes them."""
    gpu = _gpu.for_backend(_backend.gpu_backend())
    up_mx = tuple(mx.array(a) if a.dtype == np.uint32 else _as_mlx(a, name) for a in up)
    return gpu.grouped_qmm(x, mx.array(weight), _as_mlx(scales, name), _as_mlx(biases, name),
                           mx.array(offsets), mx.array(row_experts), bits=4, group_size=64,
                           stream=mx.default_stream(mx.gpu), row_tokens=mx.array(row_tokens),
                           up=up_mx)


def _check_fused_from_tokens(rng, counts, out_dims, in_dims, name, tokens=90):
    """The fused form (`_run_fused`, 4 bits in groups of 64) on experts of
    `counts` rows and 5 tail rows (-1), each row one of `tokens` random
    tokens, against the reference, in the tiling the caller has set."""
    offsets, weight, scales, biases, _, row_experts = grouped_qmm_case(
        rng, counts, out_dims, in_dims, 4, 64, name, 5)
    up = quantized_experts(rng, len(counts), out_dims, in_dims, 4, 64, name)
    row_tokens = np.concatenate([rng.integers(0, tokens, sum(counts)),
                                 np.full(5, -1)]).astype(np.int32)
    values = ref.from_float32(0.1 * rng.standard_normal((tokens, in_dims)).astype(np.float32),
                              name)
    out = _run_fused(_as_mlx(values, name), offsets, weight, scales, biases, row_experts,
                     row_tokens, up, name)
    assert_gemm_close(ref.to_numpy(out), token_rows(values, row_tokens), weight, scales, biases,
                      offsets, 4, 64, name, up=up)


@given(case=grouped_qmm_cases())
def test_matches_reference(case):
    seed, *arguments = case
    check_grouped_qmm(_run, np.random.default_rng(seed), *arguments)


@pytest.mark.parametrize("tokens", [512, 2048])
@pytest.mark.parametrize("in_dims,out_dims", [(2048, 768), (768, 2048)], ids=["gate", "down"])
def test_prefill_shapes(tokens, in_dims, out_dims):
    """Qwen3-30B-A3B's projections at prefill sizes, in block tiles
    (grouped_qmm_tiles.h): 32 and 128 rows an expert on average."""
    rng = np.random.default_rng(tokens)
    routed = np.stack([rng.choice(128, 8, replace=False) for _ in range(tokens)])
    counts = np.bincount(routed.reshape(-1), minlength=128)
    assert launch.grouped_qmm_body(tokens * 8, 128) == "grouped_qmm_tiles"
    check_grouped_qmm(_run, rng, counts, out_dims, in_dims, 4, 64, "bfloat16", 0)


@given(case=grouped_qmm_cases(), k_splits=st.sampled_from([2, 4]))
def test_split_rows_match_reference(case, k_splits):
    """Warps sharing rows (K_SPLITS), every case of test_matches_reference."""
    seed, *arguments = case
    with launch.grouped_qmm_tiling(k_splits=k_splits):
        check_grouped_qmm(_run, np.random.default_rng(seed), *arguments)


TILES_GRIDS = {"items": {}, "runs": dict(block_across_items=1, block_max_groups=3),
               "least": dict(block_least_groups=1)}


@pytest.mark.parametrize("grid", list(TILES_GRIDS))
@given(case=grouped_qmm_cases())
def test_tiles_match_reference(grid, case):
    """The block tiles, each item alone, (`runs`) each of 3 groups' items one
    run of stages (`block_across_items`), and (`least`) in the grid of the
    fewest items a plan makes (`block_least_groups`), its first groups
    taking the items past it."""
    seed, *arguments = case
    with launch.grouped_qmm_tiling(tiles_from_rows=0, **TILES_GRIDS[grid]):
        check_grouped_qmm(_run, np.random.default_rng(seed), *arguments)


@given(case=grouped_qmm_cases())
def test_tiles_bounded_match_reference(case):
    """The warps' own block compiled for 4 groups an SM (`block_min_groups`:
    on CUDA, launch bounds that leave a thread 128 registers, some of its
    values then spilled to memory), at every size (`EVERY_SIZE_MIN_GROUPS`)."""
    seed, *arguments = case
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_warpgroup=0, block_min_groups=4,
                                   **EVERY_SIZE_MIN_GROUPS):
        check_grouped_qmm(_run, np.random.default_rng(seed), *arguments)


@pytest.mark.parametrize("groups", [3, 4])
def test_tiles_bounded_fused_match_reference(groups):
    """The same for the fused gate and up in blocks of 48 rows (Qwen3-Next's
    at T = 2048), whose registers the bound spills: experts of 0 to 100 rows,
    full and part-empty blocks, against the reference."""
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_warpgroup=0, block_fitted_rows=0,
                                   block_row_tiles=6, block_min_groups=groups,
                                   **EVERY_SIZE_MIN_GROUPS):
        _check_fused_from_tokens(np.random.default_rng(groups), [48, 1, 0, 47, 100, 30], 256,
                                 512, "bfloat16")


needs_warpgroup = pytest.mark.skipif(
    not _gpu.warpgroup_mma(),
    reason="the GPU has no warpgroup multiply-add (Hopper's wgmma, compute capability 9.0)")


# wgmma's block tiles: A from the warps' registers (`block_warpgroup=1`), or
# both operands from shared memory, the weights made there (SHARED_WEIGHTS),
# by one warpgroup or two (the rule's block).
WARPGROUP_BLOCKS = {"registers": dict(block_warpgroup=1), "shared": SHARED_WEIGHTS_BLOCK,
                    "shared-2": launch.SHARED_WEIGHTS_TILING}
# And the made weights' blocks of 48, 80, 96, 160 and 192 rows (wgmma's N of as
# many), and the weights made a step ahead of their multiply-adds
# (WEIGHTS_AHEAD).
MADE_WEIGHTS_ROWS = tuple(8 * row_tiles for row_tiles in OTHER_MADE_WEIGHTS_ROW_TILES)
WARPGROUP_FORMS = {**WARPGROUP_BLOCKS,
                     **{f"shared-{rows}": dict(launch.SHARED_WEIGHTS_TILING,
                                               block_row_tiles=rows // 8,
                                               block_gated_row_tiles=rows // 8)
                        for rows in MADE_WEIGHTS_ROWS},
                     "shared-ahead": dict(launch.SHARED_WEIGHTS_TILING, block_weights_ahead=1),
                     # 3 groups taking every item in turn, as the rule's capped
                     # grid (block_shared_max_groups) takes a prefill's
                     "shared-capped": dict(launch.SHARED_WEIGHTS_TILING, block_max_groups=3),
                     # each of 3 groups' items one run of stages (ACROSS_ITEMS)
                     "registers-runs": dict(block_warpgroup=1, block_across_items=1,
                                            block_max_groups=3),
                     "shared-runs": dict(launch.SHARED_WEIGHTS_TILING, block_across_items=1,
                                         block_max_groups=3),
                     # the grid of the fewest items a plan makes (block_least_groups)
                     "shared-least": dict(launch.SHARED_WEIGHTS_TILING, block_least_groups=1),
                     # the rule's one-warpgroup block, bound to 3 groups an SM
                     "one-warpgroup": launch.ONE_WARPGROUP_TILING,
                     # a warpgroup more that copies and makes the weights
                     # (PRODUCER_WARPGROUPS), for one multiplying warpgroup or two
                     "specialized": dict(launch.SHARED_WEIGHTS_TILING, block_specialized=1),
                     "specialized-one": dict(launch.SHARED_WEIGHTS_TILING, block_specialized=1,
                                             block_column_warps=4)}


@needs_warpgroup
@pytest.mark.parametrize("form", WARPGROUP_FORMS)
@given(case=grouped_qmm_cases())
def test_warpgroup_tiles_match_reference(form, case):
    """The block tiles through wgmma (`block_warpgroup`): every format, empty
    and uneven experts, rows of 1 to 4 quantization groups."""
    seed, *arguments = case
    with launch.grouped_qmm_tiling(tiles_from_rows=0, **WARPGROUP_FORMS[form]):
        check_grouped_qmm(_run, np.random.default_rng(seed), *arguments)


@needs_warpgroup
@pytest.mark.parametrize("rows", [128, 160, 192])
@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_specialized_made_weights(rows, name):
    """The made weights with a warpgroup that only copies and makes them
    (`block_specialized`), in blocks of 128 rows (every thread's registers
    the launch's) and of 160 and 192 (each role's its own, WARP_REGISTERS), at
    Qwen3-30B-A3B's shapes as test_warpgroup_tiles_made_weights_forms takes
    them: its down projection and its fused gate and up from tokens, experts
    of 1 to 400 rows, full and part-empty blocks, against the reference."""
    rng = np.random.default_rng(73)
    tiling = dict(launch.SHARED_WEIGHTS_TILING, block_row_tiles=rows // 8,
                  block_gated_row_tiles=rows // 8, block_specialized=1)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, **tiling):
        for gated, in_dims in ((False, 768), (True, 2048)):
            made = launch.grouped_qmm_launch(6, in_dims, 2048, 1000, 4, 64, name, backend="cuda",
                                             gated=gated, warpgroup=True)
            template = dict(made.template)
            assert template["PRODUCER_WARPGROUPS"] == 1 and template["BLOCK_ROWS"] == rows
            assert made.group_size == 384 and made.min_groups == 1
            assert bool(template["MMA_REGISTERS"]) == (gated and rows > 128)
        counts = [rows, 1, 0, rows - 1, 400, 130]
        check_grouped_qmm(_run, rng, counts, 2048, 768, 4, 64, name, 3)
        _check_fused_from_tokens(rng, counts, 768, 2048, name)


@needs_warpgroup
@pytest.mark.parametrize("form", [*(f"shared-{rows}" for rows in MADE_WEIGHTS_ROWS),
                                  "shared-ahead"])
@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_warpgroup_tiles_made_weights_forms(form, name):
    """The made weights' blocks of 80 to 192 rows, which the rule sizes to an
    expert's rows (launch._shared_weights_row_tiles), and the weights made a
    step ahead of their multiply-adds, which no rule takes (6 and 32 stages),
    at Qwen3-30B-A3B's shapes. Its down projection (768 values in, 2048
    out; in blocks of 192 rows the rule's 5 stages of 64 values,
    UNGATED_MADE_SMALLER_STAGES) and its fused gate and up (rows from
    tokens, silu(gate) * up), experts of 1 to 400 rows, full and part-empty
    blocks, against the reference."""
    block_rows = 128 if form == "shared-ahead" else int(form.removeprefix("shared-"))
    rng = np.random.default_rng(71)
    with launch.grouped_qmm_tiling(tiles_from_rows=0, **WARPGROUP_FORMS[form]):
        for gated, in_dims in ((False, 768), (True, 2048)):
            template = dict(launch.grouped_qmm_launch(6, in_dims, 2048, 1000, 4, 64, name,
                                                      backend="cuda", gated=gated,
                                                      warpgroup=True).template)
            assert template["SHARED_WEIGHTS"] and template["BLOCK_ROWS"] == block_rows
            assert template["WEIGHTS_AHEAD"] == (form == "shared-ahead")
            if block_rows == 192:
                assert template["STAGES"] == (3 if gated else launch.UNGATED_MADE_SMALLER_STAGES)
        counts = [block_rows, 1, 0, block_rows - 1, 400, 130]
        check_grouped_qmm(_run, rng, counts, 2048, 768, 4, 64, name, 3)
        _check_fused_from_tokens(rng, counts, 768, 2048, name)


@needs_warpgroup
@pytest.mark.parametrize("form", WARPGROUP_BLOCKS)
@pytest.mark.parametrize("name", ["bfloat16", "float16"])
@pytest.mark.parametrize("in_dims,tall", [(2048, False), (2880, False), (2048, True)],
                         ids=["qwen", "gpt-oss", "tall"])
def test_warpgroup_tiles_fused(form, name, in_dims, tall):
    """wgmma's block tiles at model rows (gpt-oss-20b's 45 groups, 3 a stage),
    rows from tokens, silu(gate) * up, in blocks of 64 rows and of 128: its
    A fragments or made weights, core matrices and descriptors against the
    reference; experts' last blocks of 12, 44, 82 and 122 rows in the tall
    blocks."""
    counts = [300, 0, 140, 1, 210, 250]
    block = {**WARPGROUP_BLOCKS[form], "block_row_tiles": 8}
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_gated_tall_rows=0 if tall else 512,
                                   **block):
        template = dict(launch.grouped_qmm_launch(len(counts), in_dims, 200, sum(counts) + 5, 4,
                                                  64, name, backend="cuda", gated=True,
                                                  num_rows=90, warpgroup=True).template)
        assert template["WARPGROUP"] and template["BLOCK_ROWS"] == (128 if tall else 64)
        assert template["SHARED_WEIGHTS"] == (form != "registers")
        _check_fused_from_tokens(np.random.default_rng(67), counts, 200, in_dims, name)


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_tiles_odd_stage_groups(name):
    """Block tiles over gpt-oss-20b's rows of 45 quantization groups of 64,
    which the default launch stages 3 at a time in 2 stages."""
    with launch.grouped_qmm_tiling(tiles_from_rows=0):
        template = dict(launch.grouped_qmm_launch(4, 2880, 200, 204, 4, 64, name,
                                                  backend="cuda").template)
        assert (template["STAGE_GROUPS"], template["STAGES"]) == (3, 2)
        check_grouped_qmm(_run, np.random.default_rng(5), [70, 0, 130, 1], 200, 2880, 4, 64,
                          name, 3)


@pytest.mark.parametrize("tokens", [1, 8, 32])
@pytest.mark.parametrize("in_dims,out_dims", [(2048, 768), (768, 2048)], ids=["gate", "down"])
def test_decoding_shapes(tokens, in_dims, out_dims):
    """Qwen3-30B-A3B's projections (128 experts, 8 a token) as a decode step
    routes them: most experts empty at batch 1, a few rows each at 32."""
    rng = np.random.default_rng(tokens)
    routed = np.stack([rng.choice(128, 8, replace=False) for _ in range(tokens)])
    counts = np.bincount(routed.reshape(-1), minlength=128)
    check_grouped_qmm(_run, rng, counts, out_dims, in_dims, 4, 64, "bfloat16", 0)


@pytest.mark.parametrize("rows", [1, 2, 8, 17, 32, 50, 64])
@pytest.mark.parametrize("in_dims,out_dims,k_splits", [(2048, 4096, None), (2880, 2880, None),
                                                       (2880, 2880, 2), (4096, 2048, 4)],
                         ids=["q-auto", "o-uneven-auto", "o-uneven-2", "o-4"])
def test_dense_projection_as_one_expert(rows, in_dims, out_dims, k_splits):
    """A dense projection of a decoding batch as one expert, its warps sharing
    the rows' quantization groups (K_SPLITS, by the launch where not given):
    45 groups a row split unevenly, a block of columns past out_dims; from 32
    rows the block tiles, halved (32 rows by 64 columns: launch._halved_blocks),
    a block part empty at 50 rows, each block's input split among groups
    (INPUT_SPLITS), as `dense` asks."""
    rng = np.random.default_rng(rows)
    with launch.grouped_qmm_tiling(k_splits=k_splits):
        qmm = launch.grouped_qmm_launch(1, in_dims, out_dims, rows, 4, 64, "bfloat16",
                                        backend="cuda", dense=True)
        template = dict(qmm.template)
        if qmm.body == "grouped_qmm":
            assert template["K_SPLITS"] > 1
        else:
            assert (template["BLOCK_ROWS"], template["BLOCK_COLUMNS"]) == (32, 64)
            assert template["INPUT_SPLITS"] > 1
        check_grouped_qmm(functools.partial(_run, dense=True), rng, [rows], out_dims, in_dims,
                          4, 64, "bfloat16", 0)


@pytest.mark.parametrize("rows", [512, 700])
@pytest.mark.parametrize("in_dims,out_dims", [(2048, 4096), (2880, 2880), (2048, 512)],
                         ids=["q", "o-uneven", "kv"])
def test_dense_prefill_as_one_expert(rows, in_dims, out_dims):
    """A dense projection of a prefill's rows as one expert, as
    `patch_model(dense=True)` runs it: from `block_shared_dense_rows` rows the
    made weights' block where the GPU has wgmma, the input split among groups
    where blocks are few; at 700 rows a block part empty, and 2880 values a
    row end in part of a stage and 2880 columns in part of a block."""
    rng = np.random.default_rng(rows + out_dims)
    qmm = launch.grouped_qmm_launch(1, in_dims, out_dims, rows, 4, 64, "bfloat16",
                                    backend="cuda", dense=True, warpgroup=_gpu.warpgroup_mma())
    assert dict(qmm.template)["SHARED_WEIGHTS"] == int(_gpu.warpgroup_mma())
    check_grouped_qmm(functools.partial(_run, dense=True), rng, [rows], out_dims, in_dims,
                      4, 64, "bfloat16", 0)


@pytest.mark.parametrize("field,steps,value", [("wide_loads", None, 1), ("wide_loads", 2, 1),
                                               ("wide_loads", 4, 1), ("loads_ahead", 1, 1),
                                               ("loads_ahead", 2, 1), ("word_stages", 4, 3),
                                               ("word_stages", 2, 2)])
@pytest.mark.parametrize("in_dims,out_dims", [(2048, 768), (768, 2048), (2880, 2880)],
                         ids=["gate", "down", "gpt-oss"])
def test_tiling_fields_change_no_bit(field, steps, value, in_dims, out_dims):
    """A lane's words and its steps' scales read in one load each or one by
    one (the tiling's `wide_loads`), a pass's loads issued for the next pass
    before its multiply-adds or for its own (`loads_ahead`), the words
    through a warp's ring in group memory or the lanes' own loads
    (`word_stages`): the same values, the same sums, the same bits.
    Qwen3-30B-A3B's projections at batch 32 (rows of 32 and 12 groups, which
    2 and 4 steps cover evenly) and gpt-oss-20b's (45 groups; a row the steps
    do not cover, where the scales load one by one and the ring's last stage
    lies partly past the row, is also test_kernels_pocl.py's
    test_grouped_qmm_fused_wide_rows, 33 groups)."""
    rng = np.random.default_rng(steps or 1)
    routed = np.stack([rng.choice(128, 8, replace=False) for _ in range(32)])
    counts = np.bincount(routed.reshape(-1), minlength=128)
    case = grouped_qmm_case(rng, counts, out_dims, in_dims, 4, 64, "bfloat16", 3)
    outs = []
    for changes in ({field: 0}, {field: value}):
        with launch.grouped_qmm_tiling(steps=steps, **changes):
            outs.append(ref.to_numpy(_run(*case, 4, 64, "bfloat16")))
    assert np.array_equal(outs[0], outs[1])
    offsets, weight, scales, biases, rows, _ = case
    assert_gemm_close(outs[1], rows, weight, scales, biases, offsets, 4, 64, "bfloat16")


@pytest.mark.parametrize("active", [1, 5, 300, MAX_EXPERTS])
def test_more_items_than_groups(active):
    """Up to MAX_EXPERTS experts, with more (expert, columns) items than the
    grid has groups: each group lists the experts with rows and takes several."""
    rng = np.random.default_rng(active)
    counts = np.zeros(MAX_EXPERTS, np.int64)
    counts[rng.choice(MAX_EXPERTS, active, replace=False)] = rng.integers(1, 11, active)
    check_grouped_qmm(_run, rng, counts, 72, 32, 8, 32, "float16", 2)


def test_input_gradient_and_compile():
    """d rows = cotangent @ dequantize(weight[e]) for each row; compiled, the
    same bits as uncompiled; two runs, the same bits."""
    rng = np.random.default_rng(9)
    case = grouped_qmm_case(rng, [3, 0, 11, 1], 24, 128, 4, 64, "float16", 2)
    offsets, weight, scales, biases, rows, row_experts = case
    arrays = [mx.array(offsets), mx.array(weight), mx.array(scales), mx.array(biases),
              mx.array(rows), mx.array(row_experts)]
    cotangent = mx.array(rng.standard_normal((rows.shape[0], 24)).astype(np.float16))
    gpu = _gpu.for_backend(_backend.gpu_backend())

    def loss(rows, offsets, weight, scales, biases, row_experts):
        out = gpu.grouped_qmm(rows, weight, scales, biases, offsets, row_experts, bits=4,
                              group_size=64, stream=mx.default_stream(mx.gpu))
        return (out * cotangent).sum()

    offsets_mx, weight_mx, scales_mx, biases_mx, rows_mx, experts_mx = arrays
    grad = mx.grad(loss)(rows_mx, offsets_mx, weight_mx, scales_mx, biases_mx, experts_mx)
    dense = ref.dequantize(weight, scales, biases, 4, 64)
    expected = np.zeros(rows.shape)
    for row, expert in enumerate(row_experts):
        expected[row] = np.array(cotangent)[row].astype(np.float64) @ dense[expert]
    # MLX's gather_qmm in float16: within float16 rounding of the largest term.
    bound = 2.0**-10 * (np.abs(np.array(cotangent, np.float64)) @ np.abs(dense[0])).max()
    np.testing.assert_allclose(np.array(grad, np.float64), expected, rtol=2.0**-10, atol=bound)

    def forward(rows):
        return gpu.grouped_qmm(rows, weight_mx, scales_mx, biases_mx, offsets_mx, experts_mx,
                               bits=4, group_size=64, stream=mx.default_stream(mx.gpu))

    eager, again = forward(rows_mx), forward(rows_mx)
    compiled = mx.compile(forward)(rows_mx)
    assert np.array_equal(np.array(eager), np.array(compiled))
    assert np.array_equal(np.array(eager), np.array(again))


def _routed_gate_up(rng, tokens, num_experts, top_k, out_dims, in_dims):
    """A layer's gate and up projections (bfloat16, 4 bits in groups of 64) of
    `tokens` routed each to `top_k` distinct experts: the plan's spans with 5
    tail rows, the gate's matrices, the up projection's (NumPy and MLX), the
    rows' tokens (tail rows -1) and the tokens' values."""
    routed = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)])
    counts = np.bincount(routed.reshape(-1), minlength=num_experts)
    offsets, weight, scales, biases, _, row_experts = grouped_qmm_case(
        rng, counts, out_dims, in_dims, 4, 64, "bfloat16", 5)
    up = quantized_experts(rng, num_experts, out_dims, in_dims, 4, 64, "bfloat16")
    up_mx = tuple(_as_mlx(a, "bfloat16") if a.dtype != np.uint32 else mx.array(a) for a in up)
    order = np.argsort(routed.reshape(-1), kind="stable")
    row_tokens = np.concatenate([order // top_k, np.full(5, -1)]).astype(np.int32)
    values = ref.from_float32(rng.standard_normal((tokens, in_dims)).astype(np.float32),
                              "bfloat16")
    return offsets, weight, scales, biases, row_experts, up, up_mx, row_tokens, values


@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_fused_gate_up_from_tokens(tokens):
    """The layer's fused form at Qwen3-30B-A3B's gate and up shapes: rows read
    from the tokens through the plan's row_tokens (tail rows -1), silu(gate) *
    up; its input gradient (the unfused ops' through MLX) against the reference."""
    rng = np.random.default_rng(40 + tokens)
    (offsets, weight, scales, biases, row_experts, up, up_mx, row_tokens,
     values) = _routed_gate_up(rng, tokens, 128, 8, 768, 2048)

    def forward(x):
        return _run_fused(x, offsets, weight, scales, biases, row_experts, row_tokens, up,
                          "bfloat16")

    x = _as_mlx(values, "bfloat16")
    out = forward(x)
    assert out.shape == (len(row_tokens), 768) and out.dtype == mx.bfloat16
    assert_gemm_close(ref.to_numpy(out), token_rows(values, row_tokens), weight, scales, biases,
                      offsets, 4, 64, "bfloat16", up=up)
    assert np.array_equal(ref.to_numpy(mx.compile(forward)(x)), ref.to_numpy(out))

    cotangent = mx.array(rng.standard_normal(out.shape).astype(np.float32)).astype(mx.bfloat16)
    grad = mx.grad(lambda x: (forward(x).astype(mx.float32) * cotangent).sum())(x)
    # The same gradient from MLX's own ops: gathered rows, gather_qmm, silu.
    def unfused(x):
        out = grouped_qmm_by_mlx_ops(
            x, mx.array(weight), _as_mlx(scales, "bfloat16"), _as_mlx(biases, "bfloat16"),
            mx.array(offsets), mx.array(row_experts), bits=4, group_size=64,
            row_tokens=mx.array(row_tokens), up=up_mx)
        return (out.astype(mx.float32) * cotangent).sum()

    got = np.array(grad.astype(mx.float32))
    want = np.array(mx.grad(unfused)(x).astype(mx.float32))
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("tokens,tall", [(8, False), (300, False), (300, True), (2048, False)],
                         ids=["decoding", "prefill", "tall", "chunk"])
def test_clamped_swiglu_with_biases(tokens, tall):
    """gpt-oss-20b's fused gate and up (2880 by 2880, 32 experts, 4 of them a
    token; decoding's body, the block tiles, and their tall blocks forced; a
    prompt's chunk of 2048 tokens, in the made weights' block where the GPU
    has wgmma):
    each projection's bias, the clamped SwiGLU (its clamps reached: the
    gate's from above, up's both ways), rows from the tokens; its gradients
    for the rows and both biases (the unfused ops' through MLX) against
    mlx-lm's activation in MLX's ops."""
    rng = np.random.default_rng(70 + tokens)
    (offsets, weight, scales, biases, row_experts, up, up_mx, row_tokens,
     values) = _routed_gate_up(rng, tokens, 32, 4, 2880, 2880)
    out_biases = tuple(ref.from_float32(rng.standard_normal((32, 2880)).astype(np.float32),
                                        "bfloat16") for _ in range(2))
    clamped = (1.702, 7.0)
    gpu = _gpu.for_backend(_backend.gpu_backend())
    matrices = (mx.array(weight), _as_mlx(scales, "bfloat16"), _as_mlx(biases, "bfloat16"))

    def forward(x, gate_bias, up_bias):
        return gpu.grouped_qmm(x, *matrices, mx.array(offsets), mx.array(row_experts), bits=4,
                               group_size=64, stream=mx.default_stream(mx.gpu),
                               row_tokens=mx.array(row_tokens), up=up_mx, bias=gate_bias,
                               up_bias=up_bias, clamped_swiglu=clamped)

    x = _as_mlx(values, "bfloat16")
    bias_mx = [_as_mlx(b, "bfloat16") for b in out_biases]
    rows = token_rows(values, row_tokens)
    if tokens == 2048:
        made = dict(launch.grouped_qmm_launch(32, 2880, 2880, len(row_tokens), 4, 64,
                                              "bfloat16", backend="cuda", gated=True,
                                              warpgroup=_gpu.warpgroup_mma()).template)
        assert made["SHARED_WEIGHTS"] == _gpu.warpgroup_mma()
    with launch.grouped_qmm_tiling(**(dict(tiles_from_rows=0, block_gated_tall_rows=0)
                                      if tall else {})):
        out = forward(x, *bias_mx)
        assert_gemm_close(ref.to_numpy(out), rows, weight, scales, biases, offsets, 4, 64,
                          "bfloat16", up=up, out_biases=out_biases, clamped_swiglu=clamped)
    gate, up_sums = (ref.grouped_qmm(rows, *matrices_np, offsets, 4, 64, "bfloat16")[:offsets[-1]]
                     + ref.to_float32(bias, "bfloat16")[row_experts[:offsets[-1]]]
                     for matrices_np, bias in zip([(weight, scales, biases), up], out_biases))
    assert (gate > 7.0).any() and (up_sums > 7.0).any() and (up_sums < -7.0).any()

    cotangent = mx.array(rng.standard_normal(out.shape).astype(np.float32)).astype(mx.bfloat16)

    def unfused(x, gate_bias, up_bias):
        out = grouped_qmm_by_mlx_ops(x, *matrices, mx.array(offsets), mx.array(row_experts),
                                     bits=4, group_size=64, row_tokens=mx.array(row_tokens),
                                     up=up_mx, bias=gate_bias, up_bias=up_bias,
                                     clamped_swiglu=clamped)
        return (out.astype(mx.float32) * cotangent).sum()

    def loss(x, gate_bias, up_bias):
        return (forward(x, gate_bias, up_bias).astype(mx.float32) * cotangent).sum()

    got = mx.grad(loss, argnums=(0, 1, 2))(x, *bias_mx)
    want = mx.grad(unfused, argnums=(0, 1, 2))(x, *bias_mx)
    for got_one, want_one in zip(got, want):
        got_one, want_one = (np.array(g.astype(mx.float32)) for g in (got_one, want_one))
        assert np.abs(want_one).max() > 0
        np.testing.assert_allclose(got_one, want_one, rtol=2e-2,
                                   atol=2e-2 * np.abs(want_one).max())


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_tall_gated_blocks(name):
    """The fused gate and up in blocks of 128 rows (the launch's from 512 rows
    an expert, launch._tall_gated_blocks), forced at a smaller size: experts
    past one block and inside one, an empty one, the tail; rows from tokens."""
    counts = [300, 0, 140, 1]
    with launch.grouped_qmm_tiling(tiles_from_rows=0, block_gated_tall_rows=0):
        template = dict(launch.grouped_qmm_launch(len(counts), 2048, 200, sum(counts) + 5, 4,
                                                  64, name, backend="cuda", gated=True,
                                                  num_rows=90).template)
        assert template["BLOCK_ROWS"] == 128
        _check_fused_from_tokens(np.random.default_rng(61), counts, 200, 2048, name)


@pytest.mark.parametrize("share", [0.0, 0.3])
def test_expert_parallel_rows_past_the_static_share(share):
    # An expert-parallel layer with static_share hands the rows past that share
    # of its plan's capacity to this kernel, its spans cut on the device
    # (nn._PlanRows): a group of one process here, 16-row tiles before the cut,
    # against the same layer's tiles over the whole capacity (bfloat16: the
    # kernel's float sums and MLX's GEMM round apart in the last bits).
    switch_layers = pytest.importorskip("mlx_lm.models.switch_layers")
    from mlx_moe_plan.nn import SwitchGLU

    mx.random.seed(9)
    theirs = switch_layers.SwitchGLU(256, 128, 16)
    theirs.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.05, theirs.parameters()))
    nn.quantize(theirs, group_size=64, bits=4)
    theirs.set_dtype(mx.bfloat16)
    whole = SwitchGLU.from_mlx_lm(theirs, tile_m=16)
    ours = SwitchGLU.from_mlx_lm(theirs, tile_m=16)
    ours.expert_group = mx.distributed.init()
    ours.sync_from_entries = 1
    ours.static_share = share
    assert ours._static_rows(moe_plan(mx.zeros((40, 3), mx.int32), 16, tile_m=16),
                             mx.bfloat16) is not None
    x = mx.random.normal((40, 256)).astype(mx.bfloat16)
    indices = mx.argpartition(-mx.random.normal((40, 16)), 2, axis=-1)[..., :3]
    scores = mx.softmax(mx.random.normal((40, 3)), axis=-1)
    got = np.array(ours.weighted_sum(x, indices, scores).astype(mx.float32))
    want = np.array(whole.weighted_sum(x, indices, scores).astype(mx.float32))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
