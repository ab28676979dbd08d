// Gather on the CPU: out[r] = src[index[r]] in the out dtype, zeros where
// index[r] < 0. One row at a time at memory speed; a same-dtype row is a
// memcpy, so it moves bits (NaN payloads included) exactly like the GPU copy.
#include <cstring>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"

#include "primitives.h"
#include "rows.h"

namespace mlx_moe_plan {

namespace {

template <typename In, typename Out>
void gather_cpu(const In* src, int64_t num_src, const int32_t* index, int64_t begin,
                int64_t end, int64_t hidden, Out* out) {
  for (int64_t r = begin; r < end; ++r) {
    Out* dst = out + r * hidden;
    int32_t i = index[r];
    if (i < 0 || i >= num_src) { // never read outside src, whatever the index says
      std::memset(dst, 0, hidden * sizeof(Out));
      continue;
    }
    const In* from = src + i * hidden;
    if constexpr (std::is_same_v<In, Out>) {
      std::memcpy(dst, from, hidden * sizeof(Out));
    } else {
      for (int64_t h = 0; h < hidden; ++h) {
        dst[h] = from_float<Out>(to_float(from[h]));
      }
    }
  }
}

} // namespace

mx::array gather_rows(
    const mx::array& src,
    const mx::array& index,
    const std::optional<mx::array>& inverse,
    mx::Dtype dtype,
    mx::StreamOrDevice s) {
  if (src.ndim() != 2) {
    throw std::invalid_argument("src: expected [N, H]");
  }
  if (index.dtype() != mx::int32 || index.ndim() != 1) {
    throw std::invalid_argument("index: expected a flat int32 array");
  }
  if (inverse && (inverse->dtype() != mx::int32 || inverse->ndim() != 2 ||
                  inverse->shape(0) != src.shape(0))) {
    throw std::invalid_argument("inverse: expected int32 [N, M]");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {
      mx::contiguous(src, false, stream), mx::contiguous(index, false, stream)};
  if (inverse) {
    inputs.push_back(*inverse);
  }
  return mx::array(
      {index.shape(0), src.shape(1)},
      dtype,
      std::make_shared<GatherRows>(stream, inverse.has_value()),
      inputs);
}

std::vector<mx::Shape> GatherRows::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[1].shape(0), inputs[0].shape(1)}};
}

void GatherRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  allocate_rows(out);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_input_array(inputs[1]);
  encoder.set_output_array(out);
  encoder.dispatch([src = inputs[0], index = inputs[1], out]() mutable {
    dispatch_row_dtype(src.dtype(), [&](auto in_type) {
      using In = decltype(in_type);
      dispatch_row_dtype(out.dtype(), [&](auto out_type) {
        using Out = decltype(out_type);
        int64_t bytes = out.nbytes() * 2; // read once, written once
        parallel_rows(index.size(), bytes, [&](int64_t begin, int64_t end) {
          gather_cpu<In, Out>(src.data<In>(), src.shape(0), index.data<int32_t>(), begin, end,
                              src.shape(1), out.data<Out>());
        });
      });
    });
  });
}

void GatherRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("MoEGatherRows: the C++ primitive is the CPU path; GPU streams use the kernels");
}

std::vector<mx::array> GatherRows::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg != 0) { // integer index arrays
      grads.push_back(mx::zeros_like(primals[arg], stream()));
      continue;
    }
    if (!has_inverse_) {
      throw std::invalid_argument("MoEGatherRows: this gather has no inverse index, so no gradient");
    }
    // Each src row was copied to the rows its inverse lists: sum them. The
    // formula of gather_rows_vjp in mlx_moe_plan/_gradients.py, which the GPU
    // backend runs on its kernels; tests/test_gradients.py checks they agree.
    grads.push_back(combine_rows(
        cotangents[0], primals[2], std::nullopt, std::nullopt, primals[0].dtype(), stream()));
  }
  return grads;
}

bool GatherRows::is_equivalent(const mx::Primitive& other) const {
  return has_inverse_ == static_cast<const GatherRows&>(other).has_inverse_;
}

} // namespace mlx_moe_plan
