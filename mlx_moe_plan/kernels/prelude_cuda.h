// CUDA prelude: the dialect's names in CUDA C++ (NVRTC, through MLX's
// cuda_kernel, which includes cuda_fp16.h, cuda_bf16.h and cooperative_groups).
// __fmul_rn / __fadd_rn are never contracted into a fused multiply-add.
typedef long long i64;
#define GLOBAL
#define SHARED __shared__
#define BARRIER() __syncthreads()
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
