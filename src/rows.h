// Shared by gather.cpp and combine.cpp: element conversion through float32,
// the dtype dispatch over the three row dtypes, output allocation and the
// split of row loops over threads.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>

#include "mlx/array.h"
#include "mlx/types/half_types.h"

namespace mlx_moe_plan {

// float16 to float32 by table: exact, and several times faster than MLX's
// portable float16_t conversion on CPUs without native half arithmetic.
// Filled when the extension loads, so the per-element lookup is one load.
extern const float* const float16_to_float32;

template <typename T>
inline float to_float(T value) {
  return static_cast<float>(value);
}

template <>
inline float to_float(mlx::core::float16_t value) {
  uint16_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return float16_to_float32[bits];
}

template <>
inline float to_float(mlx::core::bfloat16_t value) {
  uint16_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

template <typename T>
inline T from_float(float value) {
  // MLX's float16_t and bfloat16_t round to nearest even, like every backend.
  return static_cast<T>(value);
}

// Calls f(T{}) with T the C++ type of a row dtype.
template <typename F>
void dispatch_row_dtype(mlx::core::Dtype dtype, F&& f) {
  switch (dtype) {
    case mlx::core::float32:
      f(float{});
      break;
    case mlx::core::float16:
      f(mlx::core::float16_t{});
      break;
    case mlx::core::bfloat16:
      f(mlx::core::bfloat16_t{});
      break;
    default:
      throw std::invalid_argument("rows: expected float32, float16 or bfloat16");
  }
}

// Allocates `out`. MLX's CPU allocator hands out fresh memory, and first
// touching it (the kernel zeroes each page) costs more than the copy itself:
// large outputs reuse a kept buffer no one else holds, else get fresh memory
// with transparent huge pages (512 times fewer faults) and are kept.
void allocate_rows(mlx::core::array& out);

// Runs body(begin, end) over [0, count) in contiguous slices, on several
// threads when `bytes` (the work's traffic) is large enough to pay for them.
// Each row is written by one thread, so the result does not depend on it.
void parallel_rows(int64_t count, int64_t bytes, const std::function<void(int64_t, int64_t)>& body);

} // namespace mlx_moe_plan
