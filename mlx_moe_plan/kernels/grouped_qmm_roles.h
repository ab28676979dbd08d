// grouped_qmm_roles: grouped_qmm_tiles.h's GEMM in its made weights' block
// (SHARED_WEIGHTS) with PRODUCER_WARPGROUPS > 0 (SPECIALIZED, which
// grouped_qmm_tiles.h describes): a warpgroup more copies the stages and makes
// their weights, the block's warpgroups only multiply and store. The same
// inputs, outputs, params and template constants; a body of its own so that
// the default's text (a launch's source, whose size MLX's kernel call pays
// for at every call) carries one copy of the run, not three.
// include: tiles_setup
// SPECIALIZED's launch runs one group an SM (Launch.min_groups), a thread's
// registers then an SM's 65536 over its threads, 8 at a time; where those are
// too few for the multiplying warps' sums (MMA_REGISTERS, else 0), each role
// takes what launch.py gives it (WARP_REGISTERS: more, or fewer).
const int LAUNCH_REGISTERS = 65536 / THREADS / 8 * 8;
// The run (tiles_run.h), in the roles each thread takes: in the lock-step
// emulations one copy, where each thread multiplies and a making thread's
// sums are thrown away; where the roles run apart, each role its own copy of
// the text, whose registers the compiler then allocates for that role alone
// (a making warp holds no sums, a multiplying one no copies' sources).
if (!ROLES_APART) {
  const bool makes = (int)LOCAL_ID >= MMA_THREADS;
  const bool multiplies = true;
  const bool stores = (int)LOCAL_ID < MMA_THREADS;
  // include: tiles_run
}
// Apart, each role's warps meet the group's barriers (an item's first,
// BARRIER) at their own copy's place. CUDA's __syncthreads is the aligned
// bar.sync 0, which PTX defines for threads at one place; the hardware counts
// the warps that arrive, wherever, and the GPU tests pass, but the
// non-aligned barrier.sync is the form PTX defines for two places (to do).
if (ROLES_APART) {
  if ((int)LOCAL_ID >= MMA_THREADS) {
    if (MMA_REGISTERS) {
      WARP_REGISTERS(MAKING_REGISTERS, MAKING_REGISTERS > LAUNCH_REGISTERS);
    }
    const bool makes = true;
    const bool multiplies = false;
    const bool stores = false;
    // include: tiles_run
  } else {
    if (MMA_REGISTERS) {
      WARP_REGISTERS(MMA_REGISTERS, MMA_REGISTERS > LAUNCH_REGISTERS);
    }
    const bool makes = false;
    const bool multiplies = true;
    const bool stores = true;
    // include: tiles_run
  }
}
