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
// COLUMN_WARPS * 32), MAX_EXPERTS, TILES, ROW_TILES, GATED, TOKEN_ROWS,
// OUT_BIAS, CLAMPED, ALPHA_BITS, LIMIT_BITS as there; ROW_WARPS, COLUMN_WARPS,
// BLOCK_ROWS (ROW_WARPS * 8 * ROW_TILES), BLOCK_COLUMNS (COLUMN_WARPS * 16 *
// TILES / (1 + GATED)), STAGE_GROUPS (dividing in_dims / QUANT_GROUP), STAGES
// (at least 2), ROW_STRIDE, WORD_STRIDE (above), INPUT_SPLITS (at most the
// stages; 1 when GATED), WARPGROUP (below), ACROSS_ITEMS (with INPUT_SPLITS
// 1 only: the runs of items, below).
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
// include: qmm_params
const int COLUMN_TILES = GATED ? TILES / 2 : TILES;
const int MATRICES = GATED ? 2 : 1;
const int STAGE_VALUES = STAGE_GROUPS * QUANT_GROUP;
const int GROUP_WORDS = QUANT_GROUP / VALUES;  // a column's words of a group
const int ROW_CHUNKS = STAGE_VALUES / 8;  // 16-byte chunks of a row a stage
// WARPGROUP's core matrices, 8 rows of a chunk (32 words) and the launch's
// pad after each (ROW_STRIDE is a row's share of them).
const int CORE_WORDS = ROW_STRIDE * 8 / ROW_CHUNKS;
const int COLUMN_CHUNKS = STAGE_GROUPS * GROUP_WORDS / 4;  // of a column a stage
const int ROW_COPIES = (BLOCK_ROWS * ROW_CHUNKS + THREADS - 1) / THREADS;
// A thread's row copies are ROW_STEP rows apart where THREADS is a multiple
// of a row's chunks (below: used where it is a multiple of 8 rows'), and
// their places in each layout ROW_TARGET_STEP words.
const int ROW_STEP = THREADS % ROW_CHUNKS == 0 ? THREADS / ROW_CHUNKS : 1;
const int ROW_TARGET_STEP = SHARED_WEIGHTS ? ROW_STEP * 32
                            : WARPGROUP ? ROW_STEP / 8 * ROW_CHUNKS * CORE_WORDS
                                        : ROW_STEP * ROW_STRIDE;
const int WORD_COPIES = (MATRICES * BLOCK_COLUMNS * COLUMN_CHUNKS + THREADS - 1) / THREADS;
const int SCALE_COPIES = (MATRICES * BLOCK_COLUMNS * STAGE_GROUPS + THREADS - 1) / THREADS;
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
// The warp's place among the block's warps, and its warpgroup (WARPGROUP),
// each said the same in all its lanes (WARP_UNIFORM): wgmma's descriptors,
// which follow from them, are then computed in uniform registers.
const int row_warp = WARP_UNIFORM(warp / COLUMN_WARPS);
const int column_warp = WARP_UNIFORM(warp % COLUMN_WARPS);
const int warpgroup = WARP_UNIFORM(warp / 4);

// Each expert's row blocks, scanned: thread t counts experts [t *
// MAX_EXPERTS / THREADS, ...), as grouped_qmm.h lists its experts. Offsets
// out of [0, capacity] would come from a broken plan; clamped here and
// below, no row outside out is ever touched.
int own_blocks = 0;
int blocks_of[MAX_EXPERTS / THREADS];  // this thread's experts' row blocks
UNROLL
for (int k = 0; k < MAX_EXPERTS / THREADS; ++k) {
  const int expert = LOCAL_ID * (MAX_EXPERTS / THREADS) + k;
  blocks_of[k] = 0;
  if (expert < num_experts) {
    const int first = min(max(expert_offsets[expert], 0), capacity);
    const int last = min(max(expert_offsets[expert + 1], first), capacity);
    blocks_of[k] = (last - first + BLOCK_ROWS - 1) / BLOCK_ROWS;
  }
  own_blocks += blocks_of[k];
}
const int scan_value = own_blocks;
const int scan_threads = THREADS;
// include: group_scan
int blocks_before = group_scan[LOCAL_ID] - own_blocks;
UNROLL
for (int k = 0; k < MAX_EXPERTS / THREADS; ++k) {
  const int expert = LOCAL_ID * (MAX_EXPERTS / THREADS) + k;
  blocks_before += blocks_of[k];
  if (expert < num_experts) {
    expert_blocks[expert] = blocks_before;
  }
}
const int expert_row_blocks = group_scan[THREADS - 1];
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
// swizzled slabs. Where THREADS is a multiple of 8 rows' chunks, copy i is
// ROW_STEP rows past copy 0, at the same chunk, and every layout repeats
// each 8 rows: its place is copy 0's plus a constant, so the compiler keeps
// one register for all the copies, not one a copy or each place computed
// again every stage. (A copy past the block is never made.)
GLOBAL const unsigned short* row_sources[ROW_COPIES];
int row_targets[ROW_COPIES];
UNROLL
for (int i = 0; i < ROW_COPIES; ++i) {
  const int chunk = min((int)LOCAL_ID + i * THREADS, BLOCK_ROWS * ROW_CHUNKS - 1);
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
  const int chunk = min((int)LOCAL_ID + i * THREADS,
                        MATRICES * BLOCK_COLUMNS * COLUMN_CHUNKS - 1);
  // As the rows', where THREADS is a multiple of a column's chunks.
  word_targets[i] = i > 0 && THREADS % COLUMN_CHUNKS == 0
                        ? word_targets[0] + i * (THREADS / COLUMN_CHUNKS) * WORD_STRIDE
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

// The group's items GROUP_ID, GROUP_ID + NUM_GROUPS, ... in runs of stages:
// each item a run of its own, or with ACROSS_ITEMS (INPUT_SPLITS 1) all
// the group's items of the experts' rows one run, begun at its first item,
// so that an item's first stages are copied while the item before is
// multiplied and stored (the launch then takes a group or so an SM, each
// of many items). The tail rows' items store zeros.
for (int run_item = GROUP_ID; run_item < block_items * INPUT_SPLITS; run_item += NUM_GROUPS) {
  if (run_item % block_items >= expert_items) {  // the tail rows: zeros
    const int input_split = run_item / block_items;
    const int row_block = run_item % block_items / column_blocks;
    const int column0 = (run_item % column_blocks) * BLOCK_COLUMNS;
    const int row0 = tail_first + (row_block - expert_row_blocks) * BLOCK_ROWS;
    for (int i = LOCAL_ID; i < BLOCK_ROWS * BLOCK_COLUMNS; i += THREADS) {
      const int row = row0 + i / BLOCK_COLUMNS;
      const int column = column0 + i % BLOCK_COLUMNS;
      if (row < capacity && column < out_dims) {
        STORE_OUT(out, ((i64)input_split * capacity + row) * out_dims + column, 0.0f);
      }
    }
    continue;
  }
  if (ACROSS_ITEMS && run_item != GROUP_ID) {
    continue;  // multiplied in the group's run
  }
  // The run's items and their stages, one after another: an item's are
  // [first_stage, first_stage + num_stages) of the row's, its split's
  // (STAGE_GROUPS divides the row; the launch gives each split one or more).
  const int run_items = ACROSS_ITEMS ? (expert_items - GROUP_ID + NUM_GROUPS - 1) / NUM_GROUPS
                                     : 1;
  const int input_split = run_item / block_items;
  const int first_stage = input_split * all_stages / INPUT_SPLITS;
  const int num_stages = (input_split + 1) * all_stages / INPUT_SPLITS - first_stage;
  const int run_stages = run_items * num_stages;
  int product_live_row_tiles = 0;  // the multiplied item's
UNROLL
  for (int i = 0; i < TILES * ROW_TILES * 4; ++i) {
    sums[i] = 0.0f;
  }
  BARRIER();  // the previous run's last stage and places are read by every warp
  if (!ACROSS_ITEMS) {  // a run of one item: its beginning before its steps
    const int begun_index = 0;
    const int item = run_item;
    // include: tiles_begin
    product_live_row_tiles = (min(last - row0, BLOCK_ROWS) + 7) / 8;
  }
  // Step s copies stage s (while there is one) and computes stage s - AHEAD:
  // AHEAD stages are in flight while one is multiplied. With WEIGHTS_AHEAD,
  // step s makes stage s - AHEAD's weights and multiplies the stage before.
  // An item's steps multiply its stages (the first item's also those before,
  // which only copy) and meanwhile copy the stages AHEAD on, the next item's
  // first among them; its sums are stored after them, outside the step loop:
  // a warpgroup's sums read inside it make ptxas wait for every batch at
  // each step's end (its C7517), and zeros written there serialize them all.
  for (int item_index = 0; item_index < run_items; ++item_index) {
    const int end_step = (item_index + 1) * num_stages + AHEAD + LAG;
    for (int step = ACROSS_ITEMS && item_index > 0 ? end_step - num_stages : 0; step < end_step;
         ++step) {
      const int stage = step - AHEAD;
      const int product_stage = stage - LAG;
      if (step > 0 && step - 1 < run_stages) {  // the last step's scales, arrived by now
        const int into = ((step - 1) % STAGES) * 2 * STAGE_SCALES;
UNROLL
        for (int i = 0; i < SCALE_COPIES; ++i) {
          const int entry = (int)LOCAL_ID + i * THREADS;
          if (entry < STAGE_SCALES) {
            // The pair (value, value), made here: an operation on a loaded
            // value right after its load would wait for it there.
            stage_scales[into + entry] = pending_scales[i] | (pending_scales[i] << 16);
            stage_scales[into + STAGE_SCALES + entry] =
                pending_biases[i] | (pending_biases[i] << 16);
          }
        }
      }
      // Stage `stage`'s copies have landed (this thread's; none are waited for
      // while stage < 0), then every thread's, and the buffers this step
      // copies into are free: stage - 1's (its warpgroup multiply-adds done:
      // they read the rows until then), with SHARED_WEIGHTS stage - 2's (each
      // warpgroup waited for them in the last step).
      if (WARPGROUP && !SHARED_WEIGHTS) {
        WARPGROUP_WAIT(0, sums, 0);
      }
      ASYNC_WAIT(AHEAD - 1);
      if (WARPGROUP) {
        SHARED_PROXY_FENCE();
      }
      BARRIER();
      if (step < run_stages) {
        if (ACROSS_ITEMS && step % num_stages == 0) {  // an item's first stage
          const int begun_index = step / num_stages;
          const int item = run_item + begun_index * NUM_GROUPS;
          // include: tiles_begin
        }
        const int buffer = step % STAGES;
        SHARED_SPACE unsigned* rows_into = stage_rows + buffer * BLOCK_ROWS * ROW_STRIDE;
        SHARED_SPACE unsigned* words_into = stage_words
                                            + buffer * MATRICES * BLOCK_COLUMNS * WORD_STRIDE;
        // One branch a stage, not one a copy: the copies then issue back to
        // back, and a count that THREADS divides needs no bound check.
        if (vectors) {
UNROLL
          for (int i = 0; i < ROW_COPIES; ++i) {
            if (ROW_COPIES * THREADS == BLOCK_ROWS * ROW_CHUNKS
                || (int)LOCAL_ID + i * THREADS < BLOCK_ROWS * ROW_CHUNKS) {
              ASYNC_COPY16(rows_into + row_targets[i], row_sources[i]);
            }
          }
UNROLL
          for (int i = 0; i < WORD_COPIES; ++i) {
            if (WORD_COPIES * THREADS == MATRICES * BLOCK_COLUMNS * COLUMN_CHUNKS
                || (int)LOCAL_ID + i * THREADS < MATRICES * BLOCK_COLUMNS * COLUMN_CHUNKS) {
              ASYNC_COPY16(words_into + word_targets[i], word_sources[i]);
            }
          }
        } else {
          for (int i = 0; i < ROW_COPIES; ++i) {
            if ((int)LOCAL_ID + i * THREADS < BLOCK_ROWS * ROW_CHUNKS) {
UNROLL
              for (int j = 0; j < 4; ++j) {
                rows_into[row_targets[i] + j] =
                    (unsigned)row_sources[i][2 * j]
                    | ((unsigned)row_sources[i][2 * j + 1] << 16);
              }
            }
          }
          for (int i = 0; i < WORD_COPIES; ++i) {
            if ((int)LOCAL_ID + i * THREADS < MATRICES * BLOCK_COLUMNS * COLUMN_CHUNKS) {
UNROLL
              for (int j = 0; j < 4; ++j) {
                words_into[word_targets[i] + j] = word_sources[i][j];
              }
            }
          }
        }
UNROLL
        for (int i = 0; i < SCALE_COPIES; ++i) {
          pending_scales[i] = scale_sources[i][0];
          pending_biases[i] = bias_sources[i][0];
        }
        // The next stage's.
UNROLL
        for (int i = 0; i < ROW_COPIES; ++i) {
          row_sources[i] += STAGE_VALUES;
        }
UNROLL
        for (int i = 0; i < WORD_COPIES; ++i) {
          word_sources[i] += STAGE_GROUPS * GROUP_WORDS;
        }
UNROLL
        for (int i = 0; i < SCALE_COPIES; ++i) {
          scale_sources[i] += STAGE_GROUPS;
          bias_sources[i] += STAGE_GROUPS;
        }
      }
      ASYNC_COMMIT();
      // The buffers of the stage multiplied this step (while product_stage >= 0).
      const int buffer = max(product_stage, 0) % STAGES;
      const int rows_at = buffer * BLOCK_ROWS * ROW_STRIDE
                          + row_warp * 8 * ROW_TILES * ROW_STRIDE;
      const int words_at = buffer * MATRICES * BLOCK_COLUMNS * WORD_STRIDE;
      const int scales_at = buffer * 2 * STAGE_SCALES;
      const int warp_column = column_warp * 16 * COLUMN_TILES;
      const int weights_at = max(product_stage, 0) % 2 * WEIGHT_WORDS;
      // The weights of the stage `stage`, made into its buffers (stage_words,
      // stage_scales at made_words_at, made_scales_at; stage_weights at
      // made_at): then a barrier shows them to the products of the same step,
      // or with WEIGHTS_AHEAD the next step's one barrier does, the products of
      // the stage before them issued first to run meanwhile and waited for
      // after. Without it they are the products' offsets, named once: computed
      // twice, nvcc kept both (13 more instructions a stage).
      const int made_buffer = max(stage, 0) % STAGES;
      const int made_words_at = LAG ? made_buffer * MATRICES * BLOCK_COLUMNS * WORD_STRIDE
                                    : words_at;
      const int made_scales_at = LAG ? made_buffer * 2 * STAGE_SCALES : scales_at;
      const int made_at = LAG ? max(stage, 0) % 2 * WEIGHT_WORDS : weights_at;
      if (SHARED_WEIGHTS && !WEIGHTS_AHEAD) {
        if (stage >= 0) {
          // include: tiles_weights
        }
        // Made for every thread, and for the multiply-adds' reads (the async
        // proxy's).
        SHARED_PROXY_FENCE();
        BARRIER();
      }
      if (ACROSS_ITEMS && product_stage >= 0 && product_stage % num_stages == 0) {
        // An item's first product: the block's 8-row tiles that hold rows of
        // its expert.
        const int slot = 3 * (product_stage / num_stages % ITEM_RING);
        product_live_row_tiles = (min(item_places[slot + 2] - item_places[slot + 1], BLOCK_ROWS)
                                  + 7) / 8;
      }
      if (product_stage >= 0) {
        // An expert's last block is part empty (most are, at prefill sizes and
        // under skewed routing): where its rows fill half a warp's row tiles
        // or fewer (ROW_TILES / 2, all in the first warp row), every warp
        // multiplies that half only; the bound is the same for the whole
        // group (the emulated MMA_16x8x16 meets a barrier). The products'
        // text twice, not a bound a row tile: a branch inside the unrolled
        // loop kept its loads and multiply-adds from overlapping and slowed
        // full blocks. One copy for a warp of one row tile (no half) and of
        // more than 8 (the tall blocks, from 512 rows an expert, whose last
        // blocks are a small share of the work: the second copy slowed them).
        if (ROW_TILES < 2 || ROW_TILES > 8 || product_live_row_tiles > ROW_TILES / 2) {
          const int product_row_tiles = ROW_TILES;
          // include: tiles_products
        } else {
          const int product_row_tiles = ROW_TILES / 2;
          // include: tiles_products
        }
      }
      if (SHARED_WEIGHTS && WEIGHTS_AHEAD) {
        if (stage >= 0 && stage < run_stages) {
          // include: tiles_weights
        }
        WARPGROUP_WAIT(0, sums, 0);
      }
    }
    // Its sums, finished, stored; the next item's from zero.
    {
      const int item = run_item + (ACROSS_ITEMS ? item_index * NUM_GROUPS : 0);
      const int slot = ACROSS_ITEMS ? 3 * (item_index % ITEM_RING) : 0;
      // include: tiles_end
    }
    if (item_index + 1 < run_items) {
UNROLL
      for (int i = 0; i < TILES * ROW_TILES * 4; ++i) {
        sums[i] = 0.0f;
      }
    }
  }
}
