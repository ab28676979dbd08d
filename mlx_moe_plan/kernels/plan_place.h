// plan, step 3 of 3: each entry's row, stable within its expert, and every
// other row of the plan's row arrays.
//
// Rank of an entry inside its block, without a serial loop over the block:
// the block's BLOCK entries form BLOCK / 32 sub-blocks of 32. Each entry adds
// 1 to the counter of (its expert, its sub-block); its rank is then the sum
// of its expert's counters of the earlier sub-blocks plus the entries of its
// own expert before it in its own sub-block (at most 31 comparisons).
// Counters are 8 bits, four sub-blocks to a 32-bit word. A sub-block holds 32
// entries, so a counter reaches at most 32 and never carries into its
// neighbour, whatever the input: K = 1 or 2, or one expert repeated within a
// token. (The seed packed 4-bit counters, eight to a word, which overflows
// once an expert occurs 16 times in 32 entries: safe only for K >= 3 with
// distinct experts per token.) A word's four counters sum to at most 128, so
// a multiply by 0x01010101 adds them in its top byte without overflow.
// Counters for 1024 experts take 16 KiB with BLOCK = 512, within the 32 KiB a
// Metal threadgroup has; BLOCK = 1024 would need 32 KiB for them alone.
//
// MLX kernels write fresh outputs, so the padding and tail rows are written
// here rather than in scan (where the seed wrote them): still no clearing
// pass, and every element of every output is written exactly once.
//
// Inputs: ids int32 [N]; weights float32 [N] (or [1], unread, without
//   HAS_WEIGHTS); block_bases int32 [num_blocks * E]; expert_counts int32
//   [E]; expert_offsets int32 [E + 1]; totals int32 {num_rows, num_tiles,
//   num_invalid}; params int32 {N, E, tile_m, top_k, capacity, max_tiles}.
// Outputs: row_tokens, row_experts, row_entries int32 [capacity];
//   row_weights float32 [capacity] (or [1], unwritten); positions int32 [N];
//   tile_experts int32 [max_tiles].
// Template constants: BLOCK (= group size, a multiple of 128), MAX_EXPERTS,
//   HAS_WEIGHTS.
SHARED SHARED_ATOMIC_UINT subblock_counts[MAX_EXPERTS * (BLOCK / 128)];
SHARED int entry_experts[BLOCK];
const int num_entries = params[0];
const int num_experts = params[1];
const int tile_m = params[2];
const int top_k = params[3];
const int capacity = params[4];
const int max_tiles = params[5];
const int words_per_expert = BLOCK / 128;

for (int w = LOCAL_ID; w < num_experts * words_per_expert; w += GROUP_SIZE) {
  ATOMIC_STORE(&subblock_counts[w], 0u);
}
const i64 entry = (i64)GROUP_ID * BLOCK + LOCAL_ID;
int expert = -1;
if (entry < num_entries) {
  expert = ids[entry];
  if (expert >= num_experts) {
    expert = -1; // invalid: skipped, like a negative id
  }
}
entry_experts[LOCAL_ID] = expert;
BARRIER();

const unsigned subblock = LOCAL_ID / 32;
const unsigned word = subblock / 4;
const unsigned shift = 8 * (subblock % 4);
if (expert >= 0) {
  ATOMIC_ADD(&subblock_counts[expert * words_per_expert + word], 1u << shift);
}
BARRIER();

if (expert >= 0) {
  unsigned before = 0;
  for (unsigned w = 0; w < word; ++w) {
    before += (ATOMIC_LOAD(&subblock_counts[expert * words_per_expert + w]) * 0x01010101u) >> 24;
  }
  const unsigned partial = ATOMIC_LOAD(&subblock_counts[expert * words_per_expert + word]) &
      ((1u << shift) - 1u);
  before += (partial * 0x01010101u) >> 24;
  for (unsigned j = subblock * 32; j < LOCAL_ID; ++j) {
    before += entry_experts[j] == expert ? 1u : 0u;
  }
  const int row = block_bases[(i64)GROUP_ID * num_experts + expert] + (int)before;
  positions[entry] = row;
  row_tokens[row] = (int)(entry / top_k);
  row_entries[row] = (int)entry;
  row_experts[row] = expert;
  if (HAS_WEIGHTS) {
    row_weights[row] = weights[entry];
  }
  if (row % tile_m == 0) { // a tile's first row is always an entry, never padding
    tile_experts[row / tile_m] = expert;
  }
} else if (entry < num_entries) {
  positions[entry] = -1;
}

// Rows no entry takes: each expert's padding, then the tail past num_rows.
const int thread_rank = GROUP_ID * GROUP_SIZE + LOCAL_ID;
const int num_threads = NUM_GROUPS * GROUP_SIZE;
for (int e = thread_rank; e < num_experts; e += num_threads) {
  for (int row = expert_offsets[e] + expert_counts[e]; row < expert_offsets[e + 1]; ++row) {
    row_tokens[row] = -1;
    row_entries[row] = -1;
    row_experts[row] = e;
    if (HAS_WEIGHTS) {
      row_weights[row] = 0.0f;
    }
  }
}
for (int row = totals[0] + thread_rank; row < capacity; row += num_threads) {
  row_tokens[row] = -1;
  row_entries[row] = -1;
  row_experts[row] = num_experts - 1;
  if (HAS_WEIGHTS) {
    row_weights[row] = 0.0f;
  }
}
for (int tile = totals[1] + thread_rank; tile < max_tiles; tile += num_threads) {
  tile_experts[tile] = -1;
}
