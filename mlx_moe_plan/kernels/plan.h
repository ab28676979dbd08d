// plan: the stable counting sort of the routing entries by expert, in one
// kernel of three phases: hist (count), scan (offsets) and place (rows).
//
// Why one kernel: MLX spends host time on every custom kernel it dispatches,
// and more on every output: more than this kernel's GPU time
// (benchmarks/dispatch.py measures it; the figures are in
// benchmarks/RESULTS.md, "A graph node's cost"). So there is one launch and one int32
// output (plan_data, every integer field at the offsets of launch.plan_layout),
// plus row_weights when the plan carries weights.
//
// Group g places the CHUNK = blocks_per_group * BLOCK entries from
// g * CHUNK, one BLOCK at a time. An entry's row is its expert's offset plus
// the entries of its expert before it, so each group needs, per expert, the
// total count (for the offsets) and the count before its chunk: it counts
// every entry itself (phase 1). So each group reads all N ids: N * groups
// reads in all. launch.py caps the groups (PLAN_MAX_GROUPS) and gives each
// several blocks once N outgrows the cap, so that grows linearly in N: without
// a cap, one block a group, the reads grew as N * N / BLOCK (measured with and
// without the cap: benchmarks/HISTORY.md, "NVIDIA H200, MLX's CUDA backend").
// Past the sizes measured, once the ids outgrow L2 (about 12 M ids on the
// H200) every group reads them from memory, and each group's blocks are placed
// one after another.
// The reads are the price of one launch (above), and cheap at prefill sizes:
// at T = 2048, K = 10, 40 groups each read 20,480 ids.
//
// Phase 1, hist: shared-atomic histograms of the entries before the chunk and
//   of the rest; invalid entries (>= E) counted by group 0.
// Phase 2, scan: each thread owns MAX_EXPERTS / BLOCK consecutive experts; a
//   scan of the padded spans ceil(count / tile_m) * tile_m gives the offsets;
//   expert_base[e] = offset + entries of e before the chunk.
// Phase 3, place, per block of the chunk: each entry's rank in its block from
//   sub-block counters (below), its row expert_base[e] + rank; then each
//   expert's base moves past its entries of the block. Every thread runs every
//   iteration (blocks_per_group is uniform), so every barrier is met by all.
//
// Rank inside a block without a serial loop over it: the block's BLOCK
// entries form BLOCK / 32 sub-blocks of 32. Each entry adds 1 to the counter
// of (its expert, its sub-block); its rank is the sum of its expert's counters
// of the earlier sub-blocks plus the entries of its expert before it in its own
// sub-block (at most 31 comparisons). Counters are 8 bits, four sub-blocks to
// a 32-bit word. A sub-block holds 32 entries, so a counter reaches at most 32
// and never carries into its neighbour, whatever the input: K = 1 or 2, or one
// expert repeated within a token. (4-bit counters, eight to a word, would
// overflow once an expert occurs 16 times in 32 entries: safe only for K >= 3
// with distinct experts per token.) A word's four counters sum
// to at most 128, so a multiply by 0x01010101 adds them in its top byte
// without overflow. The counters of 1024 experts take 16 KiB with BLOCK = 512;
// all shared arrays together take 24 KiB, within a Metal threadgroup's 32 KiB.
//
// Padding rows (each expert's span past its count) and tail rows (past
// num_rows) are written here too: MLX kernels write fresh outputs, there is no
// clearing pass, and every element of every output is written exactly once.
//
// Inputs: ids int32 or uint32 [N] (uint32 as routers give them: MLX's
//   argpartition's, read as they are, no conversion launched before the plan;
//   each id is widened to 64 bits before it is compared, so an unsigned id of
//   2**31 or more stays invalid, where as an int it would turn negative and be
//   skipped); weights [N], any float dtype (or [1], unread, without
//   HAS_WEIGHTS); params int32, the fields of launch.py's PlanParams in order
//   (read below).
// Outputs: plan_data int32, the fields of launch.py's PLAN_DATA_FIELDS in
//   order (the pointers below): row_tokens, row_experts, row_entries [capacity],
//   tile_experts [max_tiles], positions [N], expert_counts [E],
//   expert_offsets [E + 1], totals {num_rows, num_tiles, num_invalid};
//   row_weights float32 [capacity] (or [1], unwritten).
// Template constants: BLOCK (= group size, a multiple of 128), MAX_EXPERTS (a
//   multiple of BLOCK), HAS_WEIGHTS.
SHARED SHARED_ATOMIC_UINT counters[MAX_EXPERTS * (BLOCK / 128)];
SHARED int expert_base[MAX_EXPERTS];
SHARED int group_scan[BLOCK];
SHARED int entry_experts[BLOCK];
SHARED SHARED_ATOMIC_UINT invalid_total[1];

const i64 num_entries = params[0];
const int num_experts = params[1];
const int tile_m = params[2];
const int top_k = params[3];
const i64 capacity = params[4];
const i64 max_tiles = params[5];
const int blocks_per_group = params[6];
const int words_per_expert = BLOCK / 128;
const int experts_per_thread = MAX_EXPERTS / BLOCK;

GLOBAL int* row_tokens = plan_data;
GLOBAL int* row_experts = plan_data + capacity;
GLOBAL int* row_entries = plan_data + 2 * capacity;
GLOBAL int* tile_experts = plan_data + 3 * capacity;
GLOBAL int* positions = tile_experts + max_tiles;
GLOBAL int* expert_counts = positions + num_entries;
GLOBAL int* expert_offsets = expert_counts + num_experts;
GLOBAL int* totals = expert_offsets + num_experts + 1;

// ---- phase 1, hist: counters[e] counts entries of e before the chunk,
// counters[MAX_EXPERTS + e] those from the chunk's start on.
for (int w = LOCAL_ID; w < 2 * MAX_EXPERTS; w += GROUP_SIZE) {
  ATOMIC_STORE(&counters[w], 0u);
}
if (LOCAL_ID == 0) {
  ATOMIC_STORE(&invalid_total[0], 0u);
}
BARRIER();
const i64 chunk_start = (i64)GROUP_ID * blocks_per_group * BLOCK;
unsigned invalid = 0;
// 8 independent loads in flight per thread, not one dependent load at a time.
for (i64 first = LOCAL_ID; first < num_entries; first += 8 * GROUP_SIZE) {
  int ids_read[8];
  for (int u = 0; u < 8; ++u) {
    const i64 at = first + (i64)u * GROUP_SIZE;
    const i64 id = at < num_entries ? (i64)ids[at] : -1;  // 64-bit: see Inputs
    ids_read[u] = id >= num_experts ? num_experts : (int)id;
  }
  for (int u = 0; u < 8; ++u) {
    const int expert = ids_read[u];
    if (expert >= num_experts) {
      invalid += 1u;
    } else if (expert >= 0) {
      const i64 at = first + (i64)u * GROUP_SIZE;
      ATOMIC_ADD(&counters[(at < chunk_start ? 0 : MAX_EXPERTS) + expert], 1u);
    }
  }
}
if (GROUP_ID == 0 && invalid != 0) { // most threads hold none: few contended atomics
  ATOMIC_ADD(&invalid_total[0], invalid);
}
BARRIER();

// ---- phase 2, scan: thread t owns experts [t * experts_per_thread, ...).
const int first_expert = LOCAL_ID * experts_per_thread;
int count[MAX_EXPERTS / BLOCK];
int before[MAX_EXPERTS / BLOCK];
int span_sum = 0;
for (int j = 0; j < experts_per_thread; ++j) {
  const int e = first_expert + j;
  count[j] = 0;
  before[j] = 0;
  if (e < num_experts) {
    before[j] = (int)ATOMIC_LOAD(&counters[e]);
    count[j] = before[j] + (int)ATOMIC_LOAD(&counters[MAX_EXPERTS + e]);
  }
  span_sum += (count[j] + tile_m - 1) / tile_m * tile_m;
}
// The threads' span sums scanned, over the threads that own experts.
const int owners = (num_experts + experts_per_thread - 1) / experts_per_thread;
const int scan_value = span_sum;
const int scan_threads = owners;
// include: group_scan
const int num_rows = group_scan[owners - 1];
const int num_tiles = num_rows / tile_m;
int offset = group_scan[LOCAL_ID] - span_sum;
for (int j = 0; j < experts_per_thread; ++j) {
  const int e = first_expert + j;
  const int span = (count[j] + tile_m - 1) / tile_m * tile_m;
  if (e < num_experts) {
    expert_base[e] = offset + before[j];
    if (GROUP_ID == 0) {
      expert_counts[e] = count[j];
      expert_offsets[e] = offset;
    }
    // Padding rows of e, by one group (the experts are dealt round the groups).
    if (e % NUM_GROUPS == GROUP_ID) {
      for (int row = offset + count[j]; row < offset + span; ++row) {
        row_tokens[row] = -1;
        row_entries[row] = -1;
        row_experts[row] = e;
        if (HAS_WEIGHTS) {
          row_weights[row] = 0.0f;
        }
      }
    }
  }
  offset += span;
}
if (GROUP_ID == 0 && LOCAL_ID == 0) {
  expert_offsets[num_experts] = num_rows;
  totals[0] = num_rows;
  totals[1] = num_tiles;
  totals[2] = (int)ATOMIC_LOAD(&invalid_total[0]);
}
// Tail rows and tiles, past num_rows and num_tiles, dealt round every thread.
const i64 thread_rank = (i64)GROUP_ID * GROUP_SIZE + LOCAL_ID;
const i64 num_threads = (i64)NUM_GROUPS * GROUP_SIZE;
for (i64 row = num_rows + thread_rank; row < capacity; row += num_threads) {
  row_tokens[row] = -1;
  row_entries[row] = -1;
  row_experts[row] = num_experts - 1;
  if (HAS_WEIGHTS) {
    row_weights[row] = 0.0f;
  }
}
for (i64 tile = num_tiles + thread_rank; tile < max_tiles; tile += num_threads) {
  tile_experts[tile] = -1;
}

// ---- phase 3, place: the chunk's blocks, in order.
const unsigned subblock = LOCAL_ID / 32;
const unsigned word = subblock / 4;
const unsigned shift = 8 * (subblock % 4);
for (int block = 0; block < blocks_per_group; ++block) {
  // The first clear follows phase 2's last reads of the counters (before its
  // scan's first barrier); the others follow the previous block's last barrier.
  for (int w = LOCAL_ID; w < num_experts * words_per_expert; w += GROUP_SIZE) {
    ATOMIC_STORE(&counters[w], 0u);
  }
  const i64 entry = chunk_start + (i64)block * BLOCK + LOCAL_ID;
  {
    int expert = -1; // invalid ids (>= E) are skipped, like negative ones
    if (entry < num_entries) {
      const i64 id = ids[entry];  // 64-bit: see Inputs
      expert = id >= num_experts ? -1 : (int)id;
    }
    entry_experts[LOCAL_ID] = expert;
  }
  BARRIER();
  // The thread's expert is read back from entry_experts after each barrier,
  // not kept in a variable across it: with `expert` loaded from ids and kept
  // across this loop's barriers, PoCL 3.0 (pocl-binary-distribution 3.0,
  // which runs these texts in CI) lost its value, and every thread had the
  // last thread's (rows unwritten, then a crash). `entry`, computed from
  // LOCAL_ID alone, keeps its value.
  if (entry_experts[LOCAL_ID] >= 0) {
    ATOMIC_ADD(&counters[entry_experts[LOCAL_ID] * words_per_expert + word], 1u << shift);
  }
  BARRIER();
  const int expert = entry_experts[LOCAL_ID];
  if (expert >= 0) {
    unsigned rank = 0;
    for (unsigned w = 0; w < word; ++w) {
      rank += (ATOMIC_LOAD(&counters[expert * words_per_expert + w]) * 0x01010101u) >> 24;
    }
    const unsigned partial = ATOMIC_LOAD(&counters[expert * words_per_expert + word]) &
        ((1u << shift) - 1u);
    rank += (partial * 0x01010101u) >> 24;
    for (unsigned j = subblock * 32; j < LOCAL_ID; ++j) {
      rank += entry_experts[j] == expert ? 1u : 0u;
    }
    const int row = expert_base[expert] + (int)rank;
    positions[entry] = row;
    row_tokens[row] = (int)(entry / top_k);
    row_entries[row] = (int)entry;
    row_experts[row] = expert;
    if (HAS_WEIGHTS) {
      row_weights[row] = LOAD_IN(weights, entry);
    }
    if (row % tile_m == 0) { // a tile's first row is always an entry, never padding
      tile_experts[row / tile_m] = expert;
    }
  } else if (entry < num_entries) {
    positions[entry] = -1;
  }
  // Each expert's base moves past its entries of this block: the sum of its
  // sub-block counters, each word's four bytes summed as above. (After the
  // last block too, two barriers and a few reads: every barrier of every body
  // stays out of if-blocks, a rule tests/test_metal_source.py checks.)
  BARRIER(); // the ranks above have read expert_base and the counters
  for (int j = 0; j < experts_per_thread; ++j) {
    const int e = first_expert + j;
    if (e < num_experts) {
      unsigned in_block = 0;
      for (int w = 0; w < words_per_expert; ++w) {
        in_block += (ATOMIC_LOAD(&counters[e * words_per_expert + w]) * 0x01010101u) >> 24;
      }
      expert_base[e] += (int)in_block;
    }
  }
  BARRIER(); // before the next block clears the counters
}
