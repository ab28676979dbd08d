"""How fast a GPU's memory serves a warp's loads in the grouped GEMM's patterns: loads only.

    python -m benchmarks.load_patterns                       # 1200, 2400 and 4800 warps
    python -m benchmarks.load_patterns --warps 1272 --repeats 3

The decode body (kernels/grouped_qmm.h) reads each of a warp's 32 weight
columns in the layout of the warp's multiply-add: lane (r, k) takes 8 bytes
of columns r, r + 8, r + 16 and r + 24 from each quantization group, so an
instruction names 32 bytes of 8 columns 1 KB apart, and the next group's
bytes come a pass later. This benchmark times that pattern with nothing but
the loads, beside the same bytes taken in longer runs of each column, and
copied into a ring of stages in shared memory (`cp.async`, the CUDA
prelude's ASYNC_COPY16) in runs of a column and read from there in the
multiply-add's layout. Each warp reads its own 32 KB (32 columns of a 4-bit
row of 2048 values, Qwen3-30B-A3B's gate); the warps' regions, and six such
sets in turn, pass the L2, so the bytes come from memory as a layer's
weights do. A row of the table: the pattern, its bytes in flight a warp (the
loads issued before the first is used), shared memory a group of 4 warps,
microseconds a call (graphs of 24 calls, `benchmarks.timing`) and GB/s.
CUDA only: the kernels are CUDA text, run through `mx.fast.cuda_kernel`.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import mlx.core as mx

from mlx_moe_plan import _backend, kernels

from .timing import time_calls

ROW_BYTES = 1024  # a column's row: 2048 values of 4 bits
REGION_BYTES = 32 * ROW_BYTES  # a warp's 32 columns
SETS = 6  # weight sets taken in turn, each past the L2
THREADS = 128

# The decode body's loads: lane (r, k), 8 bytes of group g of columns r + 8c,
# STEPS groups loaded before any is used.
FRAGMENTS = r"""
  const int lane = threadIdx.x % 32;
  const long long warp_index = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const unsigned char* region =
      (const unsigned char*)weights + (warp_index % regions[0]) * (32ll * ROW);
  unsigned folded = 0;
  for (int group0 = 0; group0 < ROW / 32; group0 += STEPS) {
    uint2 words[STEPS][4];
#pragma unroll
    for (int s = 0; s < STEPS; ++s)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        words[s][c] = *(const uint2*)(region + (lane / 4 + 8 * c) * ROW + (group0 + s) * 32
                                      + lane % 4 * 8);
#pragma unroll
    for (int s = 0; s < STEPS; ++s)
#pragma unroll
      for (int c = 0; c < 4; ++c) folded += words[s][c].x ^ words[s][c].y;
  }
  if (folded == 0x9E3779B9u) out[0] = folded;  // keeps the loads; never true on random data
"""

# Runs of RUN_LANES lanes x 16 bytes of one column an instruction (32 / RUN_LANES
# columns), IN_FLIGHT instructions before any is used.
RUNS = r"""
  const int lane = threadIdx.x % 32;
  const long long warp_index = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const unsigned char* region =
      (const unsigned char*)weights + (warp_index % regions[0]) * (32ll * ROW);
  const int COLUMNS = 32 / RUN_LANES;  // columns an instruction
  unsigned folded = 0;
  for (int i0 = 0; i0 < ROW / 16; i0 += IN_FLIGHT) {  // 32 lanes x 16 B an instruction
    uint4 chunk[IN_FLIGHT];
#pragma unroll
    for (int j = 0; j < IN_FLIGHT; ++j) {
      const int pass = (i0 + j) / RUN_LANES, column_set = (i0 + j) % RUN_LANES;
      const int column = column_set * COLUMNS + lane / RUN_LANES;
      chunk[j] = *(const uint4*)(region + column * ROW + pass * RUN_LANES * 16
                                 + lane % RUN_LANES * 16);
    }
#pragma unroll
    for (int j = 0; j < IN_FLIGHT; ++j) folded += chunk[j].x ^ chunk[j].y ^ chunk[j].z ^ chunk[j].w;
  }
  if (folded == 0x9E3779B9u) out[0] = folded;
"""

# A warp's ring of STAGES stages in shared memory, each RUN bytes of its 32
# columns, copied in runs of 16-byte chunks (RUN / 16 lanes a column), read back
# in the multiply-add's layout (8 bytes of group g of columns r + 8c).
STAGED = r"""
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long long warp_index = (long long)blockIdx.x * (blockDim.x / 32) + warp;
  const unsigned char* region =
      (const unsigned char*)weights + (warp_index % regions[0]) * (32ll * ROW);
  const int STRIDE = RUN + 32;  // a column's bytes a stage, padded off the banks of the next
  const int STAGE_BYTES = 32 * STRIDE, CHUNKS = RUN / 16, RUN_COUNT = ROW / RUN;
  extern __shared__ __align__(16) unsigned char ring_memory[];
  unsigned char* ring = ring_memory + warp * STAGES * STAGE_BYTES;
  unsigned folded = 0;
  for (int run = 0; run < RUN_COUNT + STAGES - 1; ++run) {
    if (run >= STAGES - 1) {  // run - STAGES + 1 has landed: read it
      ASYNC_WAIT(STAGES - 2);
      __syncwarp();
      const unsigned char* stage = ring + (run - STAGES + 1) % STAGES * STAGE_BYTES;
#pragma unroll
      for (int g = 0; g < RUN / 32; ++g)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const uint2 words = *(const uint2*)(stage + (lane / 4 + 8 * c) * STRIDE + g * 32
                                              + lane % 4 * 8);
          folded += words.x ^ words.y;
        }
      __syncwarp();  // read before the copies below overwrite the stage
    }
    if (run < RUN_COUNT) {
      unsigned char* stage = ring + run % STAGES * STAGE_BYTES;
#pragma unroll
      for (int j = 0; j < CHUNKS; ++j) {
        const int chunk = lane + 32 * j;
        ASYNC_COPY16(stage + chunk / CHUNKS * STRIDE + chunk % CHUNKS * 16,
                     region + chunk / CHUNKS * ROW + run * RUN + chunk % CHUNKS * 16);
      }
    }
    ASYNC_COMMIT();  // one group a run, empty past the row: the waits count them alike
  }
  if (folded == 0x9E3779B9u) out[0] = folded;
"""

# (name, source, template constants, bytes in flight a warp, shared bytes a group)
PATTERNS = (
    [(f"fragments, {steps} group{'s' if steps > 1 else ''} a pass", FRAGMENTS,
      {"STEPS": steps}, 32 * 4 * 8 * steps, 0) for steps in (1, 2, 4)]
    + [(f"runs of {lanes * 16} B, {flight} loads ahead", RUNS,
        {"RUN_LANES": lanes, "IN_FLIGHT": flight}, 32 * 16 * flight, 0)
       for lanes in (4, 8, 32) for flight in (4, 8)]
    + [(f"staged, runs of {run} B, {stages} stages", STAGED, {"RUN": run, "STAGES": stages},
        32 * run * (stages - 1), THREADS // 32 * stages * 32 * (run + 32))
       for run in (128, 256) for stages in (2, 3, 4)]
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warps", default="1200,2400,4800",
                        help="warps a call, comma-separated; Qwen3-30B-A3B's gate takes 1272 "
                             "at 8 tokens (default: 1200,2400,4800)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="turns over the patterns, each row their median (default: 2)")
    args = parser.parse_args(argv)
    if _backend.gpu_backend() != "cuda":
        print("load_patterns: CUDA only", file=sys.stderr)
        return 1
    warps_list = [int(w) for w in args.warps.split(",")]
    regions = max(warps_list)
    weight_sets = [mx.random.randint(0, 2**31 - 1, (regions * REGION_BYTES // 4,),
                                     dtype=mx.uint32) for _ in range(SETS)]
    region_count = mx.array([regions], dtype=mx.int32)
    mx.eval(weight_sets, region_count)
    made = {}

    def kernel(name, source, shared):
        if (name, shared) not in made:
            made[name, shared] = mx.fast.cuda_kernel(
                name="load_pattern", input_names=["weights", "regions"], output_names=["out"],
                source=source, header=kernels.prelude("cuda"), shared_memory=shared)
        return made[name, shared]

    samples = {}
    for _ in range(args.repeats):  # the patterns in turns, so drift falls on all alike
        for warps in warps_list:
            for name, source, constants, _, shared in PATTERNS:
                run = kernel(name, source, shared)

                def call(i, run=run, constants=constants, warps=warps):
                    return run(inputs=[weight_sets[i % SETS], region_count],
                               template=[("ROW", ROW_BYTES), *constants.items()],
                               grid=(warps * 32, 1, 1), threadgroup=(THREADS, 1, 1),
                               output_shapes=[(1,)], output_dtypes=[mx.uint32], init_value=0)[0]

                timing = time_calls(call, 24, repeats=5)
                samples.setdefault((warps, name), []).append(timing.median_s)
    print(f"{'warps':>6s}  {'pattern':34s} {'in flight':>9s} {'shared':>7s} {'us':>7s} "
          f"{'GB/s':>6s}")
    for warps in warps_list:
        for name, _, _, flight, shared in PATTERNS:
            seconds = statistics.median(samples[warps, name])
            print(f"{warps:6d}  {name:34s} {flight // 1024:6d} KB {shared // 1024:4d} KB "
                  f"{seconds * 1e6:7.1f} {warps * REGION_BYTES / seconds / 1e9:6.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
