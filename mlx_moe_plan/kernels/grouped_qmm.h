// grouped_qmm: the expert GEMM over a plan's sorted rows, with affine-quantized
// weights: out[row] = rows[row] @ dequantize(weight[e]).T (+ bias[e] with
// OUT_BIAS) for every row of expert e's span [expert_offsets[e],
// expert_offsets[e + 1]), zeros on the tail rows [expert_offsets[E],
// capacity). The row counts are read here, on the
// device, and no host ever learns how many rows there are (decoding builds its
// graph before the router has run; an expert-parallel rank computes its own
// rows only, without a sync).
// The work is (expert with rows, block of columns) items, dealt out to a fixed
// number of groups: every group first lists the experts that have rows, in
// expert order (the same list in every group), and takes items GROUP_ID,
// GROUP_ID + NUM_GROUPS, ... of that list's items, then of the tail's. A grid
// of an item a group would be mostly groups of empty experts when decoding,
// and a GPU starts groups at a limited rate (measured on the H200:
// benchmarks/HISTORY.md, "A grid of an item a group").
// The products are a warp's matrix multiply-add, MMA_16x8x16 (the dialect's
// name for PTX's mma.m16n8k16: 16 output columns by 8 rows by 16 input values,
// 16-bit pairs in, float sums; CUDA runs the instruction, the other preludes
// compute the same sums lane by lane). A warp computes TILES tiles of 16
// columns over 8 * ROW_TILES rows a pass, so an expert's weights are read once
// for all of its rows up to that count. What the multiply-add takes exactly:
// the fields q of a packed word, made 16-bit floats by the bits (the pair
// MAGIC + q minus MAGIC, both exact), against the rows' own 16-bit values,
// with float sums. A quantization group's scale and bias then apply to its
// sums, in float: sum_v (scale * q_v + bias) * x_v = scale * sum_v q_v * x_v
// + bias * sum_v x_v, the last a multiply-add with ones (shared by the
// warp's tiles). So the results are a float GEMM's of the exact dequantized
// weights, not the bits of any other implementation; the order of a
// multiply-add's sums is the hardware's, the same on every run.
// The input index of a fragment's slot is free, as long as the weights and
// the rows agree on it: lane (row r = lane / 4, slot k = lane % 4) of a warp
// holds the same input indices in A (its columns r and r + 8) and in B (its
// row r). A lane reads LANE_WORDS consecutive words of each of its columns a
// quantization group, the group's 4 * LANE_WORDS words across the four lanes
// of a fragment row (so every multiply-add's 16 inputs share one scale), and
// takes a word's fields as pairs (v, v + VALUES / 2): its low bits up, as
// MLX's affine quantization packs them, a shift and a mask apart, and the
// rows' values paired to match (LOW_HALVES, HIGH_HALVES).
// Two fusions (template constants), which the layer's gate and up projections
// use: TOKEN_ROWS reads row r from rows[row_tokens[r]], the tokens themselves,
// so no gathered copy of them is made; GATED computes two projections of the
// same rows, weight's (the gate) and up_weight's, in the same warp for the
// same columns, and stores silu(gate) * up from the float sums (SwiGLU), or
// with CLAMPED gpt-oss's clamped form (qmm_store.h). OUT_BIAS adds each
// projection's own bias of the column to its sums first.
// Inputs: rows InT [num_rows, in_dims], float16 or bfloat16; row_tokens int32
//   [capacity], the plan's (read with TOKEN_ROWS only); weight uint32
//   [E, out_dims, in_dims / VALUES]; scales, biases InT [E, out_dims,
//   in_dims / QUANT_GROUP]; up_weight, up_scales, up_biases likewise (read
//   when GATED only); bias, up_bias InT [E, out_dims], the projections'
//   biases (read with OUT_BIAS only; up_bias when GATED too); expert_offsets
//   int32 [E + 1]; params int32, the fields of
//   launch.py's GroupedQmmParams in order (read below; column_blocks: blocks of
//   COLUMN_WARPS * 16 * COLUMN_TILES columns that cover out_dims; num_rows:
//   capacity without TOKEN_ROWS).
// Outputs: out OutT [capacity, out_dims].
// The body makes pointers into rows and the matrices, so on Metal they must
// be `device` buffers: the host pads those of fewer than 8 elements, below
// which MLX passes `constant`.
// Template constants: InT, OutT, IN_KIND (1 float16, 2 bfloat16), BITS (4 or
//   8), VALUES (32 / BITS, values a word packs), QUANT_GROUP (values sharing
//   a scale and bias, 32, 64 or 128), LANE_WORDS (QUANT_GROUP / (4 *
//   VALUES)), THREADS (the group size, a multiple of 32), MAX_EXPERTS (a
//   multiple of THREADS, at least E), K_SPLITS (below; THREADS / 32 a
//   multiple of it), TILES (16-column tiles a warp; when
//   GATED, an even count, the first half the gate's and the second up's of the
//   same columns), ROW_TILES (8-row tiles a pass), STEPS (quantization groups
//   whose words a lane loads before it uses any), GATED, TOKEN_ROWS,
//   OUT_BIAS, CLAMPED, ALPHA_BITS, LIMIT_BITS (above, qmm_store.h),
//   WIDE_LOADS, LOADS_AHEAD, WORD_STAGES, WORD_STRIDE (below).
// include: qmm_params
// K_SPLITS: the group's warps are K_SPLITS sets of COLUMN_WARPS, each set the
// same columns, set k summing its share of a row's quantization groups,
// [k * split_groups, (k + 1) * split_groups) clamped to the row. A warp waits
// on memory once for each STEPS groups of its share, so where a launch has
// few items (a dense projection as one expert: a few dozen column blocks) a
// whole row is a long chain of such waits on few warps; shares make the
// chains shorter and the warps more. Set 0 adds the others' sums in set order
// (so the bits are the same on every run) and stores them.
const int COLUMN_WARPS = THREADS / 32 / K_SPLITS;
const int column_warp = warp % COLUMN_WARPS;
const int k_split = warp / COLUMN_WARPS;
const int split_groups = (row_groups + K_SPLITS - 1) / K_SPLITS;
const int split_group0 = k_split * split_groups;
// Sets 1 and on keep sum i of thread LOCAL_ID - 32 * COLUMN_WARPS at
// i * SPLIT_THREADS. The size is written in the template constants (OpenCL
// C's const int is no constant expression), one more than that (no array of
// 0 for one set).
const int SPLIT_THREADS = (K_SPLITS - 1) * COLUMN_WARPS * 32;
SHARED float split_sums[(THREADS - THREADS / K_SPLITS) * TILES * ROW_TILES * 4 + 1];
const bool vectors = IS_ALIGNED16(rows);
// WIDE_LOADS: a lane's words of a column and group in one load (LANE_WORDS
// of them, 8 or 16 bytes, aligned so where the matrices are: a column's row
// is 16 * LANE_WORDS bytes and a lane starts at a multiple of LANE_WORDS
// words), and STEPS groups' scales (and biases) of a column in one load
// where the steps cover the row evenly. A warp's load names 8 columns' rows,
// 8 cache lines an instruction, and the kernel's time follows its count of
// such instructions (benchmarks/HISTORY.md, "Prefetching into L2"): fewer, wider ones.
const bool WIDE_WORDS = WIDE_LOADS ? LANE_WORDS % 2 == 0 : false;
const bool WIDE_SCALES = WIDE_LOADS ? (STEPS == 2 ? true : STEPS == 4) : false;
const bool word_vectors = WIDE_WORDS ? IS_ALIGNED16(weight) && IS_ALIGNED16(up_weight) : false;
const bool scale_vectors = WIDE_SCALES && split_groups % STEPS == 0
                           && split_groups * K_SPLITS == row_groups
                           ? IS_ALIGNED16(scales) && IS_ALIGNED16(biases)
                             && IS_ALIGNED16(up_scales) && IS_ALIGNED16(up_biases)
                           : false;
// Tiles of distinct columns a warp: when GATED, tile t and t + COLUMN_TILES
// are the gate's and up's of the same 16 columns.
const int COLUMN_TILES = GATED ? TILES / 2 : TILES;
// 1.0 as a pair in the rows' format (the fields' pairs: qmm_fields.h).
const unsigned ONES = IN_KIND == 1 ? 0x3C003C00u : 0x3F803F80u;
const unsigned ones[4] = {ONES, ONES, ONES, ONES};  // A of the sums of x
SHARED int active_experts[MAX_EXPERTS];
SHARED int group_scan[THREADS];
SHARED unsigned mma_exchange[THREADS * 6];  // the emulated MMA_16x8x16's (OpenCL)
const int warp_exchange = warp * 32 * 6;  // where this warp's part of it starts
// WORD_STAGES (0, or 2 and more): a warp's words come through a ring of that
// many stages of its own in group memory, each stage a pass's STEPS groups of
// the warp's TILES * 16 columns (ring column 16 t + c: tile t's column c,
// WORD_STRIDE words apart, which launch.py pads off the banks of the next).
// The lanes' own loads take 8 bytes from each of 8 columns 1 KB apart an
// instruction, a pattern memory serves at a cap that more loads in flight do
// not raise (benchmarks/RESULTS.md, "Loads alone"); the ring's copies take
// each column's STEPS groups in one run of 16-byte chunks (asynchronous where
// the prelude has them, ASYNC_COPY16), WORD_STAGES - 1 passes ahead, and the
// multiply-adds read the fragment's words back from there: the same words in
// the same sums.
const int GROUP_WORDS = QUANT_GROUP / VALUES;  // a column's words of a group
const int STAGE_CHUNKS = STEPS * GROUP_WORDS / 4;  // 16-byte chunks of a column a stage
const int RING_COLUMNS = TILES * 16;
const int RING_STAGES = WORD_STAGES > 0 ? WORD_STAGES : 1;  // a modulus even where off
// One word more than the ring: no array of 0 words where it is off.
SHARED_WORDS(word_ring, THREADS / 32 * WORD_STAGES * TILES * 16 * WORD_STRIDE + 1);
const bool ring_vectors = IS_ALIGNED16(weight) && IS_ALIGNED16(up_weight);

// The experts with rows, in order: thread t looks at experts
// [t * MAX_EXPERTS / THREADS, (t + 1) * MAX_EXPERTS / THREADS), a scan of the
// counts places them. Offsets out of [0, capacity] would come from a broken
// plan; clamped here and below, no row outside out is ever touched.
int own_active = 0;
bool active[MAX_EXPERTS / THREADS];  // whether this thread's experts have rows
UNROLL
for (int k = 0; k < MAX_EXPERTS / THREADS; ++k) {
  const int expert = LOCAL_ID * (MAX_EXPERTS / THREADS) + k;
  active[k] = false;
  if (expert < num_experts) {
    const int first = min(max(expert_offsets[expert], 0), capacity);
    active[k] = min(max(expert_offsets[expert + 1], first), capacity) > first;
  }
  own_active += active[k] ? 1 : 0;
}
const int scan_value = own_active;
const int scan_threads = THREADS;
// include: group_scan
int slot = group_scan[LOCAL_ID] - own_active;
UNROLL
for (int k = 0; k < MAX_EXPERTS / THREADS; ++k) {
  if (active[k]) {
    active_experts[slot] = LOCAL_ID * (MAX_EXPERTS / THREADS) + k;
    slot += 1;
  }
}
const int num_active = group_scan[THREADS - 1];
BARRIER();

// Every branch and loop bound below is the same for the whole group (the
// emulated MMA_16x8x16 meets a barrier): lanes past a bound load the last
// column, row or group inside it and store nothing instead.
for (int item = GROUP_ID; item < (num_active + 1) * column_blocks; item += NUM_GROUPS) {
  const int expert = item / column_blocks < num_active ? active_experts[item / column_blocks]
                                                       : num_experts;
  const int column0 = ((item % column_blocks) * COLUMN_WARPS + column_warp) * 16 * COLUMN_TILES;
  const int first = min(max(expert_offsets[expert], 0), capacity);
  if (expert == num_experts) {  // the tail rows: zeros, each set its rows
    for (int c = 0; c < 16 * COLUMN_TILES; ++c) {
      if (column0 + c < out_dims) {
        for (int row = first + k_split * 32 + lane; row < capacity; row += 32 * K_SPLITS) {
          STORE_OUT(out, (i64)row * out_dims + column0 + c, 0.0f);
        }
      }
    }
    continue;
  }
  const int last = min(max(expert_offsets[expert + 1], first), capacity);
  // The expert's matrices, and the lane's columns in them: tile t's columns
  // fragment_row and + 8 (h = 0, 1), clamped into the matrix. A column past
  // out_dims reads the last one, whose sums are never stored, so the loads
  // need no condition. When GATED, tiles from COLUMN_TILES on read up's.
  GLOBAL const unsigned* column_words[TILES * 2];  // column i: tile i / 2, h = i % 2
  GLOBAL const InT* column_scales[TILES * 2];
  GLOBAL const InT* column_biases[TILES * 2];
UNROLL
  for (int i = 0; i < TILES * 2; ++i) {
    const int column_tile = (i / 2) % COLUMN_TILES;
    const bool up_tile = GATED ? i / 2 >= COLUMN_TILES : false;
    const i64 column_row = (i64)expert * out_dims
                           + min(column0 + 16 * column_tile + fragment_row + 8 * (i % 2), out_dims - 1);
    column_words[i] = (up_tile ? up_weight : weight) + column_row * row_words;
    column_scales[i] = (up_tile ? up_scales : scales) + column_row * row_groups;
    column_biases[i] = (up_tile ? up_biases : biases) + column_row * row_groups;
  }
  for (int row0 = first; row0 < last; row0 += 8 * ROW_TILES) {
    // The lane's rows of the pass (n * 8 + fragment_row), clamped likewise: a
    // row past the expert's reads its last row, which only the sums of the
    // absent row's own column of a multiply-add see, never stored. With
    // TOKEN_ROWS, the row's token, clamped into rows (a broken plan's too).
    GLOBAL const unsigned short* row_values[ROW_TILES];
UNROLL
    for (int n = 0; n < ROW_TILES; ++n) {
      const int row = min(row0 + 8 * n + fragment_row, last - 1);
      const int source = TOKEN_ROWS ? min(max(row_tokens[row], 0), num_rows - 1) : row;
      row_values[n] = (GLOBAL const unsigned short*)rows + (i64)source * in_dims;
    }
    // sums[(t * ROW_TILES + n) * 4 + e]: tile t's column fragment_row + 8 * (e / 2),
    // row n * 8 + 2 * fragment_slot + e % 2 of the pass (the accumulator layout).
    float sums[TILES * ROW_TILES * 4];
    for (int i = 0; i < TILES * ROW_TILES * 4; ++i) {
      sums[i] = 0.0f;
    }
    // The landing set: the words, row values and scale and bias bits that a
    // pass's loads fetch, groups load0 + s of the share (a group past the
    // share or the row reads the last one of the row, and is not used);
    // use_packed and the other use_ arrays are the copy that the
    // multiply-adds read. The scales and biases stay bits until their use,
    // so no conversion waits on memory among a pass's loads.
    // LOADS_AHEAD: without it a pass loads its own groups, then waits for
    // them; with it a pass loads the next pass's groups first, and they
    // arrive during its multiply-adds. Each warp of the decode body waits on
    // its first use of each pass's loads for much of its time, but loads
    // ahead cost a second set of registers, and pay only on some rows
    // (launch.grouped_qmm_loads). The values and sums are the same either
    // way, in the same order.
    // scale_bits, bias_bits: with scale_vectors, the pairs of groups (2m,
    // 2m + 1) of column i at m * TILES * 2 + i, loaded whole; else group s's
    // bits at s * TILES * 2 + i, one load each.
    unsigned packed[STEPS * TILES * 2 * LANE_WORDS];
    unsigned halves[STEPS * ROW_TILES * LANE_WORDS * (VALUES / 2)];
    unsigned scale_bits[STEPS * TILES * 2];
    unsigned bias_bits[STEPS * TILES * 2];
    if (LOADS_AHEAD) {  // the first pass copies them before any load: defined values
UNROLL
      for (int i = 0; i < STEPS * TILES * 2 * LANE_WORDS; ++i) {
        packed[i] = 0u;
      }
UNROLL
      for (int i = 0; i < STEPS * ROW_TILES * LANE_WORDS * (VALUES / 2); ++i) {
        halves[i] = 0u;
      }
UNROLL
      for (int i = 0; i < STEPS * TILES * 2; ++i) {
        scale_bits[i] = 0u;
        bias_bits[i] = 0u;
      }
    }
    // Passes whose loads run ahead of their multiply-adds: the ring's
    // WORD_STAGES - 1 (its words), else LOADS_AHEAD's one.
    const int AHEAD = WORD_STAGES > 1 ? WORD_STAGES - 1 : LOADS_AHEAD ? 1 : 0;
    for (int load0 = 0; load0 < split_groups + AHEAD * STEPS; load0 += STEPS) {
      const int group0 = load0 - AHEAD * STEPS;  // the groups this pass multiplies
      // The groups of this pass's loads into registers: with the ring, those
      // it multiplies, or with LOADS_AHEAD the next pass's.
      const int fetch0 = WORD_STAGES > 0 ? group0 + LOADS_AHEAD * STEPS : load0;
      const int read_stage = group0 >= 0 ? group0 / STEPS % RING_STAGES : 0;
      if (WORD_STAGES > 0) {
        WARP_BARRIER();  // every lane has read the stage the copies below refill
        if (load0 < split_groups) {
          SHARED_SPACE unsigned* stage = word_ring + (warp * WORD_STAGES + load0 / STEPS % RING_STAGES)
                                                     * RING_COLUMNS * WORD_STRIDE;
UNROLL
          for (int j = 0; j < (RING_COLUMNS * STAGE_CHUNKS + 31) / 32; ++j) {
            const int chunk = lane + 32 * j;
            if (chunk < RING_COLUMNS * STAGE_CHUNKS) {
              // Ring column chunk / STAGE_CHUNKS: tile column / 16 (up's from
              // COLUMN_TILES on when GATED). Words past the row (a last stage's
              // groups past it) read the row's last chunk, never used.
              const int column = chunk / STAGE_CHUNKS;
              const int word = min(load0 * GROUP_WORDS + chunk % STAGE_CHUNKS * 4, row_words - 4);
              const bool up_tile = GATED ? column / 16 >= COLUMN_TILES : false;
              const i64 column_row = (i64)expert * out_dims
                                     + min(column0 + 16 * (column / 16 % COLUMN_TILES) + column % 16,
                                           out_dims - 1);
              GLOBAL const unsigned* from = (up_tile ? up_weight : weight) + column_row * row_words + word;
              SHARED_SPACE unsigned* to = stage + column * WORD_STRIDE + chunk % STAGE_CHUNKS * 4;
              if (ring_vectors) {
                ASYNC_COPY16(to, from);
              } else {
                for (int w = 0; w < 4; ++w) {
                  to[w] = from[w];
                }
              }
            }
          }
        }
        ASYNC_COMMIT();  // a group of copies a pass, empty past the row: each wait counts passes
        ASYNC_WAIT(WORD_STAGES > 1 ? WORD_STAGES - 1 : 0);  // group0's stage has landed
        WARP_BARRIER();  // ... for every lane
      }
      unsigned use_packed[STEPS * TILES * 2 * LANE_WORDS];
      unsigned use_halves[STEPS * ROW_TILES * LANE_WORDS * (VALUES / 2)];
      unsigned use_scale_bits[STEPS * TILES * 2];
      unsigned use_bias_bits[STEPS * TILES * 2];
      // One copy text for both orders: before the loads with LOADS_AHEAD,
      // after them without.
UNROLL
      for (int copy = 0; copy < 2; ++copy) {
        if (copy == (LOADS_AHEAD ? 0 : 1)) {
UNROLL
          for (int i = 0; i < STEPS * TILES * 2 * LANE_WORDS; ++i) {
            if (WORD_STAGES == 0) {  // with the ring, packed is never loaded: nothing to copy
              use_packed[i] = packed[i];
            }
          }
UNROLL
          for (int i = 0; i < STEPS * ROW_TILES * LANE_WORDS * (VALUES / 2); ++i) {
            use_halves[i] = halves[i];
          }
UNROLL
          for (int i = 0; i < STEPS * TILES * 2; ++i) {
            use_scale_bits[i] = scale_bits[i];
            use_bias_bits[i] = bias_bits[i];
          }
        }
        if (copy == 0 && fetch0 >= 0 && fetch0 < split_groups) {  // every load of the steps
          if (scale_vectors) {  // the steps' groups, all inside the share
UNROLL
            for (int i = 0; i < TILES * 2; ++i) {
              if (STEPS == 2) {
                scale_bits[i] =
                    ((GLOBAL const unsigned*)(column_scales[i] + split_group0 + fetch0))[0];
                bias_bits[i] =
                    ((GLOBAL const unsigned*)(column_biases[i] + split_group0 + fetch0))[0];
              } else {
                const uint2 scale_pairs =
                    ((GLOBAL const uint2*)(column_scales[i] + split_group0 + fetch0))[0];
                const uint2 bias_pairs =
                    ((GLOBAL const uint2*)(column_biases[i] + split_group0 + fetch0))[0];
                scale_bits[i] = scale_pairs.x;
                scale_bits[(STEPS / 2 - 1) * TILES * 2 + i] = scale_pairs.y;
                bias_bits[i] = bias_pairs.x;
                bias_bits[(STEPS / 2 - 1) * TILES * 2 + i] = bias_pairs.y;
              }
            }
          }
UNROLL
          for (int s = 0; s < STEPS; ++s) {
            const int quant_group = STEPS == 1 && K_SPLITS == 1
                                    ? fetch0 : min(split_group0 + fetch0 + s, row_groups - 1);
            const int word0 = quant_group * GROUP_WORDS + fragment_slot * LANE_WORDS;
UNROLL
            for (int i = 0; i < TILES * 2; ++i) {
              const int at = s * TILES * 2 + i;
              if (!scale_vectors) {
                scale_bits[at] = ((GLOBAL const unsigned short*)column_scales[i])[quant_group];
                bias_bits[at] = ((GLOBAL const unsigned short*)column_biases[i])[quant_group];
              }
              if (WORD_STAGES == 0 && word_vectors) {  // the words: the ring has them where on
UNROLL
                for (int w = 0; w < LANE_WORDS; w += 2) {
                  const uint2 pair = ((GLOBAL const uint2*)(column_words[i] + word0 + w))[0];
                  packed[at * LANE_WORDS + w] = pair.x;
                  packed[at * LANE_WORDS + w + 1] = pair.y;
                }
              } else if (WORD_STAGES == 0) {
UNROLL
                for (int w = 0; w < LANE_WORDS; ++w) {
                  packed[at * LANE_WORDS + w] = column_words[i][word0 + w];
                }
              }
            }
UNROLL
            for (int n = 0; n < ROW_TILES; ++n) {
UNROLL
              for (int w = 0; w < LANE_WORDS; ++w) {
                const int value0 = (word0 + w) * VALUES;
                const int into = ((s * ROW_TILES + n) * LANE_WORDS + w) * (VALUES / 2);
                if (vectors && VALUES == 8) {
                  const uint4 raw = ((GLOBAL const uint4*)row_values[n])[value0 / 8];
                  halves[into] = raw.x;
                  halves[into + 1] = raw.y;
                  halves[into + 2] = raw.z;
                  halves[into + 3] = raw.w;
                } else {
UNROLL
                  for (int j = 0; j < VALUES / 2; ++j) {
                    halves[into + j] = (unsigned)row_values[n][value0 + 2 * j]
                                       | ((unsigned)row_values[n][value0 + 2 * j + 1] << 16);
                  }
                }
              }
            }
          }
        }
      }
UNROLL
      for (int s = 0; s < STEPS; ++s) {
        if (group0 >= 0 && group0 + s < split_groups) {
          float dots[TILES * ROW_TILES * 4];
          float value_sums[ROW_TILES * 4];
UNROLL
          for (int i = 0; i < TILES * ROW_TILES * 4; ++i) {
            dots[i] = 0.0f;
          }
UNROLL
          for (int i = 0; i < ROW_TILES * 4; ++i) {
            value_sums[i] = 0.0f;
          }
          // Group s's words of column i (tile i / 2, h = i % 2): the pass's
          // loads, or with the ring its stage's, read here, a group at a time,
          // so they take registers for one group only.
          unsigned group_words[TILES * 2 * LANE_WORDS];
UNROLL
          for (int i = 0; i < TILES * 2; ++i) {
            SHARED_SPACE unsigned* ring_words =
                word_ring + ((warp * WORD_STAGES + read_stage) * RING_COLUMNS
                             + 16 * (i / 2) + fragment_row + 8 * (i % 2)) * WORD_STRIDE
                + s * GROUP_WORDS + fragment_slot * LANE_WORDS;
UNROLL
            for (int w = 0; w < LANE_WORDS; w += LANE_WORDS % 2 == 0 ? 2 : 1) {
              const int at = i * LANE_WORDS + w;
              if (WORD_STAGES == 0) {
                group_words[at] = use_packed[s * TILES * 2 * LANE_WORDS + at];
                if (LANE_WORDS % 2 == 0) {
                  group_words[at + 1] = use_packed[s * TILES * 2 * LANE_WORDS + at + 1];
                }
              } else if (LANE_WORDS % 2 == 0) {  // 8-byte aligned: strides, offsets even
                const uint2 pair = ((SHARED_SPACE uint2*)(ring_words + w))[0];
                group_words[at] = pair.x;
                group_words[at + 1] = pair.y;
              } else {
                group_words[at] = ring_words[w];
              }
            }
          }
          // A word holds VALUES / 2 field pairs, 2 a multiply-add: pairs
          // (2m, 2m + 1) of word w are multiply-add m of the word.
UNROLL
          for (int w = 0; w < LANE_WORDS; ++w) {
UNROLL
            for (int m = 0; m < VALUES / 4; ++m) {
              // B: the row's values at the pairs' inputs, (v, v + VALUES / 2)
              // for v = 2m and 2m + 1, from the uint32 halves j = v / 2 and
              // j + VALUES / 4 (low half for even v).
              unsigned b[ROW_TILES * 2];
UNROLL
              for (int n = 0; n < ROW_TILES; ++n) {
                const int from = ((s * ROW_TILES + n) * LANE_WORDS + w) * (VALUES / 2) + m;
                const unsigned low = use_halves[from];
                const unsigned high = use_halves[from + VALUES / 4];
                b[2 * n] = LOW_HALVES(low, high);
                b[2 * n + 1] = HIGH_HALVES(low, high);
                MMA_16x8x16(&value_sums[4 * n], ones, &b[2 * n], mma_exchange + warp_exchange, lane);
              }
UNROLL
              for (int t = 0; t < TILES; ++t) {
                // A: fields v = 2m (a[0], a[1]) and 2m + 1 (a[2], a[3]) of
                // columns fragment_row (a[0], a[2]) and + 8 (a[1], a[3]).
                unsigned a[4];
UNROLL
                for (int i = 0; i < 4; ++i) {
                  const unsigned word = group_words[(t * 2 + i % 2) * LANE_WORDS + w];
                  // Fields v and v + VALUES / 2 at each half's low bits: a
                  // shift (grouped_qmm_tiles.h pairs neighbours instead, which
                  // costs a byte permute a pair and saves the rows' two a row
                  // tile: a win over its 8 row tiles, a loss over one).
                  const unsigned fields = word >> ((2 * m + i / 2) * BITS);
                  // include: qmm_fields
                  a[i] = field_pair;
                }
UNROLL
                for (int n = 0; n < ROW_TILES; ++n) {
                  MMA_16x8x16(&dots[(t * ROW_TILES + n) * 4], a, &b[2 * n],
                              mma_exchange + warp_exchange, lane);
                }
              }
            }
          }
          // The last share's steps past the row multiply (every warp of the
          // group meets the emulated MMA_16x8x16's barriers alike), unused.
          if (K_SPLITS == 1 || split_group0 + group0 + s < row_groups) {
            // Group s's scale and bias of column i (tile i / 2, h = i % 2).
            float scale[TILES * 2];
            float group_bias[TILES * 2];
UNROLL
            for (int i = 0; i < TILES * 2; ++i) {
              const unsigned pair_scale = use_scale_bits[(s / 2) * TILES * 2 + i];
              const unsigned pair_bias = use_bias_bits[(s / 2) * TILES * 2 + i];
              const unsigned scale_half = scale_vectors ? (pair_scale >> (16 * (s % 2))) & 0xFFFFu
                                                        : use_scale_bits[s * TILES * 2 + i];
              const unsigned bias_half = scale_vectors ? (pair_bias >> (16 * (s % 2))) & 0xFFFFu
                                                       : use_bias_bits[s * TILES * 2 + i];
              scale[i] = IN_KIND == 1 ? HALF_BITS_TO_FLOAT(scale_half)
                                      : BITS_TO_FLOAT(scale_half << 16);
              group_bias[i] = IN_KIND == 1 ? HALF_BITS_TO_FLOAT(bias_half)
                                           : BITS_TO_FLOAT(bias_half << 16);
            }
UNROLL
            for (int i = 0; i < TILES * ROW_TILES * 4; ++i) {  // tile i / (4 * ROW_TILES)
              const int at = (i / (4 * ROW_TILES)) * 2 + i % 4 / 2;
              sums[i] += scale[at] * dots[i];
              sums[i] += group_bias[at] * value_sums[i % (4 * ROW_TILES)];
            }
          }
        }
      }
    }
    if (K_SPLITS > 1) {  // set 0 adds the other sets' sums, in set order
      if (k_split > 0) {
        for (int i = 0; i < TILES * ROW_TILES * 4; ++i) {
          split_sums[i * SPLIT_THREADS + LOCAL_ID - 32 * COLUMN_WARPS] = sums[i];
        }
      }
      BARRIER();
      if (k_split == 0) {
        for (int k = 1; k < K_SPLITS; ++k) {
          for (int i = 0; i < TILES * ROW_TILES * 4; ++i) {
            sums[i] += split_sums[i * SPLIT_THREADS + ((k - 1) * COLUMN_WARPS + column_warp) * 32
                                  + lane];
          }
        }
      }
      BARRIER();  // read before the next pass writes
    }
    if (k_split == 0) {
      const int warp_row0 = row0;  // the warp's: its columns, this pass's rows
      const int warp_column0 = column0;
      // qmm_store.h's: the block tiles' input split (not K_SPLITS); here the whole row.
      const int input_split = 0;
      // include: qmm_store
    }
  }
}
