// OpenCL C prelude: the dialect's names in OpenCL C 1.2. Used by the tests,
// which run every kernel body on PoCL. OpenCL C has no templates: the test
// harness defines each template constant, and IN_DTYPE / OUT_DTYPE (0 float32,
// 1 float16, 2 bfloat16 as ushort bits) pick the conversions below.
#pragma OPENCL FP_CONTRACT OFF
typedef long i64;
#define GLOBAL __global
#define SHARED __local
#define SHARED_SPACE __local
// SHARED_WORDS(name, words): `words` unsigned in group memory (on CUDA the
// launch's dynamic shared memory), 16-byte aligned: the bodies copy 16 bytes
// at a time into it (ASYNC_COPY16, a uint4 store here).
#define SHARED_WORDS(name, words) __local unsigned name[words] __attribute__((aligned(16)))
#define BARRIER() barrier(CLK_LOCAL_MEM_FENCE)
// WARP_BARRIER: the warp's lanes meet (the bodies' control flow is the same
// for the whole group, so the group's barrier serves the emulated warp).
#define WARP_BARRIER() barrier(CLK_LOCAL_MEM_FENCE)
#define SHARED_ATOMIC_UINT uint
#define ATOMIC_ADD(p, v) atomic_add((p), (v))
#define ATOMIC_LOAD(p) (*(volatile __local uint*)(p))
#define ATOMIC_STORE(p, v) (*(volatile __local uint*)(p) = (v))
#define BITS_TO_FLOAT(u) as_float((uint)(u))
#define HALF_BITS_TO_FLOAT(u) half_bits_to_float((ushort)(u))
#define MUL_RN(a, b) ((a) * (b))
#define ADD_RN(a, b) ((a) + (b))
#define VEC16(a, b, c, d) ((uint4)((a), (b), (c), (d)))
#define IS_ALIGNED16(p) ((((ulong)(p)) & 15ul) == 0)
// WARP_UNIFORM(x): x, which every lane of a warp holds (CUDA says so).
#define WARP_UNIFORM(x) (x)
// UNROLL: nothing here. Unrolled, grouped_qmm.h took PoCL five times as long
// to compile (8 s against 1.6 s an instantiation), and the tests time nothing.
#define UNROLL

inline float half_bits_to_float(ushort bits) { return vload_half(0, (__private const half*)&bits); }
inline float bf16_bits_to_float(ushort bits) { return as_float(((uint)bits) << 16); }
inline ushort float_to_bf16_bits(float v) {
  uint bits = as_uint(v);
  if (isnan(v)) return (ushort)((bits >> 16) | 0x40);
  return (ushort)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}
#if IN_DTYPE == 1
#define LOAD_IN(p, i) vload_half((i), (p))
#elif IN_DTYPE == 2
#define LOAD_IN(p, i) bf16_bits_to_float((p)[i])
#else
#define LOAD_IN(p, i) ((p)[i])
#endif
#if OUT_DTYPE == 1
#define STORE_OUT(p, i, v) vstore_half_rte((v), (i), (p))
inline float round_out(float v) {
  ushort bits;
  vstore_half_rte(v, 0, (__private half*)&bits);
  return half_bits_to_float(bits);
}
#elif OUT_DTYPE == 2
#define STORE_OUT(p, i, v) ((p)[i] = float_to_bf16_bits(v))
inline float round_out(float v) { return bf16_bits_to_float(float_to_bf16_bits(v)); }
#else
#define STORE_OUT(p, i, v) ((p)[i] = (v))
inline float round_out(float v) { return v; }
#endif
#define ROUND_OUT(v) round_out(v)

// defines: MMA_16x8x16 PAIR_SUB PAIR_FMA PAIR_ROUND AND_OR LOW_HALVES HIGH_HALVES BYTE_PAIR
// defines: ASYNC_COPY16 ASYNC_COMMIT ASYNC_WAIT mma_16x8x16
// MMA_16x8x16 (PTX's mma.m16n8k16 in prelude_cuda.h), emulated: the 32 lanes
// of a warp put their fragments in exchange (6 uints a lane), and each adds
// its own four sums. It meets barriers: every thread of the group calls it.
// PAIR_SUB: a - b on two 16-bit pairs of the rows' format, through floats
// (the body subtracts only where the differences are exact).
inline float pair_value(uint pair, int high) {
  const uint bits = high ? pair >> 16 : pair & 0xFFFFu;
#if IN_DTYPE == 1
  return half_bits_to_float((ushort)bits);
#else
  return bf16_bits_to_float((ushort)bits);
#endif
}
inline uint pair_bits(float value) {  // for values the 16-bit format holds exactly
#if IN_DTYPE == 1
  const uint bits = as_uint(value);
  if ((bits & 0x7FFFFFFFu) == 0) return bits >> 16;  // a signed zero
  return ((bits >> 16) & 0x8000u) | ((((bits >> 23) & 0xFFu) - 112u) << 10)
         | ((bits >> 13) & 0x3FFu);  // a normal float16: exponent bias 15, not 127
#else
  return float_to_bf16_bits(value);
#endif
}
inline uint pair_sub(uint a, uint b) {
  return pair_bits(pair_value(a, 0) - pair_value(b, 0))
         | (pair_bits(pair_value(a, 1) - pair_value(b, 1)) << 16);
}
inline void mma_16x8x16(float* d, const uint* a, const uint* b, __local uint* exchange,
                        int lane) {
  for (int i = 0; i < 4; ++i) exchange[lane * 6 + i] = a[i];
  exchange[lane * 6 + 4] = b[0];
  exchange[lane * 6 + 5] = b[1];
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int e = 0; e < 4; ++e) {
    const int row = lane / 4 + 8 * (e / 2);
    const int column = 2 * (lane % 4) + e % 2;
    for (int k = 0; k < 16; ++k) {
      // A[row][k]: lane 4 * (row % 8) + (k % 8) / 2, register row / 8 + 2 * (k / 8);
      // B[k][column]: lane 4 * column + (k % 8) / 2, register k / 8; half k % 2.
      const uint a_pair = exchange[(4 * (row % 8) + (k % 8) / 2) * 6 + row / 8 + 2 * (k / 8)];
      const uint b_pair = exchange[(4 * column + (k % 8) / 2) * 6 + 4 + k / 8];
      d[e] += pair_value(a_pair, k % 2) * pair_value(b_pair, k % 2);
    }
  }
  barrier(CLK_LOCAL_MEM_FENCE);
}
// PAIR_FMA: a * b + c on two 16-bit pairs, through floats, rounded to
// nearest even (exact products of 16-bit values; the float sum may round
// once before).
inline uint pair_round(float value) {
#if IN_DTYPE == 1
  ushort rounded;  // half storage: OpenCL C 1.2 has no half variables
  vstore_half_rte(value, 0, (__private half*)&rounded);
  return rounded;
#else
  return float_to_bf16_bits(value);
#endif
}
inline uint pair_fma(uint a, uint b, uint c) {
  return pair_round(pair_value(a, 0) * pair_value(b, 0) + pair_value(c, 0))
         | (pair_round(pair_value(a, 1) * pair_value(b, 1) + pair_value(c, 1)) << 16);
}
#define MMA_16x8x16(d, a, b, exchange, lane) mma_16x8x16((d), (a), (b), (exchange), (lane))
#define PAIR_SUB(a, b) pair_sub((a), (b))
#define PAIR_FMA(a, b, c) pair_fma((a), (b), (c))
// PAIR_ROUND(low, high): two floats as one 16-bit pair, each rounded to
// nearest even.
#define PAIR_ROUND(low, high) (pair_round(low) | (pair_round(high) << 16))
// AND_OR: (a & mask) | bits (one instruction on CUDA, prelude_cuda.h).
#define AND_OR(a, mask, bits) (((a) & (mask)) | (bits))
// LOW_HALVES, HIGH_HALVES: the pair of two words' low (high) 16-bit halves.
#define LOW_HALVES(a, b) (((a) & 0xFFFFu) | ((b) << 16))
#define HIGH_HALVES(a, b) (((a) >> 16) | ((b) & 0xFFFF0000u))
// BYTE_PAIR(a, b, k): byte k of a as the low 16-bit half's low byte, byte k
// of b as the high half's (the halves' high bytes undefined, as on CUDA).
#define BYTE_PAIR(a, b, k) ((((a) >> (8 * (k))) & 0xFFu) | (((b) >> (8 * (k))) << 16))
// ASYNC_COPY16: 16 bytes from global to local memory; a plain copy here (as
// on Metal), so ASYNC_COMMIT and ASYNC_WAIT have nothing to do.
#define ASYNC_COPY16(shared, global) (*(__local uint4*)(shared) = *(__global const uint4*)(global))
#define ASYNC_COMMIT() ((void)0)
#define ASYNC_WAIT(n) ((void)0)
// defines: WARPGROUP_MMA WARPGROUP_MMA_SS WARPGROUP_FENCE WARPGROUP_COMMIT
// defines: WARPGROUP_WAIT SHARED_PROXY_FENCE SWIZZLE128 SHARED_ALIGN1024
// WARPGROUP_MMA (Hopper's wgmma in prelude_cuda.h, which says what it
// computes), emulated: each warp's row_tiles MMA_16x8x16 over its own 16
// rows of A, each n tile's B fragment read from the core matrices at b. Done
// when it returns, so the fences and waits have nothing to do.
inline void warpgroup_mma(float* d, const uint* a, __local const uint* b, int row_tiles,
                          int lbo, int sbo, __local uint* exchange, int lane) {
  for (int j = 0; j < row_tiles; ++j) {
    // B[k][n] of n = 8 j + lane / 4 and k = 2 (lane % 4), + 1 (then + 8, + 9: lbo on).
    const uint b_pairs[2] = {b[j * sbo + lane], b[j * sbo + lbo + lane]};
    mma_16x8x16(d + 4 * j, a, b_pairs, exchange, lane);
  }
}
#define WARPGROUP_MMA(d, a, b, row_tiles, lbo, sbo, exchange, lane) warpgroup_mma((d), (a), (b), (row_tiles), (lbo), (sbo), (exchange), (lane))
// WARPGROUP_MMA_SS (prelude_cuda.h says what it computes), emulated: the
// warp's A fragment and each n tile's B fragment read where the 128-byte
// swizzle puts them (SWIZZLE128, as prelude_cuda.h defines it), then
// MMA_16x8x16. Lane 4 g + s: A's rows 16 warp + g and + 8, B's row 8 j + g,
// word s of each 16-byte chunk (k 2 s, 2 s + 1; the next chunk k + 8).
#define SWIZZLE128(x) ((x) ^ ((((x) >> 5) & 7) << 2))
#define SHARED_ALIGN1024(p) (p)
inline void warpgroup_mma_ss(float* d, __local const uint* a, int a_at, __local const uint* b,
                             int b_at, int row_tiles, __local uint* exchange, int lane,
                             int warp) {
  const int a_row = a_at + (16 * warp + lane / 4) * 32 + lane % 4;
  const uint a_pairs[4] = {a[SWIZZLE128(a_row)], a[SWIZZLE128(a_row + 256)],
                           a[SWIZZLE128(a_row + 4)], a[SWIZZLE128(a_row + 260)]};
  for (int j = 0; j < row_tiles; ++j) {
    const int b_row = b_at + (8 * j + lane / 4) * 32 + lane % 4;
    const uint b_pairs[2] = {b[SWIZZLE128(b_row)], b[SWIZZLE128(b_row + 4)]};
    mma_16x8x16(d + 4 * j, a_pairs, b_pairs, exchange, lane);
  }
}
#define WARPGROUP_MMA_SS(d, a, a_at, b, b_at, row_tiles, exchange, lane, warp) warpgroup_mma_ss((d), (a), (a_at), (b), (b_at), (row_tiles), (exchange), (lane), (warp))
#define WARPGROUP_FENCE() ((void)0)
#define WARPGROUP_COMMIT() ((void)0)
#define WARPGROUP_WAIT(n, d, count) ((void)0)
#define SHARED_PROXY_FENCE() ((void)0)
// defines: ROLE_BARRIER ROLES_APART WARP_REGISTERS
// ROLE_BARRIER (prelude_cuda.h says what it does), here the group's barrier:
// every thread takes every role's steps (ROLES_APART 0), as the emulated
// multiply-adds, which meet the group's barriers, need.
#define ROLES_APART 0
#define ROLE_BARRIER(id, waits, count) BARRIER()
#define WARP_REGISTERS(n, more) ((void)0)
// defines: WARP_XOR warp_xor
// WARP_XOR(value, mask, exchange, lane): the float `value` of lane `lane ^
// mask` of the emulated warp, through its `exchange` words in group memory
// (32 a warp). It meets barriers: every thread of the group calls it.
inline float warp_xor(float value, int mask, __local uint* exchange, int lane) {
  exchange[lane] = as_uint(value);
  barrier(CLK_LOCAL_MEM_FENCE);
  const float other = as_float(exchange[lane ^ mask]);
  barrier(CLK_LOCAL_MEM_FENCE);
  return other;
}
#define WARP_XOR(value, mask, exchange, lane) warp_xor((value), (mask), (exchange), (lane))
