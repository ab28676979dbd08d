// tiles_begin: a text grouped_qmm_tiles.h includes, not a body. An item's
// beginning, item `item` of its run, the run's `begun_index`-th: its expert
// (the first whose blocks reach past its row block, in the scan
// `expert_blocks`), that expert's rows [first, last) and the block's first
// row, kept in the ring `item_places` (thread 0 writes; its products and
// store read them behind the barriers of the steps between); and where this
// thread's copies of its stages come from, from `first_stage` on: a row past
// the expert's copies its last row (with TOKEN_ROWS, the row's token,
// clamped into rows), a column past out_dims the last. The sources move a
// stage on after each copy: a pointer's add, where their place from the
// item's start took a product and a 64-bit add a copy at every stage. The
// body includes it before a run's steps (a run of one item) or at an item's
// first step (ACROSS_ITEMS), each in a scope of its own.
const int row_block = item % block_items / column_blocks;
const int column0 = (item % column_blocks) * BLOCK_COLUMNS;
int expert = 0;
for (int span = num_experts; span > 1;) {
  const int lower = span / 2;
  if (expert_blocks[expert + lower - 1] <= row_block) {
    expert += lower;
    span -= lower;
  } else {
    span = lower;
  }
}
const int first = min(max(expert_offsets[expert], 0), capacity);
const int last = min(max(expert_offsets[expert + 1], first), capacity);
const int own_block = row_block - (expert_blocks[expert]
                                   - (last - first + BLOCK_ROWS - 1) / BLOCK_ROWS);
const int row0 = first + own_block * BLOCK_ROWS;
if (LOCAL_ID == 0) {
  const int slot = 3 * (begun_index % ITEM_RING);
  item_places[slot] = expert;
  item_places[slot + 1] = row0;
  item_places[slot + 2] = last;
}
UNROLL
for (int i = 0; i < ROW_COPIES; ++i) {
  const int chunk = min(copy_thread + i * COPY_THREADS, BLOCK_ROWS * ROW_CHUNKS - 1);
  const int row = min(row0 + chunk / ROW_CHUNKS, last - 1);
  const int source = TOKEN_ROWS ? min(max(row_tokens[row], 0), num_rows - 1) : row;
  row_sources[i] = (GLOBAL const unsigned short*)rows + (i64)source * in_dims
                   + first_stage * STAGE_VALUES + (chunk % ROW_CHUNKS) * 8;
}
UNROLL
for (int i = 0; i < WORD_COPIES; ++i) {
  const int chunk = min(copy_thread + i * COPY_THREADS,
                        MATRICES * BLOCK_COLUMNS * COLUMN_CHUNKS - 1);
  const int column = chunk / COLUMN_CHUNKS;  // matrix column / BLOCK_COLUMNS
  const i64 column_row = (i64)expert * out_dims
                         + min(column0 + column % BLOCK_COLUMNS, out_dims - 1);
  word_sources[i] = (column < BLOCK_COLUMNS ? weight : up_weight)
                    + column_row * row_words + first_stage * STAGE_GROUPS * GROUP_WORDS
                    + (chunk % COLUMN_CHUNKS) * 4;
}
UNROLL
for (int i = 0; i < SCALE_COPIES; ++i) {
  const int entry = min(copy_thread + i * COPY_THREADS, STAGE_SCALES - 1);
  const int column = entry / STAGE_GROUPS;
  const i64 column_row = (i64)expert * out_dims
                         + min(column0 + column % BLOCK_COLUMNS, out_dims - 1);
  const i64 group_at = column_row * row_groups + first_stage * STAGE_GROUPS
                       + entry % STAGE_GROUPS;
  scale_sources[i] = (GLOBAL const unsigned short*)(column < BLOCK_COLUMNS ? scales
                                                                           : up_scales)
                     + group_at;
  bias_sources[i] = (GLOBAL const unsigned short*)(column < BLOCK_COLUMNS ? biases
                                                                          : up_biases)
                    + group_at;
}
