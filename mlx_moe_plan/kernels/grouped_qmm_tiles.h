// grouped_qmm_tiles: grouped_qmm.h's GEMM for many rows an expert (prefill),
// in block tiles staged in shared memory. Same inputs, outputs (but split
// sums, INPUT_SPLITS below) and params as grouped_qmm.h: out[row] =
// rows[row] @ dequantize(weight[e]).T (+ bias[e] with OUT_BIAS) for every
// row of expert e's span, zeros on the tail rows,
// the row counts read here, on the device, and no host sync.
// grouped_qmm.h has each warp read its weights from memory once per pass of
// 8 * ROW_TILES rows, which is what decoding wants (a few rows an expert)
// and what prefill cannot afford (hundreds). Here a group computes a block
// of BLOCK_ROWS rows of one expert by BLOCK_COLUMNS columns: it stages the
// block's rows and packed weights, STAGE_GROUPS quantization groups of the
// input at a time, in shared memory, STAGES stages in flight (asynchronous
// copies where the prelude has them, ASYNC_COPY16), and its warps multiply
// from there, so every weight a group reads serves BLOCK_ROWS rows and every
// row BLOCK_COLUMNS columns.
// The work is (input split, row block, column block) items: every group
// first counts each expert's blocks of BLOCK_ROWS rows and scans them
// (expert_blocks: blocks up to and including the expert), then takes items
// GROUP_ID, GROUP_ID + NUM_GROUPS, ... of the row blocks, column-block
// fastest, then of the tail rows' blocks, input split slowest. The host
// sizes the grid from the capacity alone.
// INPUT_SPLITS > 1 splits each block's input among that many groups, for a
// GEMM of too few blocks to fill the GPU (a dense projection of a decoding
// batch): each walks its share of the stages, a chain of waits on memory
// that many groups then overlap. Split s stores its float sums in out[s]
// ([INPUT_SPLITS, capacity, out_dims], float32; the bias in split 0's
// only), and the host adds the splits in order (combine.h: the bits fixed).
// A gated launch is never split (SwiGLU needs the whole sums).
// The products are grouped_qmm.h's warp multiply-add, MMA_16x8x16, in its
// layout (its comments say why): A the weights of 16 columns, B the rows'
// values of 8 rows, lane (r = lane / 4, slot = lane % 4) holding the slot-th
// quarter of a quantization group's inputs, a word's fields taken as pairs
// of neighbours (2p, 2p + 1), as the rows' values lie (qmm_fields.h, which
// tiles_products.h, the stage's multiply-adds, includes).
// But where grouped_qmm.h applies each group's scale and bias to float sums
// of the exact fields, which costs two accumulators a sum and a
// multiply-add with ones a row tile, here the
// weight itself goes in: scale * q + bias, rounded once to the rows' 16-bit
// format (PAIR_FMA), as MLX's own quantized GEMMs dequantize; float sums over
// the whole row. A warp computes TILES tiles of 16 columns (when GATED, the
// first half the gate's, the second up's of the same columns) by ROW_TILES
// tiles of 8 rows; ROW_WARPS by COLUMN_WARPS warps cover the block.
// Shared memory (launch.py sizes it for the backend): STAGES buffers of the
// block's rows, BLOCK_ROWS rows of ROW_STRIDE words (STAGE_GROUPS *
// QUANT_GROUP values, padded), of its packed columns, (1 + GATED) *
// BLOCK_COLUMNS columns of WORD_STRIDE words, and of their scales and biases
// as 16-bit pairs. launch.py pads the strides so that the warps' loads from
// them (tiles_products.h) meet no bank conflict where padding can avoid one.
// Inputs, outputs and params: grouped_qmm.h's (column_blocks: blocks of
// BLOCK_COLUMNS columns that cover out_dims; with INPUT_SPLITS > 1, out is
// the splits' float sums, above). Template constants: InT, OutT,
// IN_KIND, BITS, VALUES, QUANT_GROUP, LANE_WORDS, THREADS (ROW_WARPS *
// COLUMN_WARPS * 32, and 128 a making warpgroup), MAX_EXPERTS, TILES, ROW_TILES,
// GATED, TOKEN_ROWS,
// OUT_BIAS, CLAMPED, ALPHA_BITS, LIMIT_BITS as there; ROW_WARPS, COLUMN_WARPS,
// BLOCK_ROWS (ROW_WARPS * 8 * ROW_TILES), BLOCK_COLUMNS (COLUMN_WARPS * 16 *
// TILES / (1 + GATED)), STAGE_GROUPS (dividing in_dims / QUANT_GROUP), STAGES
// (at least 2), ROW_STRIDE, WORD_STRIDE (above), INPUT_SPLITS (at most the
// stages; 1 when GATED), WARPGROUP (below), ACROSS_ITEMS (with INPUT_SPLITS
// 1 only: the runs of items, below), PRODUCER_WARPGROUPS, MMA_REGISTERS and
// MAKING_REGISTERS (below).
// WARPGROUP: the block's four warps multiply as one warpgroup
// (WARPGROUP_MMA, Hopper's wgmma where the prelude has it), each step of 16
// input values one multiply-add of all BLOCK_ROWS rows by a tile of each
// warp's columns: the rows' B is read from shared memory by the hardware,
// not loaded and paired by the lanes, and one instruction does the work of
// 2 * ROW_TILES of a warp's MMA_16x8x16. Its rows are staged in the layout it
// reads (core matrices: 8 rows of one 16-byte chunk, 128 bytes; a row's
// chunks one after another, each core matrix padded by 16 bytes; 8 rows'
// after the 8 before). Needs ROW_WARPS 1, COLUMN_WARPS 4 and ROW_TILES 8 or
// 16 (tiles_products.h).
// SHARED_WEIGHTS (with WARPGROUP): the group's threads make the stage's
// weights 16-bit once, together, into group memory (two buffers), and each
// warpgroup's multiply-adds read both operands there: a stage is then a
// batch of asynchronous multiply-adds, which run while the threads make the
// next stage's weights, and the lanes make no weights inside the products.
// A warpgroup's A is its 64 columns of each matrix (COLUMN_TILES 1;
// COLUMN_WARPS 4 or 8: one or two warpgroups). Both operands lie in slabs
// of 64 values, a row's 128 bytes after the row before, 128-byte swizzled
// (SWIZZLE128: core matrices without the swizzle read slower): 8 lanes' 16-byte
// copies of a row's chunks, and 8 lanes' stores of a chunk of 8 columns,
// meet no bank conflict either. One fewer stage of copies is in flight
// (AHEAD): a stage's rows are read until its multiply-adds end, a stage
// after they were issued. Needs STAGES of 3 or more, STAGE_VALUES a
// multiple of 64; takes ROW_TILES 6, 10, 12, 20 and 24 too (N of 48, 80, 96,
// 160 and 192: blocks that an expert of about as many rows fills once).
// PRODUCER_WARPGROUPS (SPECIALIZED, with SHARED_WEIGHTS; not WEIGHTS_AHEAD,
// ACROSS_ITEMS or INPUT_SPLITS): that many warpgroups more, after the
// multiplying ones, copy the stages and make their weights, and the
// multiplying warps only multiply and store. Where the same warps made a
// stage's weights and issued its multiply-adds, the making of the next stage
// waited behind the issue, which waits for the tensor cores: the two ran one
// after the other. Apart, the roles meet at two named barriers a step
// (ROLE_BARRIER: where ROLES_APART, one role waits there while the other
// only arrives): the multiplying warps arrive at EMPTY_BARRIER once the
// stage two back is multiplied, the making warps arrive at FULL_BARRIER once
// the stage is made. Where the prelude runs the group in lock-step
// (emulations: ROLES_APART 0) both are the group's barrier, and every warp
// runs the multiply-adds (the emulated ones meet barriers), the making
// warpgroups' sums thrown away.
// include: qmm_params
const int COLUMN_TILES = GATED ? TILES / 2 : TILES;
// The warps that multiply (all but SPECIALIZED's making ones), and those that
// copy the stages and make their weights: all where not SPECIALIZED, as the
// thread copy_thread of COPY_THREADS.
const bool SPECIALIZED = PRODUCER_WARPGROUPS > 0;
const int MMA_THREADS = THREADS - 128 * PRODUCER_WARPGROUPS;
const int COPY_THREADS = SPECIALIZED ? 128 * PRODUCER_WARPGROUPS : THREADS;
const int copy_thread = SPECIALIZED ? max((int)LOCAL_ID - MMA_THREADS, 0) : (int)LOCAL_ID;
const int EMPTY_BARRIER = 1, FULL_BARRIER = 2;
const int MATRICES = GATED ? 2 : 1;
const int STAGE_VALUES = STAGE_GROUPS * QUANT_GROUP;
const int GROUP_WORDS = QUANT_GROUP / VALUES;  // a column's words of a group
const int ROW_CHUNKS = STAGE_VALUES / 8;  // 16-byte chunks of a row a stage
// WARPGROUP's core matrices, 8 rows of a chunk (32 words) and the launch's
// pad after each (ROW_STRIDE is a row's share of them).
const int CORE_WORDS = ROW_STRIDE * 8 / ROW_CHUNKS;
const int COLUMN_CHUNKS = STAGE_GROUPS * GROUP_WORDS / 4;  // of a column a stage
const int ROW_COPIES = (BLOCK_ROWS * ROW_CHUNKS + COPY_THREADS - 1) / COPY_THREADS;
// A thread's row copies are ROW_STEP rows apart where COPY_THREADS is a
// multiple of a row's chunks (below: used where it is a multiple of 8 rows'),
// and their places in each layout ROW_TARGET_STEP words.
const int ROW_STEP = COPY_THREADS % ROW_CHUNKS == 0 ? COPY_THREADS / ROW_CHUNKS : 1;
const int ROW_TARGET_STEP = SHARED_WEIGHTS ? ROW_STEP * 32
                            : WARPGROUP ? ROW_STEP / 8 * ROW_CHUNKS * CORE_WORDS
                                        : ROW_STEP * ROW_STRIDE;
const int WORD_COPIES = (MATRICES * BLOCK_COLUMNS * COLUMN_CHUNKS + COPY_THREADS - 1)
                        / COPY_THREADS;
const int SCALE_COPIES = (MATRICES * BLOCK_COLUMNS * STAGE_GROUPS + COPY_THREADS - 1)
                         / COPY_THREADS;
const int STAGE_SCALES = MATRICES * BLOCK_COLUMNS * STAGE_GROUPS;
// Stages of copies in flight while one is multiplied (SHARED_WEIGHTS above).
const int AHEAD = SHARED_WEIGHTS ? STAGES - 2 : STAGES - 1;
// WEIGHTS_AHEAD (with SHARED_WEIGHTS): a stage's weights are made a step
// before its multiply-adds, while the stage before it is multiplied, so one
// barrier a step both shows them and frees the buffers (else a second,
// between the weights made and their products). Each warpgroup waits for its
// batch at the end of the step: the next step's copies refill the rows'
// buffer it read, and the next step's making rewrites the weights' buffer,
// from threads of every warpgroup.
const int LAG = SHARED_WEIGHTS && WEIGHTS_AHEAD ? 1 : 0;
// SHARED_WEIGHTS: a buffer of the stage's weights made 16-bit, MATRICES *
// BLOCK_COLUMNS columns of STAGE_VALUES, in slabs of 64 values (the
// matrices' columns, 32 words each, one after another), and the same of the
// rows.
const int WEIGHT_WORDS = SHARED_WEIGHTS ? MATRICES * BLOCK_COLUMNS * STAGE_VALUES / 2 : 0;
const int WEIGHT_SLAB_WORDS = MATRICES * BLOCK_COLUMNS * 32;
const int ROW_SLAB_WORDS = BLOCK_ROWS * 32;
// 16-byte copies need 16-byte rows and matrices (in_dims is a multiple of 32
// values, so their rows are): MLX's fresh arrays are, a view need not be.
const bool vectors = IS_ALIGNED16(rows) && IS_ALIGNED16(weight) && IS_ALIGNED16(up_weight);
// The stages: rows, then (SHARED_WEIGHTS) two buffers of the weights made
// 16-bit, then packed columns, then scales and biases as pairs (value,
// value); in the launch's dynamic memory on CUDA (SHARED_WORDS), whose
// swizzled buffers start 1024-byte aligned, within the 256 words more the
// launch leaves (launch.SWIZZLE_ALIGN_BYTES).
SHARED_WORDS(stage_memory, STAGES * (BLOCK_ROWS * ROW_STRIDE + MATRICES * BLOCK_COLUMNS
                                     * (WORD_STRIDE + 2 * STAGE_GROUPS)) + 2 * WEIGHT_WORDS
                           + (SHARED_WEIGHTS ? 256 : 0));
SHARED_SPACE unsigned* stage_rows = SHARED_WEIGHTS ? SHARED_ALIGN1024(stage_memory)
                                                   : stage_memory;
SHARED_SPACE unsigned* stage_weights = stage_rows + STAGES * BLOCK_ROWS * ROW_STRIDE;
SHARED_SPACE unsigned* stage_words = stage_weights + 2 * WEIGHT_WORDS;
SHARED_SPACE unsigned* stage_scales = stage_words
                                      + STAGES * MATRICES * BLOCK_COLUMNS * WORD_STRIDE;
SHARED int expert_blocks[MAX_EXPERTS];
// The items a run has begun to copy and not yet stored (at most one more
// than the stages in flight, AHEAD + LAG, and the one multiplied): each
// one's expert, block's first row and expert's end, in slot (its place in
// the run) % ITEM_RING, written by thread 0 when its copies begin and read,
// behind the barriers of the steps between, by its products and store.
const int ITEM_RING = STAGES + 1;
SHARED int item_places[3 * (STAGES + 1)];  // 3 * ITEM_RING
SHARED int group_scan[THREADS];
SHARED unsigned mma_exchange[THREADS * 6];  // the emulated MMA_16x8x16's (OpenCL)
const int warp_exchange = warp * 32 * 6;
// The warp's place among the block's multiplying warps (a making warp's,
// which multiplies only in lock-step emulations, that of the multiplying
// warp as many warps before it as multiply), and its warpgroup (WARPGROUP),
// each said the same
// in all its lanes (WARP_UNIFORM): wgmma's descriptors, which follow from
// them, are then computed in uniform registers.
const int mma_warp = SPECIALIZED ? warp % (MMA_THREADS / 32) : warp;
const int row_warp = WARP_UNIFORM(mma_warp / COLUMN_WARPS);
const int column_warp = WARP_UNIFORM(mma_warp % COLUMN_WARPS);
const int warpgroup = WARP_UNIFORM(mma_warp / 4);

// Each expert's row blocks, scanned: thread t of the first MMA_THREADS (a
// divisor of MAX_EXPERTS) counts experts [t * MAX_EXPERTS / MMA_THREADS,
// ...), as grouped_qmm.h lists its experts. Offsets
// out of [0, capacity] would come from a broken plan; clamped here and
// below, no row outside out is ever touched.
int own_blocks = 0;
int blocks_of[MAX_EXPERTS / MMA_THREADS];  // this thread's experts' row blocks
UNROLL
for (int k = 0; k < MAX_EXPERTS / MMA_THREADS; ++k) {
  const int expert = LOCAL_ID * (MAX_EXPERTS / MMA_THREADS) + k;
  blocks_of[k] = 0;
  if ((!SPECIALIZED || (int)LOCAL_ID < MMA_THREADS) && expert < num_experts) {
    const int first = min(max(expert_offsets[expert], 0), capacity);
    const int last = min(max(expert_offsets[expert + 1], first), capacity);
    blocks_of[k] = (last - first + BLOCK_ROWS - 1) / BLOCK_ROWS;
  }
  own_blocks += blocks_of[k];
}
const int scan_value = own_blocks;
const int scan_threads = MMA_THREADS;
// include: group_scan
int blocks_before = group_scan[LOCAL_ID] - own_blocks;
UNROLL
for (int k = 0; k < MAX_EXPERTS / MMA_THREADS; ++k) {
  const int expert = LOCAL_ID * (MAX_EXPERTS / MMA_THREADS) + k;
  blocks_before += blocks_of[k];
  if ((!SPECIALIZED || (int)LOCAL_ID < MMA_THREADS) && expert < num_experts) {
    expert_blocks[expert] = blocks_before;
  }
}
const int expert_row_blocks = group_scan[MMA_THREADS - 1];
const int tail_first = min(max(expert_offsets[num_experts], 0), capacity);
const int tail_blocks = (capacity - tail_first + BLOCK_ROWS - 1) / BLOCK_ROWS;
BARRIER();

// Every branch and loop bound below is the same for the whole group (the
// emulated MMA_16x8x16 meets a barrier): copies past a bound read the last
// row, column or group inside it, and nothing past one is stored.
const int block_items = (expert_row_blocks + tail_blocks) * column_blocks;
const int expert_items = expert_row_blocks * column_blocks;  // of each split
const int all_stages = row_groups / STAGE_GROUPS;
// What this thread copies each stage: its chunks of the block's rows, of
// the packed columns and of their scales and biases (an item's first stage
// says from where, below); where they land in group memory is the same for
// every item.
// With WARPGROUP, core matrices (CORE_WORDS apart): the 8 lanes of one
// 16-byte copy's pass take 8 chunks of a row, each in its own core matrix,
// which the pad after each puts in other banks. With SHARED_WEIGHTS,
// swizzled slabs. Where COPY_THREADS is a multiple of 8 rows' chunks, copy i is
// ROW_STEP rows past copy 0, at the same chunk, and every layout repeats
// each 8 rows: its place is copy 0's plus a constant, so the compiler keeps
// one register for all the copies, not one a copy or each place computed
// again every stage. (A copy past the block is never made.)
GLOBAL const unsigned short* row_sources[ROW_COPIES];
int row_targets[ROW_COPIES];
UNROLL
for (int i = 0; i < ROW_COPIES; ++i) {
  const int chunk = min(copy_thread + i * COPY_THREADS, BLOCK_ROWS * ROW_CHUNKS - 1);
  const int block_row = chunk / ROW_CHUNKS;
  const int row_chunk = chunk % ROW_CHUNKS;
  row_targets[i] = i > 0 && ROW_STEP % 8 == 0 ? row_targets[0] + i * ROW_TARGET_STEP
                 : SHARED_WEIGHTS ? (row_chunk / 8) * ROW_SLAB_WORDS
                                    + SWIZZLE128(block_row * 32 + (row_chunk % 8) * 4)
                 : WARPGROUP ? ((block_row / 8) * ROW_CHUNKS + row_chunk) * CORE_WORDS
                               + (block_row % 8) * 4
                             : block_row * ROW_STRIDE + row_chunk * 4;
}
GLOBAL const unsigned* word_sources[WORD_COPIES];
int word_targets[WORD_COPIES];
UNROLL
for (int i = 0; i < WORD_COPIES; ++i) {
  const int chunk = min(copy_thread + i * COPY_THREADS,
                        MATRICES * BLOCK_COLUMNS * COLUMN_CHUNKS - 1);
  // As the rows', where COPY_THREADS is a multiple of a column's chunks.
  word_targets[i] = i > 0 && COPY_THREADS % COLUMN_CHUNKS == 0
                        ? word_targets[0] + i * (COPY_THREADS / COLUMN_CHUNKS) * WORD_STRIDE
                        : chunk / COLUMN_CHUNKS * WORD_STRIDE + (chunk % COLUMN_CHUNKS) * 4;
}
GLOBAL const unsigned short* scale_sources[SCALE_COPIES];
GLOBAL const unsigned short* bias_sources[SCALE_COPIES];
// sums[(t * ROW_TILES + n) * 4 + e]: tile t's column fragment_row + 8 * (e / 2),
// row n * 8 + 2 * fragment_slot + e % 2 of the warp's (the accumulator layout).
float sums[TILES * ROW_TILES * 4];
// A stage's scales and biases (2 bytes each, too small to copy
// asynchronously) go through registers: loaded when the stage's copies are
// issued, stored one step later, after a stage's multiply-adds (a plain
// load's first use holds the thread until it arrives).
unsigned pending_scales[SCALE_COPIES];
unsigned pending_biases[SCALE_COPIES];

// SPECIALIZED's launch runs one group an SM (Launch.min_groups), a thread's
// registers then an SM's 65536 over its threads, 8 at a time; where those are
// too few for the multiplying warps' sums (MMA_REGISTERS, else 0), each role
// takes what launch.py gives it (WARP_REGISTERS: more, or fewer).
const int LAUNCH_REGISTERS = 65536 / THREADS / 8 * 8;
// The run, in the roles each thread takes (tiles_run.h): every one where
// not SPECIALIZED, and in the lock-step emulations, where each multiplies and
// a making thread's sums are thrown away; else each role its own copy of the
// text, whose registers the compiler then allocates for that role alone (a
// making warp holds no sums, a multiplying one no copies' sources).
if (!SPECIALIZED || !ROLES_APART) {
  const bool makes = !SPECIALIZED || (int)LOCAL_ID >= MMA_THREADS;
  const bool multiplies = true;
  const bool stores = !SPECIALIZED || (int)LOCAL_ID < MMA_THREADS;
  // include: tiles_run
}
// Apart, each role's warps meet the group's barriers (an item's first,
// BARRIER) at their own copy's place. CUDA's __syncthreads is the aligned
// bar.sync 0, which PTX defines for threads at one place; the hardware counts
// the warps that arrive, wherever, and the GPU tests pass, but the
// non-aligned barrier.sync is the form PTX defines for two places (to do).
if (SPECIALIZED && ROLES_APART) {
  if ((int)LOCAL_ID >= MMA_THREADS) {
    if (MMA_REGISTERS) {
      WARP_REGISTERS(MAKING_REGISTERS, MAKING_REGISTERS > LAUNCH_REGISTERS);
    }
    const bool makes = true;
    const bool multiplies = false;
    const bool stores = false;
    // include: tiles_run
  } else {
    if (MMA_REGISTERS) {
      WARP_REGISTERS(MMA_REGISTERS, MMA_REGISTERS > LAUNCH_REGISTERS);
    }
    const bool makes = false;
    const bool multiplies = true;
    const bool stores = true;
    // include: tiles_run
  }
}
