// Metal prelude: the dialect's names in the Metal Shading Language.
// MLX compiles this header after its Metal utils.h (metal_stdlib, half,
// bfloat16_t), then the kernel whose body is prologue_metal.h + a body.
// Products are rounded before the sums that use them, as in the reference.
// MLX's default "safe" math mode sets FP contract on (MSL 4 section 1.6.3);
// both spellings turn it off, the STDC one also where the METAL one is new.
#pragma METAL fp contract(off)
#pragma STDC FP_CONTRACT OFF
typedef long i64;
#define GLOBAL device
#define SHARED threadgroup
#define SHARED_SPACE threadgroup
// SHARED_WORDS(name, words): `words` unsigned in group memory (on CUDA the
// launch's dynamic shared memory).
#define SHARED_WORDS(name, words) threadgroup unsigned name[words]
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
// WARP_BARRIER: the SIMD group's 32 lanes (the warp) meet, threadgroup memory
// ordered across it.
#define WARP_BARRIER() simdgroup_barrier(mem_flags::mem_threadgroup)
#define SHARED_ATOMIC_UINT atomic_uint
#define ATOMIC_ADD(p, v) atomic_fetch_add_explicit((p), (v), memory_order_relaxed)
#define ATOMIC_LOAD(p) atomic_load_explicit((p), memory_order_relaxed)
#define ATOMIC_STORE(p, v) atomic_store_explicit((p), (v), memory_order_relaxed)
#define LOAD_IN(p, i) static_cast<float>((p)[i])
#define STORE_OUT(p, i, v) ((p)[i] = static_cast<OutT>(v))
// ROUND_OUT: v rounded as STORE_OUT stores it, back as a float.
#define ROUND_OUT(v) static_cast<float>(static_cast<OutT>(v))
#define BITS_TO_FLOAT(u) as_type<float>((unsigned)(u))
#define HALF_BITS_TO_FLOAT(u) static_cast<float>(as_type<half>((ushort)(u)))
#define MUL_RN(a, b) ((a) * (b))
#define ADD_RN(a, b) ((a) + (b))
#define VEC16(a, b, c, d) uint4((a), (b), (c), (d))
// MSL cannot test a pointer's alignment. Fresh arrays and row slices of
// 16-byte rows are 16-byte aligned; a view starting at an arbitrary element
// (x.reshape(-1)[1:].reshape(...)) is not, and is the one unsupported input
// of the Metal vector copy (MLX passes row-contiguous views uncopied).
#define IS_ALIGNED16(p) true
// WARP_UNIFORM(x): x, which every lane of a SIMD group holds (CUDA says so).
#define WARP_UNIFORM(x) (x)
// UNROLL: unroll the loop that follows (its arrays indexed by constants stay
// in registers).
#define UNROLL _Pragma("unroll")
// defines: MMA_16x8x16 PAIR_SUB PAIR_FMA PAIR_ROUND AND_OR LOW_HALVES HIGH_HALVES BYTE_PAIR
// defines: ASYNC_COPY16 ASYNC_COMMIT ASYNC_WAIT mma_16x8x16
// MMA_16x8x16 (PTX's mma.m16n8k16 in prelude_cuda.h), emulated: a lane reads
// the A and B registers it needs from the lanes that hold them (simd_shuffle,
// with every lane of the SIMD group taking part) and adds its own four sums.
// PAIR_SUB: a - b on two 16-bit pairs of the rows' format (KIND 1 float16, 2
// bfloat16), through floats (the body subtracts only where that is exact).
template <int KIND>
inline float pair_value(uint pair, uint high) {
  const uint bits = high ? pair >> 16 : pair & 0xFFFFu;
  return KIND == 1 ? float(as_type<half>(ushort(bits))) : as_type<float>(bits << 16);
}
template <int KIND>
inline uint pair_bits(float value) {
  return KIND == 1 ? uint(as_type<ushort>(half(value))) : as_type<uint>(value) >> 16;
}
template <int KIND>
inline uint pair_sub(uint a, uint b) {
  return pair_bits<KIND>(pair_value<KIND>(a, 0) - pair_value<KIND>(b, 0))
         | (pair_bits<KIND>(pair_value<KIND>(a, 1) - pair_value<KIND>(b, 1)) << 16);
}
template <int KIND>
inline void mma_16x8x16(thread float* d, thread const uint* a, thread const uint* b, uint lane) {
  for (uint slot = 0; slot < 4; ++slot) {
    // Inputs 2 * slot, + 1, + 8, + 9 of the lane's rows (lane / 4, + 8) and
    // of its columns (2 * (lane % 4), + 1).
    const ushort a_lane = ushort(4 * (lane / 4) + slot);
    const uint a_held[4] = {simd_shuffle(a[0], a_lane), simd_shuffle(a[1], a_lane),
                            simd_shuffle(a[2], a_lane), simd_shuffle(a[3], a_lane)};
    const ushort b_lane = ushort(8 * (lane % 4) + slot);
    const uint b_held[4] = {simd_shuffle(b[0], b_lane), simd_shuffle(b[1], b_lane),
                            simd_shuffle(b[0], ushort(b_lane + 4)),
                            simd_shuffle(b[1], ushort(b_lane + 4))};
    for (uint e = 0; e < 4; ++e) {
      for (uint k = 0; k < 4; ++k) {  // a register (e / 2) + 2 * (k / 2), half k % 2
        d[e] += pair_value<KIND>(a_held[e / 2 + 2 * (k / 2)], k % 2)
                * pair_value<KIND>(b_held[2 * (e % 2) + k / 2], k % 2);
      }
    }
  }
}
// PAIR_FMA: a * b + c on two 16-bit pairs, through floats, rounded to
// nearest even (exact products of 16-bit values; the float sum may round
// once before).
template <int KIND>
inline uint pair_round(float value) {
  const uint bits = as_type<uint>(value);
  return KIND == 1 ? uint(as_type<ushort>(half(value)))
                   : (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}
template <int KIND>
inline uint pair_fma(uint a, uint b, uint c) {
  return pair_round<KIND>(pair_value<KIND>(a, 0) * pair_value<KIND>(b, 0) + pair_value<KIND>(c, 0))
         | (pair_round<KIND>(pair_value<KIND>(a, 1) * pair_value<KIND>(b, 1)
                             + pair_value<KIND>(c, 1)) << 16);
}
#define MMA_16x8x16(d, a, b, exchange, lane) mma_16x8x16<IN_KIND>((d), (a), (b), (lane))
#define PAIR_SUB(a, b) pair_sub<IN_KIND>((a), (b))
#define PAIR_FMA(a, b, c) pair_fma<IN_KIND>((a), (b), (c))
// PAIR_ROUND(low, high): two floats as one 16-bit pair, each rounded to
// nearest even.
#define PAIR_ROUND(low, high) (pair_round<IN_KIND>(low) | (pair_round<IN_KIND>(high) << 16))
// AND_OR: (a & mask) | bits (one instruction on CUDA, prelude_cuda.h).
#define AND_OR(a, mask, bits) (((a) & (mask)) | (bits))
// LOW_HALVES, HIGH_HALVES: the pair of two words' low (high) 16-bit halves.
#define LOW_HALVES(a, b) (((a) & 0xFFFFu) | ((b) << 16))
#define HIGH_HALVES(a, b) (((a) >> 16) | ((b) & 0xFFFF0000u))
// BYTE_PAIR(a, b, k): byte k of a as the low 16-bit half's low byte, byte k
// of b as the high half's (the halves' high bytes undefined, as on CUDA).
#define BYTE_PAIR(a, b, k) ((((a) >> (8 * (k))) & 0xFFu) | (((b) >> (8 * (k))) << 16))
// ASYNC_COPY16: 16 bytes from device to threadgroup memory; here a plain
// copy, done when it returns, so ASYNC_COMMIT and ASYNC_WAIT have nothing to
// do (the barrier that follows them is still needed).
#define ASYNC_COPY16(shared, global) (*(threadgroup uint4*)(shared) = *(device const uint4*)(global))
#define ASYNC_COMMIT() ((void)0)
#define ASYNC_WAIT(n) ((void)0)
// defines: WARPGROUP_MMA WARPGROUP_MMA_SS WARPGROUP_FENCE WARPGROUP_COMMIT
// defines: WARPGROUP_WAIT SHARED_PROXY_FENCE SWIZZLE128 SHARED_ALIGN1024
// WARPGROUP_MMA (Hopper's wgmma in prelude_cuda.h, which says what it
// computes), emulated: each SIMD group's row_tiles MMA_16x8x16 over its own
// 16 rows of A, each n tile's B fragment read from the core matrices at b.
// Done when it returns, so the fences and waits have nothing to do.
template <int KIND>
inline void warpgroup_mma(thread float* d, thread const uint* a, threadgroup const uint* b,
                          int row_tiles, int lbo, int sbo, uint lane) {
  for (int j = 0; j < row_tiles; ++j) {
    const uint b_pairs[2] = {b[j * sbo + lane], b[j * sbo + lbo + lane]};
    mma_16x8x16<KIND>(d + 4 * j, a, b_pairs, lane);
  }
}
#define WARPGROUP_MMA(d, a, b, row_tiles, lbo, sbo, exchange, lane) warpgroup_mma<IN_KIND>((d), (a), (b), (row_tiles), (lbo), (sbo), (lane))
// WARPGROUP_MMA_SS, emulated as prelude_opencl.h does (which says how).
#define SWIZZLE128(x) ((x) ^ ((((x) >> 5) & 7) << 2))
#define SHARED_ALIGN1024(p) (p)
template <int KIND>
inline void warpgroup_mma_ss(thread float* d, threadgroup const uint* a, int a_at,
                             threadgroup const uint* b, int b_at, int row_tiles, uint lane,
                             int warp) {
  const int a_row = a_at + (16 * warp + int(lane) / 4) * 32 + int(lane) % 4;
  const uint a_pairs[4] = {a[SWIZZLE128(a_row)], a[SWIZZLE128(a_row + 256)],
                           a[SWIZZLE128(a_row + 4)], a[SWIZZLE128(a_row + 260)]};
  for (int j = 0; j < row_tiles; ++j) {
    const int b_row = b_at + (8 * j + int(lane) / 4) * 32 + int(lane) % 4;
    const uint b_pairs[2] = {b[SWIZZLE128(b_row)], b[SWIZZLE128(b_row + 4)]};
    mma_16x8x16<KIND>(d + 4 * j, a_pairs, b_pairs, lane);
  }
}
#define WARPGROUP_MMA_SS(d, a, a_at, b, b_at, row_tiles, exchange, lane, warp) warpgroup_mma_ss<IN_KIND>((d), (a), (a_at), (b), (b_at), (row_tiles), (lane), (warp))
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
// defines: WARP_XOR
// WARP_XOR(value, mask, exchange, lane): the float `value` of lane `lane ^
// mask` of the SIMD group (every lane takes part; `exchange` is OpenCL's).
#define WARP_XOR(value, mask, exchange, lane) simd_shuffle_xor((value), ushort(mask))
