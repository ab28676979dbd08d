// tiles_weights: a text grouped_qmm_tiles.h includes, not a body. With
// SHARED_WEIGHTS, a stage's weights made 16-bit by the group's making threads
// (COPY_THREADS: all of them, or SPECIALIZED's making warpgroup) into group
// memory, where the warpgroups' multiply-adds (tiles_products.h) read them.
// It reads the stage's packed words and scale pairs (`stage_words` at
// `made_words_at`, `stage_scales` at `made_scales_at`) and writes the made
// weights (`stage_weights` at `made_at`); the body includes it in one of two
// places (WEIGHTS_AHEAD says which), each in a block of its own.
// The stage's weights, scale * q + bias rounded once to 16 bits, as
// tiles_products.h makes them. Item i: 32 values (4 chunks) of one
// column; 8 lanes in a row take 8 columns of a column block, so their
// 16-byte stores of a chunk, swizzled, meet no bank conflict, and
// their 16-byte loads of the words, WORD_STRIDE apart (launch.py pads
// it), none either. A stage's buffer was read by the multiply-adds of
// stage - 2, waited for before this step's barrier.
const int RUNS = STAGE_VALUES / 32;  // a column's items a stage
const int ITEMS = MATRICES * BLOCK_COLUMNS * RUNS;
UNROLL
for (int i0 = 0; i0 < ITEMS; i0 += COPY_THREADS) {
  const int item = i0 + copy_thread;
  if (ITEMS % COPY_THREADS == 0 || item < ITEMS) {
    const int column = (item / (8 * RUNS)) * 8 + item % 8;  // among the matrices'
    const int run = item / 8 % RUNS;
    const int group = run * 32 / QUANT_GROUP;
    const unsigned scale_pair = stage_scales[made_scales_at + column * STAGE_GROUPS + group];
    const unsigned bias_pair = stage_scales[made_scales_at + STAGE_SCALES
                                            + column * STAGE_GROUPS + group];
    // Where the run's chunk c lands: its first chunk's place XOR 4 c. The
    // swizzle XORs a chunk's index (word bits 2 to 4) with its row's (bits 5
    // to 7), and the run's 4 chunks differ in bits 2 and 3 alone; so one
    // place an item, not four: nvcc kept the four of each item across the
    // stage loop, and spilled them in the fused 192-row block.
    const int run_at = (run / 2) * WEIGHT_SLAB_WORDS + SWIZZLE128(column * 32 + (run % 2) * 16);
    // The run's words: 4 at 4 bits, 8 at 8.
    unsigned run_words[32 / VALUES];
UNROLL
    for (int w = 0; w < 32 / VALUES; w += 4) {
      const uint4 quad = ((SHARED_SPACE uint4*)(stage_words + made_words_at
                                                 + column * WORD_STRIDE
                                                 + run * (32 / VALUES) + w))[0];
      run_words[w] = quad.x;
      run_words[w + 1] = quad.y;
      run_words[w + 2] = quad.z;
      run_words[w + 3] = quad.w;
    }
UNROLL
    for (int c = 0; c < 4; ++c) {  // the run's chunk c: values 8 c to 8 c + 7
      unsigned made[4];
UNROLL
      for (int p = 0; p < 4; ++p) {  // values 8 c + 2 p, + 1: a pair of a word
        const int field = 8 * c + 2 * p;
        const unsigned word = run_words[field / VALUES];
        const unsigned fields = BYTE_PAIR(word, word >> BITS, (field % VALUES) * BITS / 8);
        // include: qmm_fields
        made[p] = PAIR_FMA(field_pair, scale_pair, bias_pair);
      }
      ((SHARED_SPACE uint4*)(stage_weights + made_at + (run_at ^ (4 * c))))[0] =
          VEC16(made[0], made[1], made[2], made[3]);
    }
  }
}
