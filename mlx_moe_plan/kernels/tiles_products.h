// tiles_products: a text grouped_qmm_tiles.h includes, not a body. A
// stage's multiply-adds: each quantization group of the stage, each word of
// the lane's, its weights made once (scale * q + bias, rounded to 16 bits)
// and multiplied with the first `product_row_tiles` 8-row tiles of the
// warp's rows. The body includes it twice, with all its row tiles and with
// half, each place declaring `product_row_tiles` a constant, so that either
// loop unrolls. It reads the stage's buffers (`stage_scales`, `stage_words`,
// `stage_rows` at `scales_at`, `words_at`, `rows_at`), `warp_column`, the
// lane's place (`lane`, `fragment_row`, `fragment_slot`), the emulated
// multiply-add's `mma_exchange` and `warp_exchange`, and the body's constants
// (COLUMN_TILES, STAGE_SCALES, GROUP_WORDS and the template's); it adds into
// `sums` and declares nothing outside its own loop, so two copies can sit
// side by side. With WARPGROUP, the warpgroup's multiply-adds instead (below);
// with SHARED_WEIGHTS, those of the weights the group made (`stage_weights`
// at `weights_at`, the warp's `warpgroup`), the stage's as one batch.
if (SHARED_WEIGHTS) {
  // Each 16 values, one multiply-add a matrix: A the warpgroup's 64 columns
  // of it, B the rows, each from their slab of the step's values. The batch
  // runs while the group makes the next stage's weights; the one before it
  // is waited for here (its weights' buffer and rows are then free for the
  // step after next), with WEIGHTS_AHEAD already at the end of the last step.
  WARPGROUP_FENCE();
UNROLL
  for (int step = 0; step < STAGE_VALUES / 16; ++step) {
    const int slab_at = step / 4, k_at = (step % 4) * 8;  // the slab, the step's words in it
UNROLL
    for (int t = 0; t < TILES; ++t) {  // matrix t (COLUMN_TILES 1): gate, then up
      WARPGROUP_MMA_SS(&sums[t * ROW_TILES * 4], stage_weights,
                       weights_at + slab_at * WEIGHT_SLAB_WORDS
                       + (t * BLOCK_COLUMNS + warpgroup * 64) * 32 + k_at,
                       stage_rows, rows_at + slab_at * ROW_SLAB_WORDS + k_at, product_row_tiles,
                       mma_exchange + warp_exchange, lane, warp % 4);
    }
  }
  WARPGROUP_COMMIT();
  WARPGROUP_WAIT(1, sums, 0);
} else {
  for (int group = 0; group < STAGE_GROUPS; ++group) {  // the stage's groups
    // The lane's columns among the stage's: tile t's fragment_row + 8 * h at
    // 2 * t + h (the up projection's tiles past the gate's, gated), and their
    // scale and bias pairs (as packed, below).
    int lane_columns[TILES * 2];
    unsigned scale_pairs[TILES * 2];
    unsigned bias_pairs[TILES * 2];
UNROLL
    for (int i = 0; i < TILES * 2; ++i) {
      lane_columns[i] = (GATED && i / 2 >= COLUMN_TILES ? BLOCK_COLUMNS : 0) + warp_column
                        + 16 * ((i / 2) % COLUMN_TILES) + fragment_row + 8 * (i % 2);
      scale_pairs[i] = stage_scales[scales_at + lane_columns[i] * STAGE_GROUPS + group];
      bias_pairs[i] = stage_scales[scales_at + STAGE_SCALES + lane_columns[i] * STAGE_GROUPS
                                   + group];
    }
    if (WARPGROUP) {
      // Each 16 values of the group, one warpgroup multiply-add a tile: its B
      // is the rows' chunks 2 * step and 2 * step + 1 of the group (k 0 to 7,
      // 8 to 15, in memory order), so the lane's A (k 2 * slot, + 1, + 8, + 9)
      // is fields 2 * slot and 2 * slot + 1 of each chunk: a byte of a word at
      // 4 bits, half a word at 8, the word's other fields the other lanes'.
      // The multiply-adds run while the lanes make the next step's A; a step
      // waits for the one before (its A registers are then free).
UNROLL
      for (int step = 0; step < QUANT_GROUP / 16; ++step) {
        unsigned a[TILES * 4];
UNROLL
        for (int t = 0; t < TILES; ++t) {
UNROLL
          for (int h = 0; h < 2; ++h) {  // column fragment_row + 8 * h: A's rows g, g + 8
            const int from = words_at + lane_columns[t * 2 + h] * WORD_STRIDE
                             + group * GROUP_WORDS;
            // The chunks' words: at 4 bits words 2 * step and 2 * step + 1, one
            // load; at 8, one of each chunk's two.
            unsigned chunk_words[2];
            if (VALUES == 8) {
              const uint2 pair = ((SHARED_SPACE uint2*)(stage_words + from))[step];
              chunk_words[0] = pair.x;
              chunk_words[1] = pair.y;
            } else {
UNROLL
              for (int c = 0; c < 2; ++c) {
                chunk_words[c] = stage_words[from + ((2 * step + c) * 8 + 2 * fragment_slot)
                                                    / VALUES];
              }
            }
UNROLL
            for (int c = 0; c < 2; ++c) {  // chunk 2 * step + c: k 0 to 7, 8 to 15
              const int field = (2 * step + c) * 8 + 2 * fragment_slot;
              const unsigned word = chunk_words[c];
              const unsigned fields = BYTE_PAIR(word, word >> BITS, (field % VALUES) * BITS / 8);
              // include: qmm_fields
              a[t * 4 + 2 * c + h] = PAIR_FMA(field_pair, scale_pairs[t * 2 + h],
                                              bias_pairs[t * 2 + h]);
            }
          }
        }
        WARPGROUP_FENCE();
UNROLL
        for (int t = 0; t < TILES; ++t) {
          WARPGROUP_MMA(&sums[t * ROW_TILES * 4], &a[t * 4],
                        stage_rows + rows_at + (group * QUANT_GROUP / 8 + 2 * step) * CORE_WORDS,
                        product_row_tiles, CORE_WORDS, ROW_CHUNKS * CORE_WORDS,
                        mma_exchange + warp_exchange, lane);
        }
        WARPGROUP_COMMIT();
        WARPGROUP_WAIT(1, sums, 0);
      }
    } else {
      // packed: the lane's LANE_WORDS words of the group in each of its
      // columns, in `lane_columns`' order.
      unsigned packed[TILES * 2 * LANE_WORDS];
UNROLL
      for (int i = 0; i < TILES * 2; ++i) {
        const int from = words_at + lane_columns[i] * WORD_STRIDE + group * GROUP_WORDS
                         + fragment_slot * LANE_WORDS;
UNROLL
        for (int w = 0; w < LANE_WORDS; w += (LANE_WORDS >= 4 ? 4 : LANE_WORDS)) {
          if (LANE_WORDS >= 4) {
            const uint4 quad = ((SHARED_SPACE uint4*)(stage_words + from + w))[0];
            packed[i * LANE_WORDS + w] = quad.x;
            packed[i * LANE_WORDS + w + 1] = quad.y;
            packed[i * LANE_WORDS + w + 2] = quad.z;
            packed[i * LANE_WORDS + w + 3] = quad.w;
          } else if (LANE_WORDS == 2) {
            const uint2 pair = ((SHARED_SPACE uint2*)(stage_words + from))[0];
            packed[i * LANE_WORDS] = pair.x;
            packed[i * LANE_WORDS + 1] = pair.y;
          } else {
            packed[i * LANE_WORDS] = stage_words[from];
          }
        }
      }
UNROLL
      for (int w = 0; w < LANE_WORDS; ++w) {
        // a: word w's weights, every multiply-add m's and tile t's A at (m *
        // TILES + t) * 4, made once for all the row tiles. Multiply-add m
        // takes the word's field pairs 2m (a[0], a[1]) and 2m + 1 (a[2],
        // a[3]), the rows' halves 2m and 2m + 1 as they are. The rows' values
        // are then loaded a row tile at a time: a warp's registers hold its
        // sums, these and one row tile's halves, not every row tile's.
        unsigned a[(VALUES / 4) * TILES * 4];
UNROLL
        for (int m = 0; m < VALUES / 4; ++m) {
UNROLL
          for (int t = 0; t < TILES; ++t) {
UNROLL
            for (int i = 0; i < 4; ++i) {
              const unsigned word = packed[(t * 2 + i % 2) * LANE_WORDS + w];
              // Fields 2p and 2p + 1 (p = 2m + i / 2) at each half's low
              // bits: for 4 bits, byte p and its high nibble; for 8, bytes
              // 2p and 2p + 1.
              const int pair_byte = (2 * m + i / 2) * BITS / 4;
              const unsigned fields = BYTE_PAIR(word, word >> BITS, pair_byte);
              // include: qmm_fields
              // The weight itself, scale * q + bias, rounded once to 16 bits.
              a[(m * TILES + t) * 4 + i] = PAIR_FMA(field_pair, scale_pairs[t * 2 + i % 2],
                                                    bias_pairs[t * 2 + i % 2]);
            }
          }
        }
UNROLL
        for (int n = 0; n < product_row_tiles; ++n) {
          // halves: the lane's row's values of word w, two to a uint32.
          unsigned halves[VALUES / 2];
          const int from = rows_at + (8 * n + fragment_row) * ROW_STRIDE
                           + (group * QUANT_GROUP + fragment_slot * (QUANT_GROUP / 4)
                              + w * VALUES) / 2;
          if (VALUES == 8) {
            const uint4 quad = ((SHARED_SPACE uint4*)(stage_rows + from))[0];
            halves[0] = quad.x;
            halves[1] = quad.y;
            halves[2] = quad.z;
            halves[3] = quad.w;
          } else {
            const uint2 pair = ((SHARED_SPACE uint2*)(stage_rows + from))[0];
            halves[0] = pair.x;
            halves[1] = pair.y;
          }
UNROLL
          for (int m = 0; m < VALUES / 4; ++m) {
UNROLL
            for (int t = 0; t < TILES; ++t) {
              MMA_16x8x16(&sums[(t * ROW_TILES + n) * 4], &a[(m * TILES + t) * 4],
                          &halves[2 * m], mma_exchange + warp_exchange, lane);
            }
          }
        }
      }
    }
  }
}
