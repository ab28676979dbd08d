// Combine on the CPU: out[n] = sum_m w[n, m] * src[index[n, m]], accumulated
// in float32 in ascending m and rounded once. Built with -ffp-contract=off so
// that each product is rounded before its add, as in the reference and in
// every GPU kernel: a fused multiply-add would change the bits.
#include <stdexcept>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/backend/cpu/encoder.h"

#include "primitives.h"
#include "rows.h"

namespace mlx_moe_plan {

namespace {

// acc[h] = acc[h] + weight * row[h], rounding the product before the add.
template <typename In>
void accumulate_portable(float* acc, const In* row, float weight, int64_t hidden) {
  for (int64_t h = 0; h < hidden; ++h) {
    acc[h] = acc[h] + weight * to_float(row[h]);
  }
}

template <typename Out>
void store_portable(Out* dst, const float* acc, int64_t hidden) {
  for (int64_t h = 0; h < hidden; ++h) {
    dst[h] = from_float<Out>(acc[h]);
  }
}

// The row loops combine runs; float16 on x86-64 specializes them below.
template <typename In>
void accumulate_row(float* acc, const In* row, float weight, int64_t hidden) {
  accumulate_portable(acc, row, weight, hidden);
}

template <typename Out>
void store_row(Out* dst, const float* acc, int64_t hidden) {
  store_portable(dst, acc, hidden);
}

#if defined(__x86_64__) && defined(__GNUC__)
// float16 on x86-64: F16C widens and narrows 8 values an instruction (where
// the CPU has it; the portable loops run elsewhere). Multiply and add stay two
// instructions, as everywhere; both conversions are exact / round to nearest
// even, as the portable ones.
const bool kHasF16C = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");

__attribute__((target("avx,f16c"))) void accumulate_f16c(
    float* acc, const mx::float16_t* row, float weight, int64_t hidden) {
  const __m256 weights = _mm256_set1_ps(weight);
  int64_t h = 0;
  for (; h + 8 <= hidden; h += 8) {
    __m256 value = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + h)));
    __m256 product = _mm256_mul_ps(weights, value);
    _mm256_storeu_ps(acc + h, _mm256_add_ps(_mm256_loadu_ps(acc + h), product));
  }
  // Clear the upper AVX state before any SSE code runs (the tail here, or
  // MLX's own on this thread later), else it pays the AVX-SSE transition on
  // every instruction: 40x seen.
  _mm256_zeroupper();
  accumulate_portable(acc + h, row + h, weight, hidden - h);
}

__attribute__((target("avx,f16c"))) void store_f16c(
    mx::float16_t* dst, const float* acc, int64_t hidden) {
  int64_t h = 0;
  for (; h + 8 <= hidden; h += 8) {
    __m128i narrow = _mm256_cvtps_ph(_mm256_loadu_ps(acc + h), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + h), narrow);
  }
  _mm256_zeroupper();
  store_portable(dst + h, acc + h, hidden - h);
}

template <>
void accumulate_row(float* acc, const mx::float16_t* row, float weight, int64_t hidden) {
  if (kHasF16C) {
    accumulate_f16c(acc, row, weight, hidden);
  } else {
    accumulate_portable(acc, row, weight, hidden);
  }
}

template <>
void store_row(mx::float16_t* dst, const float* acc, int64_t hidden) {
  if (kHasF16C) {
    store_f16c(dst, acc, hidden);
  } else {
    store_portable(dst, acc, hidden);
  }
}
#endif

template <typename In, typename Out>
void combine_cpu(const In* src, int64_t num_src, const int32_t* index, const float* weights,
                 int64_t begin, int64_t end, int64_t fan_in, int64_t hidden, Out* out) {
  std::vector<float> acc(hidden);
  for (int64_t n = begin; n < end; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t m = 0; m < fan_in; ++m) {
      int32_t i = index[n * fan_in + m];
      if (i < 0 || i >= num_src) {
        continue;
      }
      // Unweighted is weight 1: the product is then exact, the same bits.
      float weight = weights ? weights[n * fan_in + m] : 1.0f;
      accumulate_row(acc.data(), src + i * hidden, weight, hidden);
    }
    store_row(out + n * hidden, acc.data(), hidden);
  }
}

} // namespace

mx::array combine_rows(
    const mx::array& src,
    const mx::array& index,
    const std::optional<mx::array>& weights,
    const std::optional<mx::array>& inverse,
    mx::Dtype dtype,
    mx::StreamOrDevice s) {
  if (src.ndim() != 2) {
    throw std::invalid_argument("src: expected [R, H]");
  }
  if (index.dtype() != mx::int32 || index.ndim() != 2) {
    throw std::invalid_argument("index: expected int32 [N, M]");
  }
  if (weights && (weights->dtype() != mx::float32 || weights->shape() != index.shape())) {
    throw std::invalid_argument("weights: expected float32 of the index's shape");
  }
  if (inverse && (inverse->dtype() != mx::int32 || inverse->ndim() != 1 ||
                  inverse->shape(0) != src.shape(0))) {
    throw std::invalid_argument("inverse: expected int32 [R]");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {
      mx::contiguous(src, false, stream), mx::contiguous(index, false, stream)};
  if (weights) {
    inputs.push_back(mx::contiguous(*weights, false, stream));
  }
  if (inverse) {
    inputs.push_back(*inverse);
  }
  return mx::array(
      {index.shape(0), src.shape(1)},
      dtype,
      std::make_shared<CombineRows>(stream, weights.has_value(), inverse.has_value()),
      inputs);
}

std::vector<mx::Shape> CombineRows::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[1].shape(0), inputs[0].shape(1)}};
}

void CombineRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  allocate_rows(out);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  encoder.set_output_array(out);
  std::optional<mx::array> weights =
      has_weights_ ? std::optional<mx::array>(inputs[2]) : std::nullopt;
  encoder.dispatch([src = inputs[0], index = inputs[1], weights, out]() mutable {
    dispatch_row_dtype(src.dtype(), [&](auto in_type) {
      using In = decltype(in_type);
      dispatch_row_dtype(out.dtype(), [&](auto out_type) {
        using Out = decltype(out_type);
        // Traffic: each output row reads fan_in source rows.
        int64_t bytes = out.nbytes() + index.size() * src.shape(1) * src.itemsize();
        parallel_rows(index.shape(0), bytes, [&](int64_t begin, int64_t end) {
          combine_cpu<In, Out>(src.data<In>(), src.shape(0), index.data<int32_t>(),
                               weights ? weights->data<float>() : nullptr, begin, end,
                               index.shape(1), src.shape(1), out.data<Out>());
        });
      });
    });
  });
}

void CombineRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("MoECombineRows: the C++ primitive is the CPU path; GPU streams use the kernels");
}

std::vector<mx::array> CombineRows::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  // The formulas of combine_rows_vjp in mlx_moe_plan/_gradients.py, which the
  // GPU backend runs on its kernels; tests/test_gradients.py checks they agree.
  const auto& src = primals[0];
  const auto& index = primals[1];
  const auto& cotangent = cotangents[0];
  const int fan_in = index.shape(1);
  auto s = stream();
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg == 0) {
      if (!has_inverse_) {
        throw std::invalid_argument("MoECombineRows: this combine has no inverse index, so no gradient w.r.t. its rows");
      }
      // d src[r] = w[entry] * d out[entry / M], entry = inverse[r] (none: 0).
      const auto& inverse = primals.back();
      auto used = mx::greater_equal(inverse, mx::array(0), s);
      auto token = mx::where(used, mx::floor_divide(inverse, mx::array(fan_in), s), mx::array(-1), s);
      auto grad = gather_rows(cotangent, token, index, src.dtype(), s);
      if (has_weights_) {
        auto flat_weights = mx::reshape(primals[2], {-1}, s);
        auto entry = mx::maximum(inverse, mx::array(0), s);
        auto row_weight = mx::where(used, mx::take(flat_weights, entry, 0, s), mx::array(0.0f), s);
        grad = mx::astype(
            mx::multiply(mx::astype(grad, mx::float32, s), mx::expand_dims(row_weight, 1, s), s),
            src.dtype(), s);
      }
      grads.push_back(grad);
    } else if (arg == 2 && has_weights_) {
      // d w[n, m] = dot(d out[n], src[index[n, m]]), in float32.
      auto flat_index = mx::reshape(index, {-1}, s);
      auto picked = gather_rows(src, flat_index, std::nullopt, mx::float32, s);
      picked = mx::reshape(picked, {index.shape(0), fan_in, src.shape(1)}, s);
      auto dy = mx::expand_dims(mx::astype(cotangent, mx::float32, s), 1, s);
      grads.push_back(mx::sum(mx::multiply(picked, dy, s), -1, false, s));
    } else { // integer index arrays
      grads.push_back(mx::zeros_like(primals[arg], s));
    }
  }
  return grads;
}

bool CombineRows::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const CombineRows&>(other);
  return has_weights_ == o.has_weights_ && has_inverse_ == o.has_inverse_;
}

} // namespace mlx_moe_plan
