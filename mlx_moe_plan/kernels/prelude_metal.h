// Metal prelude: the dialect's names in the Metal Shading Language.
// MLX compiles this header after its Metal utils.h (metal_stdlib, half,
// bfloat16_t), then the kernel whose body is prologue_metal.h + a body.
// Products are rounded before the sums that use them, as in the reference.
#pragma METAL fp contract(off)
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
#define MUL_RN(a, b) ((a) * (b))
#define ADD_RN(a, b) ((a) + (b))
#define ZERO_VEC16 uint4(0u)
// MLX's Metal buffers are page aligned and a 16-byte row stride keeps every
// row 16-byte aligned; MSL has no pointer-to-integer test to check it here.
#define IS_ALIGNED16(p) true
