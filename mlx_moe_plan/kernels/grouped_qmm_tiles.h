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
// waited while those warps issued the wgmma instructions, whose issuing waits
// for the tensor cores: the two ran one after the other. Apart, the roles meet at two named barriers a step
// (ROLE_BARRIER: where ROLES_APART, one role waits there while the other
// only arrives): the multiplying warps arrive at EMPTY_BARRIER once the
// stage two back is multiplied, the making warps arrive at FULL_BARRIER once
// the stage is made. Where the prelude runs the group in lock-step
// (emulations: ROLES_APART 0) both are the group's barrier, and every warp
// runs the multiply-adds (the emulated ones meet barriers), the making
// warpgroups' sums thrown away.
// include: tiles_setup
// The run (tiles_run.h), every thread in every role: grouped_qmm_roles.h
// runs SPECIALIZED's (this body's launches have PRODUCER_WARPGROUPS 0).
{
  const bool makes = true;
  const bool multiplies = true;
  const bool stores = true;
  // include: tiles_run
}
