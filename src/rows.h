// Shared by gather.cpp and combine.cpp: element conversion through float32
// and the dtype dispatch over the three row dtypes.
#pragma once

#include <stdexcept>

#include "mlx/array.h"
#include "mlx/types/half_types.h"

namespace mlx_moe_plan {

template <typename T>
inline float to_float(T value) {
  return static_cast<float>(value);
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

} // namespace mlx_moe_plan
