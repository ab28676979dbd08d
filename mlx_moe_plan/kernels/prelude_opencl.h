// OpenCL C prelude: the dialect's names in OpenCL C 1.2. Used by the tests,
// which run every kernel body on PoCL. OpenCL C has no templates: the test
// harness defines each template constant, and IN_DTYPE / OUT_DTYPE (0 float32,
// 1 float16, 2 bfloat16 as ushort bits) pick the conversions below.
#pragma OPENCL FP_CONTRACT OFF
typedef long i64;
#define GLOBAL __global
#define SHARED __local
#define BARRIER() barrier(CLK_LOCAL_MEM_FENCE)
#define SHARED_ATOMIC_UINT uint
#define ATOMIC_ADD(p, v) atomic_add((p), (v))
#define ATOMIC_LOAD(p) (*(volatile __local uint*)(p))
#define ATOMIC_STORE(p, v) (*(volatile __local uint*)(p) = (v))
#define BITS_TO_FLOAT(u) as_float((uint)(u))
#define HALF_BITS_TO_FLOAT(u) half_bits_to_float((ushort)(u))
#define MUL_RN(a, b) ((a) * (b))
#define ADD_RN(a, b) ((a) + (b))
#define ZERO_VEC16 ((uint4)(0u))
#define IS_ALIGNED16(p) ((((ulong)(p)) & 15ul) == 0)

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
#elif OUT_DTYPE == 2
#define STORE_OUT(p, i, v) ((p)[i] = float_to_bf16_bits(v))
#else
#define STORE_OUT(p, i, v) ((p)[i] = (v))
#endif
