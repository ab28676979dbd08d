#!/usr/bin/env bash
# The GPU suite, on a machine whose MLX has a GPU backend (MLX's CUDA build
# on Linux; Metal on a Mac), from the project root:
#     bash tests/gpu_suite.sh [results-dir] [steps]
# steps, a comma list (default all; tests = pytest,sanitizers,nn;
# bench = model,decode,decode-forms,lm,kernels,dispatch,ops,plan-groups,layer,
# layer-small,layer-large,grouped-qmm,projections):
#   pytest      every test on the GPU device (pytest -m gpu), bitwise against
#               the reference, outputs poisoned before each kernel;
#   sanitizers  compute-sanitizer memcheck, racecheck and synccheck over the
#               same tests with fewer examples, this package's kernels (CUDA);
#   nn          the mlx-lm model and layer tests on the default device (the GPU):
#               the layer, installing it, the dense projections' rows;
#               GPU_TEST_PROCESSES=N runs the tests of these three steps in N
#               processes at once (a machine of 16 cores: 6 to 10);
#   model       whole models, patched against mlx-lm (benchmarks.model):
#               Qwen3-30B-A3B and gpt-oss-20b, prefill of 8192 tokens and
#               decode at batch 1 to 64, three processes after an untimed one
#               (--warm-process: on a fresh machine it compiles MLX's CUDA
#               kernels, about 2.5 minutes, into MLX's disk cache, where the
#               timed ones find them);
#   decode      decode only, Qwen3-30B-A3B at batch 1 to 16 (below tiles: mlx-lm's
#               call, compiled), three processes, beside the grouped kernel at
#               every batch (--variant-tile-m -1) and an unpatched copy of
#               mlx-lm's model (--control: the spread two identical models
#               give): whether the grouped kernel should start below 64 routed
#               entries (about 6 minutes on a fresh machine);
#   decode-forms batch 4 and 8 uncompiled and in sorted rows, two processes
#               each: which of compiling and the formulation moves generate's
#               pipelined loop (the first beside the control);
#   lm          mlx-lm's own `benchmark` command on a Qwen3-30B-A3B model
#               directory of random weights (benchmarks.model_dir, 17 GB in
#               $TMPDIR), unpatched (--no-patch) and patched, prompts of 2048;
#   kernels     a decoding step's kernels under Nsight Compute (ncu on the
#               PATH), mlx-lm's and the patched model's, Qwen3-30B-A3B's eight
#               layers at batch 1, 4 and 32 (benchmarks.step_kernels);
#   dispatch    the host cost of a graph node, and of the calls a patched
#               decoding step makes (benchmarks.dispatch --package);
#   ops         plan, gather, combine, unsort at every shape, T = 128 to 16384;
#   plan-groups the plan at T = 2048 and 16384 under caps on its groups;
#   layer       the layer end to end at every shape, T = 1 to 2048, in the
#               default formulation and each fixed one, one process a shape;
#   layer-small the default, mlx-lm's unsorted formulation, the grouped kernel,
#               sorted rows and 16-row tiles at T = 1 to 128 in graphs of 16 layers (8 for
#               DeepSeek-V3's 5.6 GB a layer): the decode sizes, where
#               microseconds are at stake, timed with graph building;
#   layer-large the same in the default formulation at T = 8192 and 16384, one
#               process a shape and T (a failing mlx-lm launch cannot disturb
#               the next). All three write JSON.
#   grouped-qmm the grouped GEMM kernel against MLX's gather_qmm on the same
#               sorted rows, and the weight-read floor, every shape, T = 1 to 64,
#               in several tilings (launch.GroupedQmmTiling): the default loads
#               1 or 2 quantization groups a pass, on long rows the next pass's
#               first (launch.grouped_qmm_loads), fixed steps beside it, and
#               one load a word and a value (wide_loads=0) beside the wide loads.
#   grouped-qmm-prefill (not in `bench`) the expert GEMMs at T = 512 to 16384,
#               every shape: the kernel (its block tiles by default, with the
#               warps' own multiply-adds where the default makes the weights in
#               shared memory, in three stages, in stages of 64 values), MLX's
#               tiled gather_qmm and
#               the dense ceilings, TFLOP/s, uniform and skewed routing.
#   grouped-qmm-formats (not in `bench`) the same at T = 2048 and 8192,
#               Qwen3-30B-A3B and gpt-oss-20b, in the other formats a model
#               ships: 8 bits (groups of 64), float16 rows, 4 bits in groups of
#               32 and of 128; the kernel's default tiling and the block that
#               makes the weights in shared memory (launch.SHARED_WEIGHTS_TILING,
#               which the default takes at 4 bits in groups of 64 only), MLX's
#               tiles of 64 and the dense ceilings of the same format.
#   layer-targets (not in `bench`) = layer-targets-uniform,layer-targets-skewed:
#               the layer's GEMMs as the default runs them, every shape at T =
#               2048 and 8192, beside MLX's tiles and the dense ceilings of the
#               same work (the "layer" lines: TFLOP/s, and against MLX's dense
#               4-bit matmul), medians of three processes whose shapes' order
#               turns (--processes 3), uniform routing and skewed (--skew 1), a
#               step, a log and a JSON file each: the expert GEMM's targets in
#               one table.
#   stage-groups (not in `bench`) the block tiles on gpt-oss-20b's rows of 45
#               quantization groups, T = 2048 and 8192, the warps' own
#               multiply-adds: the default (3 groups a stage in 2 stages,
#               launch._stage_groups) beside one group a stage in 3
#               (block_stage_values=64), the default before c828d4d; and
#               Qwen3-30B-A3B's rows of 32 groups, 2 a stage against 1.
#   tall-gated  (not in `bench`) the fused gate and up in block tiles,
#               Qwen3-30B-A3B and gpt-oss-20b, T = 2048 and 8192, the warps' own
#               multiply-adds: the default (blocks of 128 rows from 512 rows an
#               expert, launch._tall_gated_blocks) beside blocks of 64 rows at
#               every size (block_gated_tall_rows=1000000).
#   made-weights-rows (not in `bench`) the made weights' blocks of each width
#               (launch.SHARED_WEIGHTS_ROW_TILES) beside the default (the
#               rule's, launch._shared_weights_row_tiles): Qwen3-30B-A3B at T =
#               2048 and 8192 (128 and 512 rows an expert) in blocks of 160 and
#               192 rows and the default a step ahead (block_weights_ahead=1);
#               DeepSeek-V3 at T = 2048 (64) in 64, 80 and 96; Qwen3-Next at T
#               = 4096 and 8192 (80 and 160) in 80, 96 and 160.
#   decode-attention (not in `bench`) = attention-checks,attention-steps: a
#               decoding step's attention in the package's launches
#               (kernels/decode_attention.h, rules.decodes_attention: from 8
#               sequences, 32 with a mask), in two steps that each fit one call
#               of a lent machine:
#   attention-checks its GPU tests (against the reference and MLX's attention,
#               outputs poisoned; whole models against mlx-lm's logits) and the
#               benchmark's sketch's; the package's kernels under
#               compute-sanitizer's three tools (CUDA); then, last because a
#               call may run out first, MLX's cuDNN path, its vector kernel, the
#               sketch and the package's launches, as they split the keys and
#               for 384 and 512 groups (benchmarks.decode_attention),
#               Qwen3-30B-A3B's and gpt-oss-20b's shapes, contexts 512 and 2048,
#               batch 1 to 64;
#   attention-steps both whole models decoding at batch 1 to 64, the patch
#               beside itself without the launches (off), with them from 4
#               sequences (from4), the sketch's tensor-core form (sketch) and,
#               Qwen3-30B-A3B's, every launch of a decoding step (launches: the
#               norms' too), their steps interleaved one by one (whole turns a
#               side spread too much on these hosts to tell them apart); and
#               Qwen3-30B-A3B from mlx-lm's batch caches (--batch-cache:
#               left-padded prompts, a mask every step, as batch generation and
#               the server decode), the patch beside its launches off and
#               from 8 masked sequences (masked8).
#   attention-ncu (not in `bench`; ncu on the PATH) each decoding attention
#               kernel's GPU time alone under Nsight Compute, the package's
#               launches (moe_decode_attention*) beside the sketch's at
#               Qwen3-30B-A3B's 4 and 8 sequences, context 512, each kernel's
#               mean by name: whether the package's launches lose
#               to the sketch's on the GPU or in the host's evaluation.
#   gradient-nodes (not in `bench`) what the attention's glue costs a decoding
#               step: Qwen3-30B-A3B at batch 8 and 4, the patch (its attention's
#               launches from 8 sequences) beside them off, the sketch, and the
#               launches in the sketch's place through less and less of their
#               glue (method: the backend's, with its checks; step: the
#               function that carries the gradient where traced; launched:
#               the bound calls alone), steps interleaved; then,
#               at batch 8, 32 and 4, the patch beside itself with every
#               launch in the custom function that carries its gradient, the
#               MoE blocks' too, traced or not (always: gradients=always), in
#               the same process; and
#               one step's operations at batch 8, mlx-lm's and the patch's, by
#               primitive (--graph).
#   made-weights-open (not in `bench`) the sizes the rule has not been timed
#               at: Qwen3-Next at T = 2048 (40 rows an expert) in made weights
#               of 64 rows against the warps' own (the default there);
#               Qwen3-30B-A3B at T = 1024 (64) and Mixtral at 512 (128), the
#               default against one projection in the warps' own
#               (block_shared_sized_up_to_rows=0) and 128-row blocks;
#               gpt-oss-20b at T = 2048 and DeepSeek-V3 at 8192 (256) in blocks
#               of 96 and 160 rows against the default's 128.
#   made-stages (not in `bench`) the made weights' stages in flight
#               (block_shared_stages 3 to 6 beside the rule's), where their
#               blocks fall to 64 values a stage with memory to spare:
#               Qwen3-30B-A3B at T = 2048 and 8192 and Qwen3-Next at 8192, and
#               every launch of theirs in 160-row made weights of 64-value
#               stages, 5 and 6 of them (Qwen3-Next's down, 512 values a row,
#               runs the warps' own by default); gpt-oss-20b and Mixtral at 8192.
#   prefill-ncu (not in `bench`; ncu on the PATH) the expert GEMMs short of
#               #31's targets under Nsight Compute, each distinct launch once (its
#               second call): Qwen3-Next at T = 2048 (40 rows an expert, the
#               warps' own) and Qwen3-30B-A3B at T = 8192 (192-row made weights
#               of 64-value stages, the rule's, 5 for one projection, and 3
#               with block_shared_stages=3):
#               throughput, occupancy, the warps' stall reasons, the schedulers.
#   fewer-sums  (not in `bench`) the warps' own block over twice its warps,
#               each holding half its sums, where the default's registers
#               spill (Nsight Compute, prefill-ncu): its rows over 2 warps of 4
#               row tiles (block_row_warps=2,block_row_tiles=4), and the down
#               projection's columns over 8 warps of one tile
#               (block_column_warps=8,block_tiles=1: the gated launch, one tile
#               of each already, takes twice the columns), beside the default,
#               Qwen3-Next at T = 2048 and Qwen3-30B-A3B at 512 (launches that
#               take that block); then each under Nsight Compute's launch
#               statistics and occupancy (ncu on the PATH): registers, spills
#               and groups an SM.
#   few-rows    (not in `bench`) the warps' own block of fewer 8-row tiles,
#               near the rows an expert holds: the default (the rule's,
#               launch._fitted_row_tiles) beside 64 rows (block_fitted_rows=0)
#               and Qwen3-Next at T = 2048 (40 rows an expert) in 5, 6 and 7 row
#               tiles, Qwen3-30B-A3B at 512 (32) in 4, 5 and 6; then
#               Qwen3-Next's in 6 under Nsight Compute's launch statistics (ncu
#               on the PATH): registers and spills.
#   fitted-rows (not in `bench`) the rule's blocks (launch._fitted_row_tiles)
#               beside 64 rows at 32 rows an expert (DeepSeek-V3 at T = 1024,
#               Mixtral at 128, Qwen3-30B-A3B at 512) and 40 (Qwen3-Next at
#               2048), uniform and skewed routing (--skew 1); then the block
#               tiles' GPU tests under compute-sanitizer's three tools (CUDA).
#   min-groups (not in `bench`) the warps' own block's launch bounds
#               (block_min_groups: 3 groups an SM where its blocks have up to
#               48 rows and its input up to 2048 values) against the compiler's
#               own choice (block_min_groups=0) and against the bounds at every
#               size, where an expert holds few rows (Qwen3-Next at T = 2048,
#               Qwen3-30B-A3B at 512, DeepSeek-V3 at 1024, Mixtral at 128) and
#               where the bounds leave them (Qwen3-Next at 8192, gpt-oss-20b at
#               2048); first its GPU test, alone and under compute-sanitizer's
#               three tools (CUDA).
#   item-runs (not in `bench`) each group's items one run of stages
#               (block_across_items=1, ACROSS_ITEMS: an item's first copies in
#               flight while the item before is multiplied and stored): its GPU
#               tests, then under compute-sanitizer's three tools (CUDA); then
#               the expert GEMMs of Qwen3-30B-A3B and Qwen3-Next at T = 2048 and
#               8192 in runs over 132 and 264 groups (one and two an SM of an
#               H100 or H200) beside the default and the same groups alone.
#   least-groups (not in `bench`) the block tiles' grid of the fewest items a
#               plan makes (block_least_groups=1), beside the default's grid of
#               the most and a grid of 264 groups: its GPU tests, alone and
#               under compute-sanitizer's three tools (CUDA); then every
#               shape's expert GEMMs at T = 2048 and 8192, twice, the second
#               with the tilings in the other order.
#   made-weights-cap (not in `bench`) the experts' launches in the made
#               weights' block, their grid capped at two groups an SM of an
#               H100 or H200 (the default, block_shared_max_groups=264), beside
#               it uncapped (4096): every shape's expert GEMMs at T = 2048 and
#               8192, twice, the second in the other order; then both models'
#               whole prefill of 8192 tokens, three alternated turns.
#   made-weights-48 (not in `bench`) the made weights in blocks of 48 rows
#               (block_row_tiles 6: wgmma's N of 48, and 24 in half-empty
#               blocks): their GPU tests, alone and under compute-sanitizer's
#               three tools (CUDA); then, against the warps' own (the default
#               there), the expert GEMMs of Qwen3-Next at T = 2048 (40 rows an
#               expert), its weights made a step ahead too, of Qwen3-30B-A3B
#               at 512 and of DeepSeek-V3 at 1024 (32 rows).
#   made-weights-one-warpgroup (not in `bench`) the made weights in one
#               warpgroup's block (4 warps, 64 columns, stages of 64 values)
#               compiled for 3 groups an SM (block_shared_min_groups=3), beside
#               the default: blocks of 96 and of 48 rows, the expert GEMMs of
#               Qwen3-Next at T = 2048 and 8192 (40 and 160 rows an expert) and
#               of Qwen3-30B-A3B at 4096 and 8192 (256 and 512), twice, the
#               second in the other order.
#   made-weights-ncu (not in `bench`; needs Nsight Compute's ncu) the default's
#               expert GEMMs under `ncu --set full` (benchmarks.grouped_qmm --ncu:
#               each side's one call after a marker kernel), the package's tiles
#               launches only: Qwen3-30B-A3B at T = 2048 uniform and skewed (the
#               made weights' block) and Qwen3-Next at 2048 (the warps' own);
#               each report's details page and its warps' stall reasons
#               (the raw page's issue_stalled metrics), a file each.
#   one-warpgroup-rule (not in `bench`) the rule's one-warpgroup block
#               (launch.ONE_WARPGROUP_TILING, block_one_warpgroup) against the
#               warps' own block it replaced (block_one_warpgroup=0): the
#               expert GEMMs of Qwen3-Next at T = 8192 and of Qwen3-30B-A3B at
#               3000 (160 and 187.5 rows an expert), twice, the second in the
#               other order.
#   made-weights-stages (not in `bench`) the rule's stages of the made
#               weights (launch.UNGATED_MADE_SMALLER_STAGES: 5 for a single
#               projection's stages fallen to 64 values, the fused launch's 3)
#               beside 3 for every launch (block_shared_stages=3, the rule
#               before it), in blocks of 192 rows: Qwen3-30B-A3B at T = 8192,
#               uniform and skewed (--skew 1), gpt-oss-20b at 8192 and Mixtral
#               at 2048, twice, the second in the other order.
#   gate-up-apart (not in `bench`) a layer's gate and up apart where the
#               fused launch's made weights take a shorter block than one
#               projection's (launch.fuses_gate_up): its layer test, then
#               every size the rule takes, Mixtral at T = 2048 to 16384 and
#               DeepSeek-V3 at 16384, fused against unfused (the "layer
#               default" line is the rule's), uniform and skewed, the fused
#               launch also in the 192-row block its long inputs are kept
#               from (block_shared_row_tiles=24), whose spills the stage loop
#               no longer loads (tiles_weights.h).
#   specialized (not in `bench`) the made weights with a warpgroup that only
#               copies and makes them (block_specialized=1): its GPU tests,
#               then under compute-sanitizer memcheck, racecheck and synccheck
#               (its named barriers, its roles' registers), then Qwen3-30B-A3B
#               at T = 2048 and 8192 and Qwen3-Next at 8192 against the
#               default, in the rule's rows and in 128 (no roles' registers),
#               uniform and skewed.
#   made-weights-rule (not in `bench`) the rule's made-weights blocks against
#               the rule before them: 128 rows at every size
#               (block_shared_row_tiles=16), one projection's from 256 rows an
#               expert only (block_shared_sized_up_to_rows=0); the expert GEMMs
#               of every shape at T = 2048 and 8192, then Qwen3-30B-A3B's whole
#               prefill of 8192 tokens, three alternated turns.
#   halved-blocks (not in `bench`) a dense projection's decoding batch in block
#               tiles of half the rows and columns (launch._halved_blocks):
#               Qwen3-30B-A3B's and gpt-oss-20b's attention outputs and lm_heads
#               at batch 32 and 64, built and evaluated, each way
#               (benchmarks.projections); then eight Qwen3-30B-A3B layers and
#               four of gpt-oss-20b's a step, the default beside full blocks at
#               every size and halved ones wherever a batch's rows allow them.
#   input-splits (not in `bench`) a dense projection's decoding batch in block
#               tiles whose input is split among groups (launch._input_splits):
#               Qwen3-30B-A3B's and gpt-oss-20b's attention projections at batch
#               32 and 64, each kernel alone under Nsight Compute (where ncu is
#               on the PATH), split and unsplit (block_input_splits=1), beside
#               MLX's calls; then eight Qwen3-30B-A3B layers a step, the default
#               beside unsplit.
#   grouped-qmm-decode (not in `bench`) the expert GEMMs at a decoding step's
#               T = 8 and 32, Qwen3-30B-A3B, gpt-oss-20b, Mixtral and
#               DeepSeek-V3: the default (launch.grouped_qmm_loads) beside
#               loads a pass ahead on every row and beside the 4 groups a pass,
#               waited for, that rows of more than 32 groups took before.
#   load-patterns (not in `bench`; CUDA) the decode body's loads alone against
#               longer runs of each column and runs staged in shared memory
#               (benchmarks.load_patterns), 1200 to 4800 warps, beside the
#               decode body at T = 8 and 32 with its warps sharing rows, one
#               column tile a warp, groups of 2 warps and the words through a
#               ring in shared memory (word_stages): what caps the expert GEMM at
#               a decoding step, its loads' pattern or their count, and whether
#               the ring lifts it.
#   small-batches (not in `bench`) gpt-oss-20b decoding at batch 1 to 16, three
#               processes after an untimed one, beside mlx-lm's call at every
#               batch (--variant-tile-m 0): the grouped kernel from 16 routed
#               entries where MLX's gather_qmm runs its naive kernel
#               (rules.GROUPED_OFF_TENSOR_CORES_FROM_ENTRIES), as the default;
#               then the MoE routers (8 bits, 8 to 512 columns, MLX's naive
#               kernel below 128) as a decoding batch's rows and as one matrix.
#   build-profile (not in `bench`) where a decoding step's host time goes: eight
#               Qwen3-30B-A3B layers at batch 8 and 32, mlx-lm's and patched,
#               five steps' building under Python's profiler
#               (benchmarks.step_kernels --build-profile).
#   timeline    (not in `bench`; torch's profiler installed) eight Qwen3-30B-A3B
#               layers at batch 8 and 32, mlx-lm's and patched, five steps
#               under torch's profiler (CUPTI): how much of a step's evaluation
#               the GPU is busy, each kernel's time as the step runs it, the
#               GPU's idle time before each kernel and the host's CUDA API
#               calls (benchmarks.step_kernels --timeline).
#   warpgroup   (not in `bench`; a GPU with wgmma: compute capability 9.0) the
#               block tiles through Hopper's warpgroup multiply-add
#               (block_warpgroup=1): its GPU tests, then under compute-sanitizer's
#               memcheck, racecheck and synccheck; its launches beside the
#               warps' own (the default), Qwen3-30B-A3B, gpt-oss-20b and
#               Qwen3-Next at T = 2048 and 8192; and one launch of each,
#               Qwen3-30B-A3B's gate at T = 8192, under Nsight Compute (where
#               ncu is on the PATH) with source-level stall sampling.
#   grouped-qmm-ncu (not in `bench`; ncu on the PATH) one launch of the block
#               tiles (kernels/grouped_qmm_tiles.h), Qwen3-30B-A3B's gate at
#               T = 8192, under Nsight Compute: throughput, occupancy, the warps'
#               stall reasons, the schedulers' issue, the instruction mix.
#   dense-ncu   (not in `bench`; ncu on the PATH) the decode body (grouped_qmm.h) as
#               one expert, Qwen3-30B-A3B's queries at B = 8, its warps sharing
#               rows and not, under Nsight Compute with source-level stall
#               sampling (a report a tiling, for `ncu --import`): what holds a
#               launch of few items at tens of us where its weights take about
#               1.5 us to read;
#   dense-decode (not in `bench`) whole models decoding at batch 1, 8, 32 and 64,
#               the default patch beside patch_model(dense=False)
#               (--variant-no-dense), Qwen3-30B-A3B and gpt-oss-20b, three
#               processes (about 4 minutes): what the grouped kernel as one
#               expert gains a step, the measurement that made dense=True the
#               default. On a fresh machine run dense-decode-warm first, alone:
#               the same in one untimed process, which compiles MLX's kernels
#               into its disk cache (about 6.5 minutes there);
#   submit-decode (not in `bench`) whole models decoding at batch 1, 4, 8, 32
#               and 64, the default patch beside patch_model(submit=False)
#               (--variant-no-submit), Qwen3-30B-A3B and gpt-oss-20b, three
#               processes: what a decoding step's MoE blocks submitted every 16
#               layers as they are built gain (rules.submits_block), the
#               measurement that made submit=True the default. On a fresh
#               machine run dense-decode-warm first, alone.
#   submit-variants (not in `bench`) the whole Qwen3-30B-A3B (48 layers) at batch
#               8, 32 and 64, the patch beside its variants, alternated
#               (benchmarks.step_kernels --variants): a block in 8 submitted,
#               none, and every 4-bit dense projection through the grouped
#               kernel from 8 rows with and without submission (less GPU time,
#               more host time a launch: worth it once the build overlaps the
#               GPU?).
#   siblings    (not in `bench`) the whole Qwen3-30B-A3B (48 layers) and
#               gpt-oss-20b (24) decoding at batch 1 to 64, the patch (the
#               projections on one input as one GEMM where
#               rules.dense_joins_siblings says so) beside each projection
#               alone (unjoined) and joined at every batch and input width
#               (everywhere), alternated (benchmarks.step_kernels --variants).
#   head-norm   (not in `bench`) Qwen3-MoE attention's queries and keys normalized
#               and rotated in one launch (kernels/head_norm_rope.h,
#               rules.fuses_head_norm_rope, off: measured slower): its GPU tests
#               against the reference, MLX's ops and unfused decoding (and
#               under compute-sanitizer's three tools), then the whole
#               Qwen3-30B-A3B at batch 1 to 64, the patch beside the variant
#               that takes it from one row, alternated.
#   add-norm    (not in `bench`) Qwen3-MoE's residual adds and the RMS norms after
#               them one launch each (kernels/add_rms_norm.h,
#               rules.fuses_add_rms_norm, off until measured): its GPU tests
#               against the reference, MLX's ops and unfused decoding (and
#               under compute-sanitizer's three tools), then the whole
#               Qwen3-30B-A3B at batch 1 to 64, the patch beside the variant
#               that takes it from one row, and beside both launches
#               (head-norm's too), alternated.
#   top-k-normalize (not in `bench`) the router's scores renormalized in its top
#               k's launch (rules.TOP_K_NORMALIZES_IN_LAUNCH, on CUDA):
#               its GPU test against the reference and MLX's ops (and under
#               compute-sanitizer's three tools), then the whole
#               Qwen3-30B-A3B at batch 1 to 64, the patch beside the variant
#               that normalizes by MLX's ops after it, alternated (two launches
#               more a layer).
#   prefill-rule (not in `bench`) the whole Qwen3-30B-A3B prefilling 8192 tokens
#               in chunks of 2048 (128 rows an expert), the patch beside the
#               warps' own multiply-adds everywhere (block_warpgroup=0) and the
#               made weights' earlier rule (from 256 rows an expert, gated),
#               alternated in one process (benchmarks.step_kernels --prefill).
#   dense-prefill-model (not in `bench`) whole Qwen3-30B-A3B and gpt-oss-20b
#               prefilling 8192 tokens, the patch (the lm_heads alone through
#               the grouped kernel) beside every dense projection of 512
#               columns and more through it (DENSE_EXPERT_FROM_OUT_DIMS=512),
#               in the made weights' block and in the warps' own, alternated in
#               one process (benchmarks.step_kernels --prefill): whether what
#               dense-prefill measured a GEMM at a time pays in a whole model,
#               where the grouped kernel's launches cost the host more.
#   prompt-submit (not in `bench`) the same two models prefilling 8192 tokens,
#               the patch (a chunk's every 4th MoE block submitted as it is
#               built, rules.SUBMIT_PROMPT_EVERY_BLOCKS) beside every 8th, every 16th,
#               none, and every dense projection from 512 columns through the
#               grouped kernel with the submission (its host cost now
#               overlapping the GPU), alternated in one process.
#   prefill-timeline (not in `bench`) the same two models' patched prefill of
#               8192 tokens: its chunks' building (the host's part, which the
#               GPU waits for) and where it goes by Python function, then under
#               torch's profiler the GPU's busy time, each kernel's, and its idle
#               time (benchmarks.step_kernels --prefill --build-profile --timeline).
#   ungated-rule (not in `bench`) one projection in the made weights' block at 256
#               rows an expert (launch._whole_blocks): Mixtral T = 1024,
#               Qwen3-30B-A3B 4096, DeepSeek-V3 8192 and gpt-oss-20b 2048, the
#               default beside the rule before it (from 512 rows,
#               block_shared_whole_rows=512) and the block forced at 256
#               (block_shared_rows=256: gpt-oss-20b's, which the rule keeps from
#               512), three processes a shape.
#   dense-prefill (not in `bench`) the dense projections at a prefill's T = 512
#               to 8192 rows, MLX's `[1, T, D]` against the grouped kernel as one
#               expert (benchmarks.projections --prefill), in the warps' own
#               multiply-adds (block_warpgroup=0) and in its default tiling (the
#               made weights' block, which the rule gives a dense projection
#               from block_shared_dense_rows): where it would pay.
#   projections every model's dense projections at batch 1 to 64, each shape of a
#               decoding batch and the grouped kernel, built and evaluated,
#               bfloat16 and float16, 4 and 8 bits: the rules rules.dense_as_rows
#               and rules.dense_decoding_expert against the fastest side (long: an hour
#               and more; name fewer with benchmarks.projections --gemms).
#   rows-formats (not in `bench`) the wide dense projections (Qwen3-30B-A3B's
#               and gpt-oss-20b's queries and attention outputs, an lm_head) at
#               batch 1 to 64 in 8 bits and float16 beside 4 bits and bfloat16,
#               the formats rules.dense_as_rows takes (DENSE_ROWS_BITS): MLX's
#               shapes of a decoding batch, built and evaluated.
#   expert-parallel  (not in `bench`: needs 2 GPUs and MLX's NCCL backend;
#               mlx.launch on the PATH) = ep-tests,ep-models,ep-variants:
#   ep-tests    the expert-parallel tests over NCCL, one GPU a rank
#               (MLX_MOE_PLAN_TEST_BACKEND=nccl; a fresh machine's first run
#               compiles MLX's kernels for every test model, about 4 minutes);
#   ep-models   benchmarks.expert_parallel under `mlx.launch -n 2 --backend
#               nccl`: one GPU, mlx-lm's tensor parallelism (patched and not)
#               and expert parallelism (attention replicated, and cut by mlx-lm's
#               shard()), Qwen3-30B-A3B and DeepSeek-V3 (fewer layers), one
#               launch a model (about 5 minutes each);
#   ep-variants Qwen3-30B-A3B's expert parallelism without its per-layer sync:
#               over the whole capacity, and over a static share of it with the
#               grouped kernel past it; then its sharded decode without CUDA
#               graphs (MLX_USE_CUDA_GRAPHS=0) and without NCCL's graph mixing
#               (NCCL_GRAPH_MIXING_SUPPORT=0), against the same with both, and
#               with the patched layers uncompiled (--no-compile).
# Logs go to the results directory; the exit status is 1 if any step failed.
set -uo pipefail
results=${1:-gpu-results}
steps=${2:-all}
mkdir -p "$results"
status=0
logged() { # logged LOG COMMAND...: run, keep the whole log, show its end
  local log=$1
  shift
  echo "+ $*"
  "$@" >"$log" 2>&1
  local rc=$?
  tail -n 15 "$log"
  [ "$rc" -eq 0 ] || { echo "FAILED ($rc): $*"; status=1; }
}
# sanitized TOOL COMMAND...: COMMAND under compute-sanitizer's TOOL over this
# package's kernels (moe_*), failing on any error it reports, with Hypothesis'
# few examples (the kernels run about 100x slower there)
sanitized() {
  local tool=$1
  shift
  HYPOTHESIS_PROFILE=sanitize compute-sanitizer --tool "$tool" --error-exitcode 9 \
    --kernel-name kns=moe_ "$@"
}

[ "$steps" = all ] && steps=tests,bench
# The names of several steps, each replaced where it is a whole item of the
# list (ep-tests and layer-targets-uniform hold others' names).
steps=",$steps,"
steps=${steps//,tests,/,pytest,sanitizers,nn,}
steps=${steps//,expert-parallel,/,ep-tests,ep-models,ep-variants,}
steps=${steps//,decode-attention,/,attention-checks,attention-steps,}
steps=${steps//,layer-targets,/,layer-targets-uniform,layer-targets-skewed,}
steps=${steps//,bench,/,model,decode,decode-forms,lm,kernels,dispatch,ops,plan-groups,layer,layer-small,layer-large,grouped-qmm,projections,}
wanted() { [[ "$steps" == *",$1,"* ]]; }
# launch.SHARED_WEIGHTS_TILING, the made weights' block, or the block launch's
# constant NAME names (ONE_WARPGROUP_TILING), as --tilings text
made_weights_tiling() {
  python3 -c "from mlx_moe_plan.kernels import launch
print(','.join(f'{key}={value}' for key, value in launch.${1:-SHARED_WEIGHTS_TILING}.items()))"
}
# the same block of ROWS 8-row tiles (--tilings keeps the last value of a key)
made_weights_rows() {
  echo "$(made_weights_tiling),block_row_tiles=$1,block_gated_row_tiles=$1"
}
# grouped_qmm_each PREFIX "NAME TOKENS TILINGS"...: the expert GEMMs of each
# shape in its tilings, one log a shape
grouped_qmm_each() {
  local prefix=$1 shape name tokens tilings
  shift
  for shape in "$@"; do
    read -r name tokens tilings <<<"$shape"
    logged "$results/$prefix-$name.log" python3 -m benchmarks.grouped_qmm \
      --shapes "$name" --tokens "$tokens" --calls 4 --no-sorted --sides kernel --tilings "$tilings"
  done
}
# grouped_qmm_skews PREFIX TILINGS "NAME TOKENS"...: the expert GEMMs of each
# shape in TILINGS, uniform and skewed routing (--skew 0 and 1), one log each
grouped_qmm_skews() {
  local prefix=$1 tilings=$2 shape name tokens skew
  shift 2
  for shape in "$@"; do
    read -r name tokens <<<"$shape"
    for skew in 0 1; do
      logged "$results/$prefix-$name-skew$skew.log" python3 -m benchmarks.grouped_qmm \
        --shapes "$name" --tokens "$tokens" --calls 4 --no-sorted --sides kernel --skew "$skew" \
        --tilings "$tilings"
    done
  done
}
# grouped_qmm_both_orders PREFIX TILINGS: every shape's expert GEMMs at T =
# 2048 and 8192 in TILINGS (";"-separated), then again in the reverse order,
# so that drift over the run hits each tiling early once: PREFIX-1.log, -2.log
grouped_qmm_both_orders() {
  local prefix=$1 tilings=$2 turn=0 order
  for order in "$tilings" "$(tr ';' '\n' <<<"$tilings" | tac | paste -sd ';')"; do
    turn=$((turn + 1))
    logged "$results/$prefix-$turn.log" python3 -m benchmarks.grouped_qmm \
      --shapes qwen3-30b-a3b,qwen3-next,gpt-oss-20b,mixtral,deepseek-v3 --tokens 2048,8192 \
      --calls 4 --no-sorted --sides kernel --tilings "$order"
  done
}

# The tests that take a process of their own when tests_at_once runs several:
# a Hypothesis search over MLX's GPU products, minutes alone (the nn step's
# slowest process held it and 30 others: 379 s, against 159 to 245).
ALONE_TESTS='::test_siblings_against_their_members$'
# tests_at_once LOG "RUNNER" "OPTS" PATHS...: the tests PATHS hold (OPTS
# filtering them), under RUNNER's command words if any (sanitized TOOL), in
# $GPU_TEST_PROCESSES pytest processes at once (1 by default): ALONE_TESTS in
# the first, the rest dealt round-robin among the others, since the collection
# ends with the slowest (the grouped GEMM's large shapes); each process's log
# LOG.N, their summaries and failures in LOG
tests_at_once() {
  local log=$1 runner=$2 opts=$3 processes=${GPU_TEST_PROCESSES:-1} part ids pid pids=() rc=0
  shift 3
  [ "$processes" -gt 1 ] || {
    logged "$log" $runner python3 -m pytest -q -rf $opts "$@" -p no:cacheprovider
    return
  }
  python3 -m pytest --collect-only -q $opts "$@" -p no:cacheprovider | grep '::' >"$log.ids"
  rm -f "$log".ids.?? "$log".??  # an earlier run's parts and their logs
  if grep -q -E "$ALONE_TESTS" "$log.ids"; then
    grep -E "$ALONE_TESTS" "$log.ids" >"$log.ids.00"
    grep -v -E "$ALONE_TESTS" "$log.ids" >"$log.rest"
    split -n "r/$((processes - 1))" -a 2 --numeric-suffixes=1 "$log.rest" "$log.ids."
  else
    split -n "r/$processes" -a 2 -d "$log.ids" "$log.ids."
  fi
  echo "+ $runner pytest $opts: $(wc -l <"$log.ids") tests of $* in $processes processes"
  for part in "$log".ids.??; do
    mapfile -t ids <"$part"
    $runner python3 -m pytest -q -rf --durations=5 $opts "${ids[@]}" -p no:cacheprovider \
      >"$log.${part##*.}" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  grep -E "^(FAILED|ERROR)|(passed|failed|skipped|error).* in [0-9.]+s|SUMMARY" "$log".?? |
    tee "$log"
  [ "$rc" -eq 0 ] || { echo "FAILED: $log"; status=1; }
}
if wanted pytest; then
  tests_at_once "$results/pytest-gpu.log" "" "-m gpu" tests
fi
if wanted sanitizers && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck synccheck; do
    tests_at_once "$results/sanitizer-$tool.log" "sanitized $tool" "-x -m gpu" tests
  done
fi
if wanted nn; then
  tests_at_once "$results/pytest-nn.log" "" "" tests/test_nn.py tests/test_install.py \
    tests/test_projections.py
fi
if wanted model; then
  logged "$results/model.log" python3 -m benchmarks.model \
    --models qwen3-30b-a3b,gpt-oss-20b --processes 3 --warm-process \
    --json "$results/model.json"
fi
if wanted decode; then
  logged "$results/decode.log" python3 -m benchmarks.model --models qwen3-30b-a3b \
    --prompt 0 --batches 1,2,4,8,16 --processes 3 --warm-process --control \
    --variant-tile-m -1 --json "$results/decode.json"
fi
if wanted decode-forms; then
  logged "$results/decode-no-compile.log" python3 -m benchmarks.model \
    --models qwen3-30b-a3b --prompt 0 --batches 4,8 --no-compile --processes 2 --control \
    --json "$results/decode-no-compile.json"
  logged "$results/decode-rows.log" python3 -m benchmarks.model --models qwen3-30b-a3b \
    --prompt 0 --batches 4,8 --tile-m 1 --processes 2 --json "$results/decode-rows.json"
fi
if wanted lm; then
  model_dir=${TMPDIR:-/tmp}/mlx-moe-plan-qwen3-30b-a3b
  [ -f "$model_dir/config.json" ] ||
    logged "$results/lm-model-dir.log" python3 -m benchmarks.model_dir qwen3-30b-a3b "$model_dir"
  for turn in 1 2; do  # the two sides in turns, twice
    for patch in --no-patch ""; do
      logged "$results/lm-benchmark-$turn${patch:-patched}.log" \
        python3 -m mlx_moe_plan.lm $patch benchmark --model "$model_dir" -p 2048 -g 128 -n 3
    done
  done
fi
if wanted kernels && command -v ncu >/dev/null; then
  for side in mlx-lm patched; do
    logged "$results/kernels-$side.log" ncu --profile-from-start off --clock-control none \
      --metrics gpu__time_duration.sum --csv --log-file "$results/kernels-$side.csv" \
      python3 -m benchmarks.step_kernels --side "$side" --layers 8 --batches 1,4,32
    logged "$results/kernels-$side-summary.log" python3 -m benchmarks.step_kernels \
      --summarize "$results/kernels-$side.csv"
  done
fi
if wanted dispatch; then
  logged "$results/dispatch.log" python3 -m benchmarks.dispatch
  logged "$results/dispatch-package.log" python3 -m benchmarks.dispatch --package
fi
if wanted ops; then
  logged "$results/bench.log" python3 -m benchmarks.moe --full --no-progress \
    --json "$results/bench.json"
fi
if wanted plan-groups; then
  # 1048576: no cap at these sizes, one block a group.
  for groups in 64 128 256 1048576; do
    logged "$results/plan-groups-$groups.log" python3 -m benchmarks.moe --no-progress \
      --shapes qwen3-next --tokens 2048,16384 --hidden 64 --plan-max-groups "$groups" \
      --json "$results/plan-groups-$groups.json"
  done
fi
if wanted layer; then
  for shape in qwen3-next qwen3-30b-a3b deepseek-v3 mixtral; do
    logged "$results/layer-$shape.log" python3 -m benchmarks.layer \
      --shapes "$shape" --tokens 1,8,32,128,512,2048 --tile-m auto,1,8,16,32,64 \
      --layers 4 --json "$results/layer-$shape.json"
  done
fi
if wanted layer-small; then
  for shape in qwen3-next qwen3-30b-a3b deepseek-v3 mixtral; do
    logged "$results/layer-small-$shape.log" python3 -m benchmarks.layer \
      --shapes "$shape" --tokens 1,4,8,16,32,64,128 --tile-m auto,0,-1,1,16 \
      --layers $([ "$shape" = deepseek-v3 ] && echo 8 || echo 16) \
      --json "$results/layer-small-$shape.json"
  done
fi
if wanted layer-large; then
  for tokens in 8192 16384; do
    for shape in qwen3-next qwen3-30b-a3b deepseek-v3 mixtral; do
      logged "$results/layer-$shape-$tokens.log" python3 -m benchmarks.layer \
        --shapes "$shape" --tokens "$tokens" --layers 1 \
        --json "$results/layer-$shape-$tokens.json"
    done
  done
fi
if wanted grouped-qmm; then
  logged "$results/grouped-qmm.log" python3 -m benchmarks.grouped_qmm \
    --shapes qwen3-30b-a3b,qwen3-next,deepseek-v3,mixtral --tokens 1,8,32,64 \
    --tilings "default;wide_loads=0;steps=1;steps=2;steps=2,wide_loads=0;steps=4;steps=2,loads_ahead=1;tiles=1;tiles=4;row_tiles=2;threads=256,tiles=1;max_groups=1024;max_groups=2048;gated_tiles=1;gated_tiles=1,steps=2"
fi
if wanted grouped-qmm-decode; then
  logged "$results/grouped-qmm-decode.log" python3 -m benchmarks.grouped_qmm \
    --shapes qwen3-30b-a3b,gpt-oss-20b,mixtral,deepseek-v3 --tokens 8,32 --calls 16 \
    --sides kernel --tilings "default;loads_ahead=1;steps=4,loads_ahead=0"
fi
if wanted load-patterns; then
  logged "$results/load-patterns.log" python3 -m benchmarks.load_patterns \
    --warps 1200,2400,4800 --repeats 2
  logged "$results/load-patterns-decode.log" python3 -m benchmarks.grouped_qmm \
    --shapes qwen3-30b-a3b --tokens 8,32 --calls 16 --sides kernel \
    --tilings "default;k_splits=2;k_splits=4;tiles=1,gated_tiles=1;threads=64;word_stages=3;word_stages=2;word_stages=3,steps=2;word_stages=3,steps=2,loads_ahead=1"
fi
if wanted small-batches; then
  logged "$results/small-batches.log" python3 -m benchmarks.model --models gpt-oss-20b \
    --prompt 0 --batches 1,2,4,8,16 --no-pipelined --variant-tile-m 0 --processes 3 \
    --warm-process --json "$results/small-batches.json"
  logged "$results/routers.log" python3 -m benchmarks.projections \
    --gemms gpt-oss-20b/router,qwen3-30b-a3b/router,qwen3-next/router,mixtral/router \
    --batches 1,2,4,8,16,32,64 --json "$results/routers.json"
fi
if wanted build-profile; then
  for side in mlx-lm patched; do
    logged "$results/build-profile-$side.log" python3 -m benchmarks.step_kernels --side "$side" \
      --layers 8 --batches 8,32 --build-profile 5 --top 40
  done
fi
if wanted timeline && python3 -c "import torch.profiler" 2>/dev/null; then
  for side in patched mlx-lm; do
    logged "$results/timeline-$side.log" python3 -m benchmarks.step_kernels --side "$side" \
      --layers 8 --batches 8,32 --timeline 5 --top 12
  done
fi
if wanted warpgroup; then
  logged "$results/warpgroup-pytest.log" python3 -m pytest -q -m gpu -k warpgroup \
    tests/test_grouped_qmm.py -p no:cacheprovider
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck synccheck; do
      logged "$results/warpgroup-sanitizer-$tool.log" sanitized "$tool" \
        python3 -m pytest -q -x -m gpu -k warpgroup tests/test_grouped_qmm.py \
        -p no:cacheprovider
    done
  fi
  logged "$results/warpgroup-bench.log" python3 -m benchmarks.grouped_qmm \
    --shapes qwen3-30b-a3b,gpt-oss-20b,qwen3-next --tokens 2048,8192 --calls 4 --no-sorted \
    --sides kernel --tilings "default;block_warpgroup=0;block_warpgroup=1"
  if command -v ncu >/dev/null; then
    for tiling in default block_warpgroup=1; do
      name=warpgroup-ncu-${tiling//[=,]/-}
      logged "$results/$name.log" ncu --kernel-name regex:moe_grouped_qmm_tiles \
        --launch-skip 2 --launch-count 1 --set full --import-source yes \
        --export "$results/$name" --force-overwrite \
        python3 -m benchmarks.grouped_qmm --shapes qwen3-30b-a3b --tokens 8192 --calls 2 \
        --sides kernel --no-sorted --tilings "$tiling"
    done
  fi
fi
if wanted grouped-qmm-ncu && command -v ncu >/dev/null; then
  logged "$results/grouped-qmm-ncu.log" ncu --kernel-name regex:moe_grouped_qmm_tiles \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section InstructionStats \
    --section MemoryWorkloadAnalysis \
    python3 -m benchmarks.grouped_qmm --shapes qwen3-30b-a3b --tokens 8192 --calls 2 \
    --sides kernel
fi
if wanted dense-ncu && command -v ncu >/dev/null; then
  # 4 sets loading 4 groups ahead (the default), 4 sets one group at a time
  # (half the code), one set (the launch before the sets)
  for tiling in k_splits=4 k_splits=4,steps=1 k_splits=1; do
    name=dense-ncu-${tiling//[=,]/-}
    logged "$results/$name.log" ncu --kernel-name regex:moe_grouped_qmm \
      --launch-skip 4 --launch-count 1 --set full --import-source yes \
      --export "$results/$name" --force-overwrite \
      python3 -m benchmarks.projections --gemms qwen3-30b-a3b/q --batches 8 --eval-only \
      --tilings "$tiling" --max-calls 8 --target-s 0
  done
fi
dense_decode=(--models qwen3-30b-a3b,gpt-oss-20b --prompt 0 --batches 1,8,32,64 --no-pipelined
              --variant-no-dense)
if wanted dense-decode-warm; then
  logged "$results/dense-decode-warm.log" python3 -m benchmarks.model "${dense_decode[@]}"
fi
if wanted dense-decode; then
  logged "$results/dense-decode.log" python3 -m benchmarks.model "${dense_decode[@]}" \
    --processes 3 --json "$results/dense-decode.json"
fi
if wanted submit-decode; then
  logged "$results/submit-decode.log" python3 -m benchmarks.model \
    --models qwen3-30b-a3b,gpt-oss-20b --prompt 0 --batches 1,4,8,32,64 --no-pipelined \
    --variant-no-submit --decode-rounds 2 --processes 3 --json "$results/submit-decode.json"
fi
if wanted submit-variants; then
  all_dense=DENSE_DECODING_FROM_IN_DIMS=0,DENSE_DECODING_TILES_FROM_IN_DIMS=0
  logged "$results/submit-variants.log" python3 -m benchmarks.step_kernels --layers 48 \
    --batches 8,32,64 --rounds 5 --variants "every8:SUBMIT_EVERY_BLOCKS=8;none:SUBMIT_BLOCKS_FROM_TOKENS=100000;all:$all_dense;all-none:$all_dense,SUBMIT_BLOCKS_FROM_TOKENS=100000"
fi
if wanted siblings; then
  for model in qwen3-30b-a3b:48 gpt-oss-20b:24; do
    logged "$results/siblings-${model%:*}.log" python3 -m benchmarks.step_kernels \
      --models "${model%:*}" --layers "${model#*:}" --batches 1,4,8,32,64 --rounds 5 \
      --variants "unjoined:SIBLINGS_FROM_ROWS=1000000;everywhere:SIBLINGS_FROM_ROWS=1,SIBLINGS_BELOW_IN_DIMS=1000000"
  done
fi
# kernel_tests STEP FILE FILTER: FILE's GPU tests matching FILTER, then the same
# under compute-sanitizer's three tools (this package's kernels), a log each
kernel_tests() {
  local step=$1 file=$2 filter=$3 tool
  logged "$results/$step-test.log" python3 -m pytest -q -m gpu "$file" -k "$filter" \
    -p no:cacheprovider
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck synccheck; do
      logged "$results/$step-$tool.log" sanitized "$tool" \
        python3 -m pytest -q -x -m gpu "$file" -k "$filter" -p no:cacheprovider
    done
  fi
}
if wanted head-norm; then
  kernel_tests head-norm tests/test_fused_attention.py "kernel_against or decoding_on"
  logged "$results/head-norm.log" python3 -m benchmarks.step_kernels --layers 48 \
    --batches 8,4,1,32,64 --rounds 5 --variants "fused:HEAD_NORM_ROPE_FROM_ROWS=1"
fi
if wanted add-norm; then
  kernel_tests add-norm tests/test_fused_model.py "kernel_against or decoding_on"
  logged "$results/add-norm.log" python3 -m benchmarks.step_kernels --layers 48 \
    --batches 8,4,1,32,64 --rounds 5 \
    --variants "fused:ADD_RMS_NORM_FROM_ROWS=1;both:ADD_RMS_NORM_FROM_ROWS=1,HEAD_NORM_ROPE_FROM_ROWS=1"
fi
if wanted top-k-normalize; then
  kernel_tests top-k-normalize tests/test_routing.py normalizes_in_its_launch
  logged "$results/top-k-normalize.log" python3 -m benchmarks.step_kernels --layers 48 \
    --batches 1,4,8,32,64 --rounds 5 --variants "ops:TOP_K_NORMALIZES_IN_LAUNCH=0"
fi
if wanted prefill-rule; then
  logged "$results/prefill-rule.log" python3 -m benchmarks.step_kernels --layers 48 \
    --prefill 8192 --rounds 3 --variants "warps:block_warpgroup=0;gated-256:block_shared_gated_rows=256"
fi
# whole_prefills STEP ARGS...: Qwen3-30B-A3B's and gpt-oss-20b's every layer
# prefilling 8192 tokens (benchmarks.step_kernels --prefill ARGS), a log a model
whole_prefills() {
  local step=$1 model
  shift
  for model in qwen3-30b-a3b:48 gpt-oss-20b:24; do
    logged "$results/$step-${model%:*}.log" python3 -m benchmarks.step_kernels \
      --models "${model%:*}" --layers "${model#*:}" --prefill 8192 "$@"
  done
}
if wanted dense-prefill-model; then
  whole_prefills dense-prefill-model --rounds 3 \
    --variants "all-dense:DENSE_EXPERT_FROM_OUT_DIMS=512;all-dense-warps:DENSE_EXPERT_FROM_OUT_DIMS=512,block_shared_dense_rows=1000000000"
fi
if wanted prompt-submit; then
  whole_prefills prompt-submit --rounds 3 \
    --variants "every8:SUBMIT_PROMPT_EVERY_BLOCKS=8;every16:SUBMIT_PROMPT_EVERY_BLOCKS=16;none:SUBMIT_PROMPT_FROM_ROWS=1000000;all-dense:DENSE_EXPERT_FROM_OUT_DIMS=512"
fi
if wanted prefill-timeline; then
  whole_prefills prefill-timeline --build-profile 1 --timeline 1 --top 16
fi
if wanted ungated-rule; then
  for turn in 1 2 3; do
    for case in mixtral:1024 qwen3-30b-a3b:4096 deepseek-v3:8192 gpt-oss-20b:2048; do
      logged "$results/ungated-rule-${case%:*}-$turn.log" python3 -m benchmarks.grouped_qmm \
        --shapes "${case%:*}" --tokens "${case#*:}" --calls 4 --no-sorted --sides kernel \
        --tilings "default;block_shared_whole_rows=512;block_shared_rows=256"
    done
  done
fi
if wanted dense-prefill; then
  logged "$results/dense-prefill.log" python3 -m benchmarks.projections --prefill \
    --gemms qwen3-30b-a3b/q,qwen3-30b-a3b/kv,qwen3-30b-a3b/o,qwen3-30b-a3b/lm_head,gpt-oss-20b/q,gpt-oss-20b/o,deepseek-v3/shared-up,deepseek-v3/shared-down \
    --batches 512,2048,8192 --max-calls 48 --json "$results/dense-prefill.json" \
    --tilings "block_warpgroup=0;default"
fi
if wanted grouped-qmm-prefill; then
  for skew in 0 0.5; do
    logged "$results/grouped-qmm-prefill-skew$skew.log" python3 -m benchmarks.grouped_qmm \
      --shapes qwen3-30b-a3b,qwen3-next,gpt-oss-20b,mixtral,deepseek-v3 \
      --tokens 512,2048,8192,16384 --mlx-tiles 16,64 --skew "$skew" --calls 8 --no-sorted \
      --tilings "default;block_warpgroup=0;block_warpgroup=0,block_stages=3;block_warpgroup=0,block_stage_values=64"
  done
fi
if wanted grouped-qmm-formats; then
  made=$(made_weights_tiling)
  for format in "--bits 8" "--dtype float16" "--group-size 32" "--group-size 128"; do
    name=${format//--/}
    logged "$results/grouped-qmm-formats-${name// /}.log" python3 -m benchmarks.grouped_qmm \
      --shapes qwen3-30b-a3b,gpt-oss-20b --tokens 2048,8192 --calls 4 --no-sorted $format \
      --tilings "default;$made"
  done
fi
for routing in "uniform 0" "skewed 1"; do
  read -r name skew <<<"$routing"
  if wanted "layer-targets-$name"; then
    logged "$results/layer-targets-skew$skew.log" python3 -m benchmarks.grouped_qmm \
      --shapes qwen3-30b-a3b,qwen3-next,gpt-oss-20b,mixtral,deepseek-v3 --tokens 2048,8192 \
      --calls 4 --no-sorted --skew "$skew" --processes 3 \
      --json "$results/layer-targets-skew$skew.json"
  fi
done
if wanted stage-groups; then
  logged "$results/stage-groups.log" python3 -m benchmarks.grouped_qmm \
    --shapes gpt-oss-20b,qwen3-30b-a3b --tokens 2048,8192 --calls 4 --no-sorted --sides kernel \
    --tilings "block_warpgroup=0;block_warpgroup=0,block_stage_values=64"
fi
if wanted tall-gated; then
  logged "$results/tall-gated.log" python3 -m benchmarks.grouped_qmm \
    --shapes qwen3-30b-a3b,gpt-oss-20b --tokens 2048,8192 --calls 4 --no-sorted --sides kernel \
    --tilings "block_warpgroup=0;block_warpgroup=0,block_gated_tall_rows=1000000"
fi
if wanted made-weights-rows; then
  grouped_qmm_each made-weights-rows \
    "qwen3-30b-a3b 2048,8192 default;$(made_weights_rows 20);$(made_weights_rows 24);block_weights_ahead=1" \
    "deepseek-v3 2048 default;$(made_weights_rows 8);$(made_weights_rows 10);$(made_weights_rows 12)" \
    "qwen3-next 4096,8192 default;$(made_weights_rows 10);$(made_weights_rows 12);$(made_weights_rows 20)"
fi
if wanted attention-checks; then
  # The GPU tests of the launches (-m gpu): the file's others stand the launch
  # in on the CPU backend, and on a GPU machine would run mlx-lm's own paths on
  # the GPU instead, a quantized cache's among them, which MLX's CUDA
  # quantized_matmul has no kernel for at the test models' sizes.
  logged "$results/decode-attention-test.log" python3 -m pytest -q -m gpu \
    tests/test_fused_attention.py -k "decode_attention or attention_launch" -p no:cacheprovider
  logged "$results/decode-attention-bench-test.log" python3 -m pytest -q tests/test_benchmarks.py \
    -k decode_attention -p no:cacheprovider
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck synccheck; do
      logged "$results/decode-attention-$tool.log" compute-sanitizer --tool "$tool" \
        --error-exitcode 9 --kernel-name kns=decode_attention python3 -m pytest -q \
        tests/test_fused_attention.py -k "decode_attention_kernel and dtype0" -p no:cacheprovider
    done
  fi
  logged "$results/decode-attention.log" python3 -m benchmarks.decode_attention
fi
if wanted attention-steps; then
  # Batch 8 first (#33's open target); at 4 `from4` differs from the patch, at
  # 8 and more `off`; batch 1 is the control.
  off="off:DECODE_ATTENTION_FROM_ROWS=1000000"
  attention="$off;from4:DECODE_ATTENTION_FROM_ROWS=4;sketch:attention=sketch-mma"
  # Qwen3-30B-A3B's step with every launch of the package's decoding step too
  # (the queries' and keys' norms, the residual norms): each was off for its
  # glue's building, all three glues now bound once a size.
  launches="launches:DECODE_ATTENTION_FROM_ROWS=4,HEAD_NORM_ROPE_FROM_ROWS=1"
  launches="$launches,ADD_RMS_NORM_FROM_ROWS=1"
  logged "$results/decode-attention-qwen.log" python3 -m benchmarks.step_kernels --layers 48 \
    --batches 8,4,1,32,64 --rounds 5 --interleave --variants "$attention;$launches"
  logged "$results/decode-attention-gpt-oss.log" python3 -m benchmarks.step_kernels \
    --models gpt-oss-20b --layers 24 --batches 8,32,64,4,1 --rounds 5 --interleave \
    --variants "$attention"
  logged "$results/decode-attention-batch-cache.log" python3 -m benchmarks.step_kernels \
    --layers 48 --batches 8,32,64 --rounds 5 --batch-cache --interleave \
    --variants "$off;masked8:DECODE_ATTENTION_MASKED_FROM_ROWS=8"
fi
if wanted gradient-nodes; then
  glue="off:DECODE_ATTENTION_FROM_ROWS=1000000;sketch:attention=sketch-mma"
  glue="$glue;launched:attention=package-launched;step:attention=package-step"
  logged "$results/gradient-nodes.log" python3 -m benchmarks.step_kernels --layers 48 \
    --batches 8,4 --rounds 5 --interleave --variants "$glue;method:attention=package"
  logged "$results/gradient-nodes-always.log" python3 -m benchmarks.step_kernels --layers 48 \
    --batches 8,32,4 --rounds 5 --interleave --variants "always:gradients=always"
  logged "$results/gradient-nodes-graph.log" python3 -m benchmarks.step_kernels --layers 48 \
    --batches 8 --graph --top 30
fi
if wanted made-weights-open; then
  grouped_qmm_each made-weights-open "qwen3-next 2048 default;$(made_weights_rows 8)" \
    "qwen3-30b-a3b 1024 default;block_shared_sized_up_to_rows=0;block_shared_row_tiles=16" \
    "mixtral 512 default;block_shared_sized_up_to_rows=0;block_shared_row_tiles=16" \
    "gpt-oss-20b 2048 default;$(made_weights_rows 12);$(made_weights_rows 20)" \
    "deepseek-v3 8192 default;$(made_weights_rows 12);$(made_weights_rows 20)"
fi
if wanted made-stages; then
  stages="default;block_shared_stages=3;block_shared_stages=4;block_shared_stages=5"
  stages+=";block_shared_stages=6"
  grouped_qmm_each made-stages \
    "qwen3-30b-a3b 2048,8192 $stages;$(made_weights_rows 20),block_stage_values=64,block_stages=5" \
    "qwen3-next 8192 $stages;$(made_weights_rows 20),block_stage_values=64,block_stages=6" \
    "gpt-oss-20b 8192 $stages" "mixtral 8192 $stages"
fi
if wanted attention-ncu && command -v ncu >/dev/null; then
  for batch in 4 8; do
    logged "$results/attention-ncu-$batch.log" ncu --metrics gpu__time_duration.sum \
      --print-summary per-kernel --kernel-name "regex:decode_attention" \
      python3 -m benchmarks.decode_attention --models qwen3-30b-a3b --contexts 512 \
      --batches "$batch" --layers 2 --package-groups ""
  done
fi
if wanted prefill-ncu && command -v ncu >/dev/null; then
  for shape in "qwen3-next 2048 default" "qwen3-30b-a3b 8192 default;block_shared_stages=3"; do
    read -r name tokens tilings <<<"$shape"
    logged "$results/prefill-ncu-$name.log" ncu --kernel-id "::regex:moe_grouped_qmm:2" \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      python3 -m benchmarks.grouped_qmm --shapes "$name" --tokens "$tokens" --calls 1 \
      --no-sorted --sides kernel --tilings "$tilings"
  done
fi
if wanted fewer-sums; then
  halved="block_row_warps=2,block_row_tiles=4;block_column_warps=8,block_tiles=1"
  grouped_qmm_each fewer-sums "qwen3-next 2048 default;$halved" \
    "qwen3-30b-a3b 512 default;$halved"
  if command -v ncu >/dev/null; then
    for tiling in default ${halved//;/ }; do
      logged "$results/fewer-sums-ncu-${tiling//[=,]/-}.log" ncu \
        --kernel-id "::regex:moe_grouped_qmm:2" --section LaunchStats --section Occupancy \
        --section SpeedOfLight python3 -m benchmarks.grouped_qmm --shapes qwen3-next \
        --tokens 2048 --calls 1 --no-sorted --sides kernel --tilings "$tiling"
    done
  fi
fi
if wanted few-rows; then
  # the block's row tiles, the gated launch's alike, the rule's fitting off
  rows_tiles() {
    local n
    for n in "$@"; do
      printf ';block_row_tiles=%s,block_gated_row_tiles=%s,block_fitted_rows=0' "$n" "$n"
    done
  }
  grouped_qmm_each few-rows "qwen3-next 2048 default;block_fitted_rows=0$(rows_tiles 5 6 7)" \
    "qwen3-30b-a3b 512 default;block_fitted_rows=0$(rows_tiles 4 5 6)"
  if command -v ncu >/dev/null; then
    logged "$results/few-rows-ncu.log" ncu --kernel-id "::regex:moe_grouped_qmm:2" \
      --section LaunchStats --section Occupancy --section SpeedOfLight python3 -m \
      benchmarks.grouped_qmm --shapes qwen3-next --tokens 2048 --calls 1 --no-sorted \
      --sides kernel --tilings "$(rows_tiles 6 | cut -c2-)"
  fi
fi
if wanted fitted-rows; then
  # the rule's fitted blocks against 64 rows where the tiles start (32 rows an
  # expert: DeepSeek-V3's T = 1024, Mixtral's 128, Qwen3-30B-A3B's 512) and at
  # Qwen3-Next's 40, uniform and skewed; then its blocks under the sanitizers
  grouped_qmm_skews fitted-rows "default;block_fitted_rows=0" "deepseek-v3 1024" "mixtral 128" \
    "qwen3-30b-a3b 512" "qwen3-next 2048"
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck synccheck; do
      logged "$results/fitted-rows-sanitizer-$tool.log" sanitized "$tool" \
        python3 -m pytest -q -x -m gpu tests/test_grouped_qmm.py \
        -k "tiles_match or prefill_shapes" -p no:cacheprovider
    done
  fi
fi
if wanted min-groups; then
  kernel_tests min-groups tests/test_grouped_qmm.py bounded
  everywhere="block_min_groups_up_to_rows=1048576,block_min_groups_up_to_in_dims=1048576"
  for shape in "qwen3-next 2048,8192" "qwen3-30b-a3b 512" "deepseek-v3 1024" "mixtral 128" \
      "gpt-oss-20b 2048"; do
    read -r name tokens <<<"$shape"
    logged "$results/min-groups-$name.log" python3 -m benchmarks.grouped_qmm \
      --shapes "$name" --tokens "$tokens" --calls 4 --no-sorted --sides kernel \
      --tilings "default;block_min_groups=0;$everywhere"
  done
fi
if wanted item-runs; then
  kernel_tests item-runs tests/test_grouped_qmm.py runs
  runs="default;block_max_groups=132;block_across_items=1,block_max_groups=132"
  runs="$runs;block_max_groups=264;block_across_items=1,block_max_groups=264"
  grouped_qmm_each item-runs "qwen3-30b-a3b 2048,8192 $runs" "qwen3-next 2048,8192 $runs"
fi
if wanted least-groups; then
  kernel_tests least-groups tests/test_grouped_qmm.py least
  grouped_qmm_both_orders least-groups "default;block_least_groups=1;block_max_groups=264"
fi
if wanted made-weights-cap; then
  grouped_qmm_both_orders made-weights-cap "default;block_shared_max_groups=4096"
  whole_prefills made-weights-cap --rounds 3 --variants "uncapped:block_shared_max_groups=4096"
fi
if wanted made-weights-48; then
  kernel_tests made-weights-48 tests/test_grouped_qmm.py shared-48
  made48=$(made_weights_rows 6)
  grouped_qmm_each made-weights-48 \
    "qwen3-next 2048 default;$made48;$made48,block_weights_ahead=1" \
    "qwen3-30b-a3b 512 default;$made48" "deepseek-v3 1024 default;$made48"
fi
if wanted made-weights-one-warpgroup; then
  one96=$(made_weights_tiling ONE_WARPGROUP_TILING)  # 96 rows
  one48="$one96,block_row_tiles=6,block_gated_row_tiles=6"
  grouped_qmm_each made-weights-one-warpgroup-1 "qwen3-next 2048,8192 default;$one96;$one48" \
    "qwen3-30b-a3b 4096,8192 default;$one96"
  grouped_qmm_each made-weights-one-warpgroup-2 "qwen3-next 2048,8192 $one48;$one96;default" \
    "qwen3-30b-a3b 4096,8192 $one96;default"
fi
if wanted made-weights-ncu; then
  if command -v ncu >/dev/null; then
    for case in "qwen3-30b-a3b 2048 0" "qwen3-30b-a3b 2048 1" "qwen3-next 2048 0"; do
      read -r name tokens skew <<<"$case"
      report="$results/made-weights-ncu-$name-$tokens-skew$skew"
      logged "$report.log" ncu --profile-from-start off --set full -f -o "$report" \
        -k "regex:grouped_qmm_tiles|qmm_mark_" python3 -m benchmarks.grouped_qmm --ncu \
        --shapes "$name" --tokens "$tokens" --skew "$skew" --calls 4 --no-sorted --sides kernel
      logged "$report-details.txt" ncu --import "$report.ncu-rep" --page details
      ncu --import "$report.ncu-rep" --page raw | grep -E "qmm_mark_|grouped_qmm_tiles|stalled" \
        >"$report-stalls.txt"
    done
  else
    echo "made-weights-ncu: no ncu on the PATH"
  fi
fi
if wanted made-weights-stages; then
  turn=0
  for order in "default;block_shared_stages=3" "block_shared_stages=3;default"; do
    turn=$((turn + 1))
    for skew in 0 1; do
      logged "$results/made-weights-stages-$turn-qwen3-30b-a3b-skew$skew.log" \
        python3 -m benchmarks.grouped_qmm --shapes qwen3-30b-a3b --tokens 8192 --skew "$skew" \
        --calls 4 --no-sorted --sides kernel --tilings "$order"
    done
    grouped_qmm_each "made-weights-stages-$turn" "gpt-oss-20b 8192 $order" "mixtral 2048 $order"
  done
fi
if wanted gate-up-apart; then
  logged "$results/gate-up-apart-pytest.log" python3 -m pytest -q -x tests/test_nn.py \
    -k apart_where -p no:cacheprovider
  grouped_qmm_skews gate-up-apart "default;block_shared_row_tiles=24" \
    "mixtral 2048,8192,4096,16384" "deepseek-v3 16384"
fi
if wanted specialized; then
  logged "$results/specialized-pytest.log" python3 -m pytest -q -rf -m gpu \
    tests/test_grouped_qmm.py -k specialized -p no:cacheprovider
  if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck synccheck; do
      logged "$results/specialized-$tool.log" sanitized "$tool" python3 -m pytest -q -x -m gpu \
        tests/test_grouped_qmm.py -k "specialized_made_weights and bfloat16" -p no:cacheprovider
    done
  fi
  grouped_qmm_skews specialized \
    "default;block_specialized=1;block_specialized=1,block_shared_row_tiles=16" \
    "qwen3-30b-a3b 8192,2048" "qwen3-next 8192"
fi
if wanted one-warpgroup-rule; then
  grouped_qmm_each one-warpgroup-rule-1 "qwen3-next 8192 default;block_one_warpgroup=0" \
    "qwen3-30b-a3b 3000 default;block_one_warpgroup=0"
  grouped_qmm_each one-warpgroup-rule-2 "qwen3-next 8192 block_one_warpgroup=0;default" \
    "qwen3-30b-a3b 3000 block_one_warpgroup=0;default"
fi
if wanted made-weights-rule; then
  before="block_shared_row_tiles=16,block_shared_sized_up_to_rows=0"
  logged "$results/made-weights-rule.log" python3 -m benchmarks.grouped_qmm \
    --shapes qwen3-30b-a3b,qwen3-next,gpt-oss-20b,mixtral,deepseek-v3 --tokens 2048,8192 \
    --calls 4 --no-sorted --sides kernel --tilings "default;$before"
  logged "$results/made-weights-rule-prefill.log" python3 -m benchmarks.step_kernels \
    --models qwen3-30b-a3b --layers 48 --prefill 8192 --rounds 3 --variants "before:$before"
fi
if wanted halved-blocks; then
  halved="default;block_halved_up_to_rows=0;block_halved_below_blocks=1000000"
  logged "$results/halved-blocks-projections.log" python3 -m benchmarks.projections \
    --batches 32,64 --max-calls 64 --target-s 0.02 --tilings "$halved" \
    --gemms qwen3-30b-a3b/o,qwen3-30b-a3b/lm_head,gpt-oss-20b/o,gpt-oss-20b/lm_head
  variants="full:block_halved_up_to_rows=0;halved:block_halved_below_blocks=1000000"
  logged "$results/halved-blocks-qwen.log" python3 -m benchmarks.step_kernels \
    --layers 8 --batches 32,64 --rounds 7 --variants "$variants"
  logged "$results/halved-blocks-gpt-oss.log" python3 -m benchmarks.step_kernels \
    --models gpt-oss-20b --layers 4 --batches 32,64 --rounds 7 --variants "$variants"
fi
if wanted input-splits && command -v ncu >/dev/null; then
  logged "$results/input-splits-ncu.log" ncu --profile-from-start off --clock-control none \
    --metrics gpu__time_duration.sum --csv --log-file "$results/input-splits.csv" \
    python3 -m benchmarks.projections --ncu --batches 32,64 \
    --tilings "default;block_input_splits=1" \
    --gemms qwen3-30b-a3b/q,qwen3-30b-a3b/o,qwen3-30b-a3b/kv,gpt-oss-20b/q,gpt-oss-20b/o,gpt-oss-20b/kv
  logged "$results/input-splits-summary.log" python3 -m benchmarks.projections \
    --summarize "$results/input-splits.csv"
fi
if wanted input-splits; then
  logged "$results/input-splits-step.log" python3 -m benchmarks.step_kernels \
    --layers 8 --batches 32,64 --rounds 7 --variants "nosplit:block_input_splits=1"
fi
if wanted projections; then
  logged "$results/projections.log" python3 -m benchmarks.projections \
    --dtypes bfloat16,float16 --bits 4,8 --max-calls 200 --tilings default \
    --json "$results/projections.json"
fi
if wanted rows-formats; then
  logged "$results/rows-formats.log" python3 -m benchmarks.projections \
    --dtypes float16,bfloat16 --bits 8,4 --batches 1,4,8,16,32,64 --max-calls 100 \
    --gemms qwen3-30b-a3b/q,qwen3-30b-a3b/o,qwen3-30b-a3b/lm_head,gpt-oss-20b/q,gpt-oss-20b/o \
    --json "$results/rows-formats.json"
fi
two_gpus() { # two_gpus NAME ARGS...: benchmarks.expert_parallel on 2 ranks, log and JSON NAME
  local name=$1
  shift
  # The launcher polls its stdin: give it one that stays open, not a closed one.
  logged "$results/$name.log" mlx.launch -n 2 --backend nccl -- \
    python3 -m benchmarks.expert_parallel "$@" --json "$results/$name.json" < <(sleep 3600)
}
if wanted ep-tests; then
  logged "$results/expert-parallel-tests.log" env MLX_MOE_PLAN_TEST_BACKEND=nccl \
    python3 -m pytest -q tests/test_expert_parallel.py tests/test_lm.py -k "expert_parallel or two_ranks"
fi
if wanted ep-models; then
  for model in qwen3-30b-a3b deepseek-v3; do
    two_gpus "expert-parallel-$model" --models "$model"
  done
fi
if wanted ep-variants; then
  # Expert parallelism without its per-layer sync (every rank's GEMMs over all
  # rows): which costs more, the sync or the rows it saves.
  two_gpus expert-parallel-no-sync --models qwen3-30b-a3b \
    --sides one,expert,expert+tensor --sync-from-entries 1000000000
  # Neither: the GEMMs over 5/8 of the capacity, the grouped kernel over the
  # rows past it (none unless a rank's experts draw 1.25 times their share).
  two_gpus expert-parallel-static-share --models qwen3-30b-a3b \
    --sides one,tensor+patch,expert,expert+tensor --static-share 0.625
  # Every sharded side decodes a batch of 1 slower than one GPU: whether MLX's
  # CUDA graphs, which take NCCL's calls in as captured child graphs, are why,
  # or NCCL's event nodes in them (graph mixing); the launcher hands the
  # environment on to the ranks.
  decode_sides=(--models qwen3-30b-a3b --sides one,tensor,tensor+patch,expert --prompts 2048
                --block-tokens 1,32 --batches 1,32 --rounds 1)
  two_gpus expert-parallel-graphs "${decode_sides[@]}"
  MLX_USE_CUDA_GRAPHS=0 two_gpus expert-parallel-no-graphs "${decode_sides[@]}"
  NCCL_GRAPH_MIXING_SUPPORT=0 two_gpus expert-parallel-no-graph-mixing "${decode_sides[@]}"
  # The patched sides (tensor+patch, expert) decode slower than mlx-lm's tensor
  # parallelism with the same kernels, and one GPU patched does not: whether
  # compiling the layers and blocks is why.
  two_gpus expert-parallel-no-compile "${decode_sides[@]}" --no-compile
fi
exit $status
