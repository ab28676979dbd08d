// tiles_setup: a text grouped_qmm_tiles.h and grouped_qmm_roles.h include,
// not a body: their constants, group memory, the experts' row blocks scanned,
// and each thread's copies' places and registers, before the group's run
// (tiles_run.h); grouped_qmm_tiles.h says what each is.
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

