// CUDA prelude: the dialect's names in CUDA C++ (NVRTC, through MLX's
// cuda_kernel, which includes cuda_fp16.h, cuda_bf16.h and cooperative_groups).
// __fmul_rn / __fadd_rn are never contracted into a fused multiply-add.
typedef long long i64;
#define GLOBAL
#define SHARED_SPACE
#define SHARED __shared__
// SHARED_WORDS(name, words): `words` unsigned in group memory, taken from the
// launch's dynamic shared memory (launch.Launch.shared_bytes), which may pass
// the 48 KB a group may declare statically. One a body: such arrays alias.
#define SHARED_WORDS(name, words) extern __shared__ __align__(16) unsigned name[]
#define BARRIER() __syncthreads()
// WARP_BARRIER: the warp's lanes meet, and what each wrote to group memory
// before it is the others' after it.
#define WARP_BARRIER() __syncwarp()
#define SHARED_ATOMIC_UINT unsigned
#define ATOMIC_ADD(p, v) atomicAdd((p), (v))
#define ATOMIC_LOAD(p) (*(volatile unsigned*)(p))
#define ATOMIC_STORE(p, v) (*(volatile unsigned*)(p) = (v))
#define LOAD_IN(p, i) static_cast<float>((p)[i])
#define STORE_OUT(p, i, v) ((p)[i] = static_cast<OutT>(v))
// ROUND_OUT: v rounded as STORE_OUT stores it, back as a float.
#define ROUND_OUT(v) static_cast<float>(static_cast<OutT>(v))
#define BITS_TO_FLOAT(u) __uint_as_float((unsigned)(u))
#define HALF_BITS_TO_FLOAT(u) __half2float(__ushort_as_half((unsigned short)(u)))
#define MUL_RN(a, b) __fmul_rn((a), (b))
#define ADD_RN(a, b) __fadd_rn((a), (b))
// VEC16(a, b, c, d): four words as one 16-byte vector (uint4).
#define VEC16(a, b, c, d) make_uint4((a), (b), (c), (d))
#define IS_ALIGNED16(p) ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0)
// WARP_UNIFORM(x): x, which every lane of the warp holds, broadcast from lane
// 0 so that the compiler knows it: it then computes what follows from x in its
// uniform registers, where wgmma takes its descriptors, not in each lane's.
#define WARP_UNIFORM(x) __shfl_sync(0xFFFFFFFFu, (x), 0)
// UNROLL: unroll the loop that follows (its arrays indexed by constants stay
// in registers).
#define UNROLL _Pragma("unroll")
// defines: MMA_16x8x16 PAIR_SUB PAIR_FMA PAIR_ROUND AND_OR LOW_HALVES HIGH_HALVES BYTE_PAIR
// defines: ASYNC_COPY16 ASYNC_COMMIT ASYNC_WAIT mma_16x8x16
// MMA_16x8x16: a warp's D += A B, PTX's mma.sync.m16n8k16 (A 16 x 16 row
// major, B 16 x 8 column major, float D), with 16-bit pairs of the rows'
// format (KIND 1 float16, 2 bfloat16). PAIR_SUB: a - b on two such pairs.
// Both need sm_80 or later (bfloat16 pairs: fma.rn.bf16x2, a - b = a * 1 + -b).
template <int KIND>
__device__ __forceinline__ void mma_16x8x16(float* d, const unsigned* a, const unsigned* b) {
  if (KIND == 2) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}
template <int KIND>
__device__ __forceinline__ unsigned pair_sub(unsigned a, unsigned b) {
  unsigned d;
  if (KIND == 2) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(0x3F803F80u), "r"(b ^ 0x80008000u));
  } else {
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  }
  return d;
}
// PAIR_FMA: a * b + c on two 16-bit pairs, rounded once.
template <int KIND>
__device__ __forceinline__ unsigned pair_fma(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  if (KIND == 2) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  }
  return d;
}
// PAIR_ROUND(low, high): two floats as one 16-bit pair, each rounded to
// nearest even.
template <int KIND>
__device__ __forceinline__ unsigned pair_round(float low, float high) {
  unsigned d;
  if (KIND == 2) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(high), "f"(low));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(high), "f"(low));
  }
  return d;
}
#define MMA_16x8x16(d, a, b, exchange, lane) mma_16x8x16<IN_KIND>((d), (a), (b))
#define PAIR_SUB(a, b) pair_sub<IN_KIND>((a), (b))
#define PAIR_FMA(a, b, c) pair_fma<IN_KIND>((a), (b), (c))
#define PAIR_ROUND(low, high) pair_round<IN_KIND>((low), (high))
// AND_OR: (a & mask) | bits, one lop3 (for two immediates the compiler makes
// two instructions: an and, then an or; the fields of a word take one each).
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned mask, unsigned bits) {
  unsigned d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
  return d;
}
#define AND_OR(a, mask, bits) and_or((a), (mask), (bits))
// LOW_HALVES(a, b): the pair (a's low 16 bits, b's low 16 bits); HIGH_HALVES
// the same of the high halves. One byte permute each (two instructions as
// shifts and masks).
#define LOW_HALVES(a, b) __byte_perm((a), (b), 0x5410)
#define HIGH_HALVES(a, b) __byte_perm((a), (b), 0x7632)
// BYTE_PAIR(a, b, k): byte k of a in the low 16-bit half, byte k of b in the
// high half, each as its half's low byte (the halves' high bytes are left
// undefined: callers mask them). One byte permute.
#define BYTE_PAIR(a, b, k) __byte_perm((a), (b), (k) * 0x1111 + 0x4400)
// ASYNC_COPY16: 16 bytes from global to shared memory, asynchronously
// (cp.async, sm_80 on; both addresses 16-byte aligned), in the group of copies
// that ASYNC_COMMIT closes; ASYNC_WAIT(n): until at most the newest n such
// groups of this thread are in flight. A barrier then makes the copies
// every thread's.
__device__ __forceinline__ void async_copy16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
               :: "r"((unsigned)__cvta_generic_to_shared(shared)), "l"(global) : "memory");
}
template <int N>
__device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
#define ASYNC_COPY16(shared, global) async_copy16((shared), (global))
#define ASYNC_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#define ASYNC_WAIT(n) async_wait<(n)>()
// defines: WARPGROUP_MMA WARPGROUP_MMA_SS WARPGROUP_FENCE WARPGROUP_COMMIT
// defines: WARPGROUP_WAIT SHARED_PROXY_FENCE SWIZZLE128 SHARED_ALIGN1024
// WARPGROUP_MMA(d, a, b, row_tiles, lbo, sbo, exchange, lane): the group's
// four warps (a warpgroup: the block tiles that take it have four) together
// D += A B, Hopper's wgmma.mma_async.m64nNk16 (sm_90a; N = 8 * row_tiles:
// 24, 32, 48, 64, 80, 96, 128, 160 or 192, a constant). A is 64 x 16, warp w's
// rows 16 w to 16 w + 15 in its registers a as MMA_16x8x16's A; B is 16 x N
// in group memory at b, in core matrices of 8 of its columns by 8 of its k
// (8 rows of 16 bytes, 128 bytes), the next 8 k `lbo` words on and the next
// 8 columns `sbo` words on (no swizzle: both constants, 16-byte multiples);
// D is each warp's row_tiles MMA_16x8x16 accumulators (n tile j's four
// sums at d + 4 j).
// Asynchronous: WARPGROUP_FENCE before one that reads registers written
// since the last, WARPGROUP_COMMIT closes a batch, WARPGROUP_WAIT(n, d,
// count) waits until at most n batches are in flight and then makes d[0,
// count) the finished sums (the compiler may not read them before). Its reads
// of group memory go through the async proxy: SHARED_PROXY_FENCE makes this
// thread's writes to it (stores, cp.async's once waited for) visible there.
// WARPGROUP_MMA_SS(d, a, a_at, b, b_at, row_tiles, exchange, lane, warp): the
// same with A in group memory too, both operands swizzled: rows of 64 k (128
// bytes) one after another from a (b), 1024-byte aligned, row r's 16-byte
// chunk j at words SWIZZLE128(r * 32 + 4 * j), wgmma's 128-byte swizzle;
// the warpgroup's 64 rows of A from word a_at, B's from b_at, each with the
// step's k (0, 8, 16 or 24 words on) (`warp`, the warp's place in its
// warpgroup, is the emulations').
// SWIZZLE128(x): where that swizzle puts word x: its chunk's index XOR its
// row's, mod 8.
#define SWIZZLE128(x) ((x) ^ ((((x) >> 5) & 7) << 2))
// SHARED_ALIGN1024(p): the first word of group memory from p on at a
// multiple of 1024 bytes (the swizzle's period).
#define SHARED_ALIGN1024(p) ((p) + ((256u - ((unsigned)__cvta_generic_to_shared(p) >> 2)) & 255u))
// The WG_ and WGMMA_ macros spell wgmma's operands; undefined after use.
#define WG_D0_11 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11"
#define WG_D0_15 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
#define WG_D16_31 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define WG_D32_47 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47"
#define WG_D16_23 "%16,%17,%18,%19,%20,%21,%22,%23"
#define WG_D32_39 "%32,%33,%34,%35,%36,%37,%38,%39"
#define WG_D48_63 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define WG_D64_79 "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79"
#define WG_D80_95 "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95"
#define WG_F4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_F8(i) WG_F4(i), WG_F4(i + 4)
#define WG_F16(i) WG_F8(i), WG_F8(i + 8)
#define WG_IN "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)
#define WG_SS_IN "l"(desc_a), "l"(desc_b), "r"(1)
#define WG_OP(n, types) "{.reg .pred p; setp.ne.b32 p, %" n ", 0; wgmma.mma_async.sync.aligned." types
#define WGMMA_24(types) asm volatile(WG_OP("17", "m64n24k16.f32." types) " {" WG_D0_11 "}, {%12,%13,%14,%15}, %16, p, 1, 1, 0;}" : WG_F8(0), WG_F4(8) : WG_IN)
#define WGMMA_32(types) asm volatile(WG_OP("21", "m64n32k16.f32." types) " {" WG_D0_15 "}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;}" : WG_F16(0) : WG_IN)
#define WGMMA_48(types) asm volatile(WG_OP("29", "m64n48k16.f32." types) " {" WG_D0_15 "," WG_D16_23 "}, {%24,%25,%26,%27}, %28, p, 1, 1, 0;}" : WG_F16(0), WG_F8(16) : WG_IN)
#define WGMMA_64(types) asm volatile(WG_OP("37", "m64n64k16.f32." types) " {" WG_D0_15 "," WG_D16_31 "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;}" : WG_F16(0), WG_F16(16) : WG_IN)
#define WGMMA_80(types) asm volatile(WG_OP("45", "m64n80k16.f32." types) " {" WG_D0_15 "," WG_D16_31 "," WG_D32_39 "}, {%40,%41,%42,%43}, %44, p, 1, 1, 0;}" : WG_F16(0), WG_F16(16), WG_F8(32) : WG_IN)
#define WGMMA_96(types) asm volatile(WG_OP("53", "m64n96k16.f32." types) " {" WG_D0_15 "," WG_D16_31 "," WG_D32_47 "}, {%48,%49,%50,%51}, %52, p, 1, 1, 0;}" : WG_F16(0), WG_F16(16), WG_F16(32) : WG_IN)
#define WGMMA_128(types) asm volatile(WG_OP("69", "m64n128k16.f32." types) " {" WG_D0_15 "," WG_D16_31 "," WG_D32_47 "," WG_D48_63 "}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;}" : WG_F16(0), WG_F16(16), WG_F16(32), WG_F16(48) : WG_IN)
#define WGMMA_160(types) asm volatile(WG_OP("85", "m64n160k16.f32." types) " {" WG_D0_15 "," WG_D16_31 "," WG_D32_47 "," WG_D48_63 "," WG_D64_79 "}, {%80,%81,%82,%83}, %84, p, 1, 1, 0;}" : WG_F16(0), WG_F16(16), WG_F16(32), WG_F16(48), WG_F16(64) : WG_IN)
#define WGMMA_192(types) asm volatile(WG_OP("101", "m64n192k16.f32." types) " {" WG_D0_15 "," WG_D16_31 "," WG_D32_47 "," WG_D48_63 "," WG_D64_79 "," WG_D80_95 "}, {%96,%97,%98,%99}, %100, p, 1, 1, 0;}" : WG_F16(0), WG_F16(16), WG_F16(32), WG_F16(48), WG_F16(64), WG_F16(80) : WG_IN)
#define WGMMA_SS_24(types) asm volatile(WG_OP("14", "m64n24k16.f32." types) " {" WG_D0_11 "}, %12, %13, p, 1, 1, 0, 0;}" : WG_F8(0), WG_F4(8) : WG_SS_IN)
#define WGMMA_SS_32(types) asm volatile(WG_OP("18", "m64n32k16.f32." types) " {" WG_D0_15 "}, %16, %17, p, 1, 1, 0, 0;}" : WG_F16(0) : WG_SS_IN)
#define WGMMA_SS_48(types) asm volatile(WG_OP("26", "m64n48k16.f32." types) " {" WG_D0_15 "," WG_D16_23 "}, %24, %25, p, 1, 1, 0, 0;}" : WG_F16(0), WG_F8(16) : WG_SS_IN)
#define WGMMA_SS_64(types) asm volatile(WG_OP("34", "m64n64k16.f32." types) " {" WG_D0_15 "," WG_D16_31 "}, %32, %33, p, 1, 1, 0, 0;}" : WG_F16(0), WG_F16(16) : WG_SS_IN)
#define WGMMA_SS_80(types) asm volatile(WG_OP("42", "m64n80k16.f32." types) " {" WG_D0_15 "," WG_D16_31 "," WG_D32_39 "}, %40, %41, p, 1, 1, 0, 0;}" : WG_F16(0), WG_F16(16), WG_F8(32) : WG_SS_IN)
#define WGMMA_SS_96(types) asm volatile(WG_OP("50", "m64n96k16.f32." types) " {" WG_D0_15 "," WG_D16_31 "," WG_D32_47 "}, %48, %49, p, 1, 1, 0, 0;}" : WG_F16(0), WG_F16(16), WG_F16(32) : WG_SS_IN)
#define WGMMA_SS_128(types) asm volatile(WG_OP("66", "m64n128k16.f32." types) " {" WG_D0_15 "," WG_D16_31 "," WG_D32_47 "," WG_D48_63 "}, %64, %65, p, 1, 1, 0, 0;}" : WG_F16(0), WG_F16(16), WG_F16(32), WG_F16(48) : WG_SS_IN)
#define WGMMA_SS_160(types) asm volatile(WG_OP("82", "m64n160k16.f32." types) " {" WG_D0_15 "," WG_D16_31 "," WG_D32_47 "," WG_D48_63 "," WG_D64_79 "}, %80, %81, p, 1, 1, 0, 0;}" : WG_F16(0), WG_F16(16), WG_F16(32), WG_F16(48), WG_F16(64) : WG_SS_IN)
#define WGMMA_SS_192(types) asm volatile(WG_OP("98", "m64n192k16.f32." types) " {" WG_D0_15 "," WG_D16_31 "," WG_D32_47 "," WG_D48_63 "," WG_D64_79 "," WG_D80_95 "}, %96, %97, p, 1, 1, 0, 0;}" : WG_F16(0), WG_F16(16), WG_F16(32), WG_F16(48), WG_F16(64), WG_F16(80) : WG_SS_IN)
// WGMMA_BY_N(FORM): FORM's wgmma (WGMMA_ or WGMMA_SS_) of N = 8 * ROW_TILES_N
// rows, in the rows' 16-bit format (KIND 2: bfloat16, else float16); other
// N trap (a body's text for other blocks, never run: the launch says
// WARPGROUP 0).
#define WG_BY_KIND(FORM, N) if (KIND == 2) { FORM##N("bf16.bf16"); } else { FORM##N("f16.f16"); }
#define WGMMA_BY_N(FORM) if (ROW_TILES_N == 3) { WG_BY_KIND(FORM, 24) } else if (ROW_TILES_N == 4) { WG_BY_KIND(FORM, 32) } else if (ROW_TILES_N == 6) { WG_BY_KIND(FORM, 48) } else if (ROW_TILES_N == 8) { WG_BY_KIND(FORM, 64) } else if (ROW_TILES_N == 10) { WG_BY_KIND(FORM, 80) } else if (ROW_TILES_N == 12) { WG_BY_KIND(FORM, 96) } else if (ROW_TILES_N == 16) { WG_BY_KIND(FORM, 128) } else if (ROW_TILES_N == 20) { WG_BY_KIND(FORM, 160) } else if (ROW_TILES_N == 24) { WG_BY_KIND(FORM, 192) } else { __trap(); }
// A shared-memory matrix descriptor of the matrix `at` words past `base` (a
// multiple of 4; both 16-byte aligned): its address, lbo and sbo (words) in
// bytes over 16; no swizzle, or (swizzled) the 128-byte swizzle (layout 1), 8
// rows 1024 bytes apart, lbo unused. A group's addresses take the low 14 bits
// (256 KB over 16), below lbo's, so the low word is a sum: base's part, which
// the compiler keeps for a loop, plus at / 4 and lbo, which it adds to it (the
// whole address converted and masked at each call cost four instructions more
// a multiply-add).
__device__ __forceinline__ unsigned long long warpgroup_descriptor(const unsigned* base, int at,
                                                                   int lbo, int sbo,
                                                                   bool swizzled) {
  const unsigned long long layout = swizzled ? (1ull << 16) | (64ull << 32) | (1ull << 62)
                                             : ((unsigned long long)(lbo / 4) << 16)
                                               | ((unsigned long long)(sbo / 4) << 32);
  return (layout >> 32 << 32) | ((unsigned)(__cvta_generic_to_shared(base) >> 4)
                                 + ((unsigned)at >> 2) + (unsigned)layout);
}
template <int KIND, int ROW_TILES_N>
__device__ __forceinline__ void warpgroup_mma(float* d, const unsigned* a, const unsigned* b,
                                              int lbo, int sbo) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const unsigned long long desc = warpgroup_descriptor(b, 0, lbo, sbo, false);
  WGMMA_BY_N(WGMMA_)
#else
  __trap();  // no wgmma before sm_90a: the launch takes it only there
#endif
}
template <int KIND, int ROW_TILES_N>
__device__ __forceinline__ void warpgroup_mma_ss(float* d, const unsigned* a, int a_at,
                                                 const unsigned* b, int b_at) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const unsigned long long desc_a = warpgroup_descriptor(a, a_at, 0, 0, true);
  const unsigned long long desc_b = warpgroup_descriptor(b, b_at, 0, 0, true);
  WGMMA_BY_N(WGMMA_SS_)
#else
  __trap();  // no wgmma before sm_90a: the launch takes it only there
#endif
}
#undef WG_D0_11
#undef WG_D0_15
#undef WG_D16_23
#undef WG_D16_31
#undef WG_D32_39
#undef WG_D32_47
#undef WG_D48_63
#undef WG_D64_79
#undef WG_D80_95
#undef WG_F4
#undef WG_F8
#undef WG_F16
#undef WG_IN
#undef WG_SS_IN
#undef WG_OP
#undef WGMMA_24
#undef WGMMA_32
#undef WGMMA_48
#undef WGMMA_64
#undef WGMMA_80
#undef WGMMA_96
#undef WGMMA_128
#undef WGMMA_160
#undef WGMMA_192
#undef WGMMA_SS_24
#undef WGMMA_SS_32
#undef WGMMA_SS_48
#undef WGMMA_SS_64
#undef WGMMA_SS_80
#undef WGMMA_SS_96
#undef WGMMA_SS_128
#undef WGMMA_SS_160
#undef WGMMA_SS_192
#undef WG_BY_KIND
#undef WGMMA_BY_N
template <int N>
__device__ __forceinline__ void warpgroup_wait(float* d, int count) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N));
#endif
  for (int i = 0; i < count; ++i) {
    asm volatile("" : "+f"(d[i]));
  }
}
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WARPGROUP_FENCE() asm volatile("wgmma.fence.sync.aligned;")
#define WARPGROUP_COMMIT() asm volatile("wgmma.commit_group.sync.aligned;")
#define SHARED_PROXY_FENCE() asm volatile("fence.proxy.async.shared::cta;" ::: "memory")
#else
#define WARPGROUP_FENCE() ((void)0)
#define WARPGROUP_COMMIT() ((void)0)
#define SHARED_PROXY_FENCE() ((void)0)
#endif
#define WARPGROUP_MMA(d, a, b, row_tiles, lbo, sbo, exchange, lane) warpgroup_mma<IN_KIND, (row_tiles)>((d), (a), (b), (lbo), (sbo))
#define WARPGROUP_WAIT(n, d, count) warpgroup_wait<(n)>((d), (count))
#define WARPGROUP_MMA_SS(d, a, a_at, b, b_at, row_tiles, exchange, lane, warp) warpgroup_mma_ss<IN_KIND, (row_tiles)>((d), (a), (a_at), (b), (b_at))
// defines: ROLE_BARRIER ROLES_APART WARP_REGISTERS role_barrier
// ROLE_BARRIER(id, waits, count): named barrier `id` (1 to 15; 0 is
// BARRIER's) of `count` threads (a multiple of 32), where a thread that
// `waits` (bar.sync) holds until all `count` have come and one that does not
// only arrives (bar.arrive) and goes on; each warp's lanes alike. Both order
// memory: what a thread wrote before it is a waiting thread's after. So
// warps of two roles pass work one way without holding the other role
// (ROLES_APART: the roles' warps run apart; 0 in the lock-step emulations,
// whose ROLE_BARRIER is the group's barrier).
#define ROLES_APART 1
template <int ID, int COUNT>
__device__ __forceinline__ void role_barrier(bool waits) {
  if (waits) {
    asm volatile("bar.sync %0, %1;" :: "n"(ID), "n"(COUNT) : "memory");
  } else {
    asm volatile("bar.arrive %0, %1;" :: "n"(ID), "n"(COUNT) : "memory");
  }
}
#define ROLE_BARRIER(id, waits, count) role_barrier<(id), (count)>(waits)
// WARP_REGISTERS(n, more): the warp's registers a thread become n (a
// multiple of 8, 24 to 256), more (`more`) or fewer than the launch gave it
// (setmaxnreg, sm_90a; every warp of the warpgroup alike): a role whose work
// needs many takes them from one that needs few.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WARP_REGISTERS(n, more) do { if (more) { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(n)); } else { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(n)); } } while (0)
#else
#define WARP_REGISTERS(n, more) ((void)0)
#endif
// defines: WARP_XOR
// WARP_XOR(value, mask, exchange, lane): the float `value` of lane `lane ^
// mask` of the warp (every lane takes part; `exchange` is the emulations').
#define WARP_XOR(value, mask, exchange, lane) __shfl_xor_sync(0xFFFFFFFFu, (value), (mask))
