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
#define BITS_TO_FLOAT(u) __uint_as_float((unsigned)(u))
#define HALF_BITS_TO_FLOAT(u) __half2float(__ushort_as_half((unsigned short)(u)))
#define MUL_RN(a, b) __fmul_rn((a), (b))
#define ADD_RN(a, b) __fadd_rn((a), (b))
#define ZERO_VEC16 make_uint4(0u, 0u, 0u, 0u)
#define IS_ALIGNED16(p) ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0)
// UNROLL: unroll the loop that follows (its arrays indexed by constants stay
// in registers).
#define UNROLL _Pragma("unroll")
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
#define MMA_16x8x16(d, a, b, exchange, lane) mma_16x8x16<IN_KIND>((d), (a), (b))
#define PAIR_SUB(a, b) pair_sub<IN_KIND>((a), (b))
#define PAIR_FMA(a, b, c) pair_fma<IN_KIND>((a), (b), (c))
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
