// plan, step 2 of 3: one group, a thread per expert.
// Thread e sums its column of block_counts (the expert's count), then the
// group scans the padded spans ceil(count / tile_m) * tile_m into the expert
// offsets, and thread e writes, for every block, the first row that block's
// entries of expert e take (block_bases): place then needs one load per entry.
// Inputs: block_counts int32 [num_blocks * E]; block_invalid int32
//   [num_blocks]; params int32 {num_blocks, E, tile_m}.
// Outputs: expert_counts int32 [E]; expert_offsets int32 [E + 1];
//   block_bases int32 [num_blocks * E]; totals int32 {num_rows, num_tiles,
//   num_invalid}.
// Template constants: MAX_EXPERTS (= group size, a power of two).
SHARED int span_scan[2][MAX_EXPERTS];
SHARED SHARED_ATOMIC_UINT invalid_total[1];
const int num_blocks = params[0];
const int num_experts = params[1];
const int tile_m = params[2];
const int expert = LOCAL_ID;

if (LOCAL_ID == 0) {
  ATOMIC_STORE(&invalid_total[0], 0u);
}
// The column sums run 8 blocks at a time: 8 independent loads in flight per
// thread rather than one dependent load after another.
int count = 0;
if (expert < num_experts) {
  int g = 0;
  for (; g + 8 <= num_blocks; g += 8) {
    int block_count[8];
    for (int u = 0; u < 8; ++u) {
      block_count[u] = block_counts[(i64)(g + u) * num_experts + expert];
    }
    for (int u = 0; u < 8; ++u) {
      count += block_count[u];
    }
  }
  for (; g < num_blocks; ++g) {
    count += block_counts[(i64)g * num_experts + expert];
  }
}
const int span = (count + tile_m - 1) / tile_m * tile_m;

// Inclusive Hillis-Steele scan of the spans, double-buffered.
int buffer = 0;
span_scan[0][LOCAL_ID] = span;
BARRIER();
for (unsigned stride = 1; stride < MAX_EXPERTS; stride *= 2) {
  int sum = span_scan[buffer][LOCAL_ID];
  if (LOCAL_ID >= stride) {
    sum += span_scan[buffer][LOCAL_ID - stride];
  }
  span_scan[1 - buffer][LOCAL_ID] = sum;
  buffer = 1 - buffer;
  BARRIER();
}
const int offset = span_scan[buffer][LOCAL_ID] - span;

// Entries >= E, summed over the blocks by every thread.
unsigned invalid = 0;
for (int g = LOCAL_ID; g < num_blocks; g += GROUP_SIZE) {
  invalid += (unsigned)block_invalid[g];
}
if (invalid != 0) { // most threads hold none: no contended atomics for them
  ATOMIC_ADD(&invalid_total[0], invalid);
}

if (expert < num_experts) {
  expert_counts[expert] = count;
  expert_offsets[expert] = offset;
  int base = offset;
  int g = 0;
  for (; g + 8 <= num_blocks; g += 8) {
    int block_count[8];
    for (int u = 0; u < 8; ++u) {
      block_count[u] = block_counts[(i64)(g + u) * num_experts + expert];
    }
    for (int u = 0; u < 8; ++u) {
      block_bases[(i64)(g + u) * num_experts + expert] = base;
      base += block_count[u];
    }
  }
  for (; g < num_blocks; ++g) {
    const i64 at = (i64)g * num_experts + expert;
    block_bases[at] = base;
    base += block_counts[at];
  }
  if (expert == num_experts - 1) {
    const int num_rows = offset + span;
    expert_offsets[num_experts] = num_rows;
    totals[0] = num_rows;
    totals[1] = num_rows / tile_m;
  }
}
BARRIER();
if (LOCAL_ID == 0) {
  totals[2] = (int)ATOMIC_LOAD(&invalid_total[0]);
}
