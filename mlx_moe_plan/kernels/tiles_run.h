// tiles_run: a text grouped_qmm_tiles.h includes, not a body. The group's
// run over its items, in the roles the including place gives: `makes`
// (copies the stages and makes their weights), `multiplies` (the stages'
// multiply-adds), `stores` (the items' sums); grouped_qmm_tiles.h includes it
// once for every role at once, and once a role where the roles run apart
// (SPECIALIZED). The roles meet at the steps' barriers.
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
      if (makes && step > 0 && step - 1 < run_stages) {  // the last step's scales, arrived
        const int into = ((step - 1) % STAGES) * 2 * STAGE_SCALES;
UNROLL
        for (int i = 0; i < SCALE_COPIES; ++i) {
          const int entry = copy_thread + i * COPY_THREADS;
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
      // warpgroup waited for them in the last step). SPECIALIZED: the making
      // warps wait at EMPTY_BARRIER, where the multiplying ones arrive.
      if (WARPGROUP && !SHARED_WEIGHTS) {
        WARPGROUP_WAIT(0, sums, 0);
      }
      ASYNC_WAIT(AHEAD - 1);
      if (WARPGROUP) {
        SHARED_PROXY_FENCE();
      }
      if (SPECIALIZED) {
        ROLE_BARRIER(EMPTY_BARRIER, makes, THREADS);
      }
      if (!SPECIALIZED) {
        BARRIER();
      }
      if (makes && step < run_stages) {
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
        // back, and a count that COPY_THREADS divides needs no bound check.
        if (vectors) {
UNROLL
          for (int i = 0; i < ROW_COPIES; ++i) {
            if (ROW_COPIES * COPY_THREADS == BLOCK_ROWS * ROW_CHUNKS
                || copy_thread + i * COPY_THREADS < BLOCK_ROWS * ROW_CHUNKS) {
              ASYNC_COPY16(rows_into + row_targets[i], row_sources[i]);
            }
          }
UNROLL
          for (int i = 0; i < WORD_COPIES; ++i) {
            if (WORD_COPIES * COPY_THREADS == MATRICES * BLOCK_COLUMNS * COLUMN_CHUNKS
                || copy_thread + i * COPY_THREADS < MATRICES * BLOCK_COLUMNS * COLUMN_CHUNKS) {
              ASYNC_COPY16(words_into + word_targets[i], word_sources[i]);
            }
          }
        } else {
          for (int i = 0; i < ROW_COPIES; ++i) {
            if (copy_thread + i * COPY_THREADS < BLOCK_ROWS * ROW_CHUNKS) {
UNROLL
              for (int j = 0; j < 4; ++j) {
                rows_into[row_targets[i] + j] =
                    (unsigned)row_sources[i][2 * j]
                    | ((unsigned)row_sources[i][2 * j + 1] << 16);
              }
            }
          }
          for (int i = 0; i < WORD_COPIES; ++i) {
            if (copy_thread + i * COPY_THREADS < MATRICES * BLOCK_COLUMNS * COLUMN_CHUNKS) {
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
        if (makes && stage >= 0) {
          // include: tiles_weights
        }
        // Made for every thread, and for the multiply-adds' reads (the async
        // proxy's). SPECIALIZED: the multiplying warps wait at FULL_BARRIER,
        // where the making ones arrive.
        SHARED_PROXY_FENCE();
        if (SPECIALIZED) {
          ROLE_BARRIER(FULL_BARRIER, !makes, THREADS);
        }
        if (!SPECIALIZED) {
          BARRIER();
        }
      }
      if (ACROSS_ITEMS && product_stage >= 0 && product_stage % num_stages == 0) {
        // An item's first product: the block's 8-row tiles that hold rows of
        // its expert.
        const int slot = 3 * (product_stage / num_stages % ITEM_RING);
        product_live_row_tiles = (min(item_places[slot + 2] - item_places[slot + 1], BLOCK_ROWS)
                                  + 7) / 8;
      }
      if (multiplies && product_stage >= 0) {
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
    if (stores) {
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
