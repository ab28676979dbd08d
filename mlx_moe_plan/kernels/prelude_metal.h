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
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define SHARED_ATOMIC_UINT atomic_uint
#define ATOMIC_ADD(p, v) atomic_fetch_add_explicit((p), (v), memory_order_relaxed)
#define ATOMIC_LOAD(p) atomic_load_explicit((p), memory_order_relaxed)
#define ATOMIC_STORE(p, v) atomic_store_explicit((p), (v), memory_order_relaxed)
#define LOAD_IN(p, i) static_cast<float>((p)[i])
#define STORE_OUT(p, i, v) ((p)[i] = static_cast<OutT>(v))
#define BITS_TO_FLOAT(u) as_type<float>((unsigned)(u))
#define HALF_BITS_TO_FLOAT(u) static_cast<float>(as_type<half>((ushort)(u)))
#define MUL_RN(a, b) ((a) * (b))
#define ADD_RN(a, b) ((a) + (b))
#define ZERO_VEC16 uint4(0u)
// MSL cannot test a pointer's alignment. Fresh arrays and row slices of
// 16-byte rows are 16-byte aligned; a view starting at an arbitrary element
// (x.reshape(-1)[1:].reshape(...)) is not, and is the one unsupported input
// of the Metal vector copy (MLX passes row-contiguous views uncopied).
#define IS_ALIGNED16(p) true
