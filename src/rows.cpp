#include "rows.h"

#include <algorithm>
#include <cstdint>
#include <list>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "mlx/allocator.h"

namespace mlx_moe_plan {

namespace {

std::vector<float> float16_values() {
  std::vector<float> values(1 << 16);
  for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
    uint16_t half_bits = static_cast<uint16_t>(bits);
    mlx::core::float16_t half;
    std::memcpy(&half, &half_bits, sizeof(half));
    values[bits] = static_cast<float>(half);
  }
  return values;
}

const std::vector<float> float16_table = float16_values();

} // namespace

const float* const float16_to_float32 = float16_table.data();

namespace {

constexpr int64_t kLargeBytes = int64_t{4} << 20;

void advise_huge_pages(void* data, size_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t huge = uintptr_t{2} << 20;
  auto begin = reinterpret_cast<uintptr_t>(data);
  auto end = begin + nbytes;
  uintptr_t first = (begin + huge - 1) & ~(huge - 1);
  if (first < end) {
    madvise(reinterpret_cast<void*>(first), end - first, MADV_HUGEPAGE); // advice only
  }
#endif
}

// Large row outputs kept between calls. Each kept array holds one reference
// to its buffer; an output that reuses it holds another, so a buffer whose
// only holder is this list is free: nothing reads it any more (pending work
// holds its inputs), and MLX does not donate a buffer with two holders.
// The same shapes recur in every layer, so reuse skips both the allocation
// and the zeroing of fresh pages. Bounded: kKeptBuffers arrays, kKeptBytes.
constexpr size_t kKeptBuffers = 4;
constexpr size_t kKeptBytes = size_t{1} << 30;
std::mutex kept_mutex;
// Least recently used first. Never destroyed: at exit MLX's allocator may be
// gone before this library's statics, and the OS takes the memory back.
std::list<mlx::core::array>& kept = *new std::list<mlx::core::array>();

} // namespace

void allocate_rows(mlx::core::array& out) {
  namespace mx = mlx::core;
  if (static_cast<int64_t>(out.nbytes()) < kLargeBytes) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    return;
  }
  std::lock_guard<std::mutex> lock(kept_mutex);
  for (auto it = kept.begin(); it != kept.end(); ++it) {
    if (it->data_shared_ptr().use_count() == 1 && it->shape() == out.shape() &&
        it->dtype() == out.dtype()) {
      out.copy_shared_buffer(*it);
      kept.splice(kept.end(), kept, it);
      return;
    }
  }
  mx::array buffer(mx::allocator::malloc(out.nbytes()), out.shape(), out.dtype());
  advise_huge_pages(buffer.data<char>(), buffer.nbytes());
  out.copy_shared_buffer(buffer);
  // Keep it if room can be made by dropping free buffers, oldest first.
  size_t bytes = buffer.nbytes();
  for (const auto& held : kept) {
    bytes += held.nbytes();
  }
  for (auto it = kept.begin(); it != kept.end() && (kept.size() >= kKeptBuffers || bytes > kKeptBytes);) {
    if (it->data_shared_ptr().use_count() == 1) {
      bytes -= it->nbytes();
      it = kept.erase(it);
    } else {
      ++it;
    }
  }
  if (kept.size() < kKeptBuffers && bytes <= kKeptBytes) {
    kept.push_back(std::move(buffer));
  }
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
