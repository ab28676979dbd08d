#include "rows.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "mlx/allocator.h"

namespace mlx_moe_plan {

const float* float16_to_float32_table() {
  static const std::vector<float> table = [] {
    std::vector<float> values(1 << 16);
    for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
      uint16_t half_bits = static_cast<uint16_t>(bits);
      mlx::core::float16_t half;
      std::memcpy(&half, &half_bits, sizeof(half));
      values[bits] = static_cast<float>(half);
    }
    return values;
  }();
  return table.data();
}

namespace {
constexpr int64_t kLargeBytes = int64_t{4} << 20;
} // namespace

void allocate_rows(mlx::core::array& out) {
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (static_cast<int64_t>(out.nbytes()) >= kLargeBytes) {
    constexpr uintptr_t huge = uintptr_t{2} << 20;
    auto begin = reinterpret_cast<uintptr_t>(out.data<char>());
    auto end = begin + out.nbytes();
    uintptr_t first = (begin + huge - 1) & ~(huge - 1);
    if (first < end) {
      madvise(reinterpret_cast<void*>(first), end - first, MADV_HUGEPAGE); // advice only
    }
  }
#endif
}

void parallel_rows(int64_t count, int64_t bytes, const std::function<void(int64_t, int64_t)>& body) {
  int64_t threads = std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()), 8);
  threads = std::min(threads, std::max<int64_t>(1, bytes / kLargeBytes));
  threads = std::min(threads, std::max<int64_t>(count, 1));
  if (threads <= 1) {
    body(0, count);
    return;
  }
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) {
    workers.emplace_back(body, count * t / threads, count * (t + 1) / threads);
  }
  body(0, count / threads);
  for (auto& worker : workers) {
    worker.join();
  }
}

} // namespace mlx_moe_plan
