// plan, step 1 of 3: per-block expert histogram.
// Group g counts the BLOCK entries [g * BLOCK, (g + 1) * BLOCK) with shared
// atomics and writes its whole row of block_counts (zeros included), and its
// invalid count: nothing downstream ever needs clearing.
// Inputs: ids int32 [N]; params int32 {N, E}.
// Outputs: block_counts int32 [num_blocks * E]; block_invalid int32 [num_blocks].
// Template constants: BLOCK (= group size), MAX_EXPERTS.
SHARED SHARED_ATOMIC_UINT expert_count[MAX_EXPERTS];
SHARED SHARED_ATOMIC_UINT invalid_count[1];
const int num_entries = params[0];
const int num_experts = params[1];

for (int e = LOCAL_ID; e < num_experts; e += GROUP_SIZE) {
  ATOMIC_STORE(&expert_count[e], 0u);
}
if (LOCAL_ID == 0) {
  ATOMIC_STORE(&invalid_count[0], 0u);
}
BARRIER();

const i64 entry = (i64)GROUP_ID * BLOCK + LOCAL_ID;
if (entry < num_entries) {
  const int expert = ids[entry];
  if (expert >= num_experts) {
    ATOMIC_ADD(&invalid_count[0], 1u);
  } else if (expert >= 0) {
    ATOMIC_ADD(&expert_count[expert], 1u);
  }
}
BARRIER();

for (int e = LOCAL_ID; e < num_experts; e += GROUP_SIZE) {
  block_counts[(i64)GROUP_ID * num_experts + e] = (int)ATOMIC_LOAD(&expert_count[e]);
}
if (LOCAL_ID == 0) {
  block_invalid[GROUP_ID] = (int)ATOMIC_LOAD(&invalid_count[0]);
}
