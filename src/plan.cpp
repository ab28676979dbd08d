// Plan on the CPU: one stable counting sort of the routing entries by expert,
// O(entries + experts), bitwise identical to mlx_moe_plan/reference.py.
#include <algorithm>
#include <stdexcept>
#include <string_view>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/utils.h"

#include "primitives.h"

namespace mlx_moe_plan {

namespace {

int64_t capacity_for(int64_t num_entries, int64_t num_experts, int64_t tile_m) {
  if (tile_m == 1) {
    return num_entries;
  }
  int64_t worst = num_entries + std::min(num_experts, num_entries) * (tile_m - 1);
  return (worst + tile_m - 1) / tile_m * tile_m;
}

void plan_cpu(
    const int32_t* ids,
    const float* weights, // may be null
    int64_t num_entries,
    int num_experts,
    int tile_m,
    int top_k,
    int64_t capacity,
    int32_t* row_tokens,
    int32_t* row_experts,
    float* row_weights, // may be null
    int32_t* row_entries,
    int32_t* positions,
    int32_t* expert_counts,
    int32_t* expert_offsets,
    int32_t* tile_experts,
    int32_t* num_rows_out,
    int32_t* num_tiles_out,
    int32_t* num_invalid_out) {
  std::fill(expert_counts, expert_counts + num_experts, 0);
  int32_t num_invalid = 0;
  for (int64_t i = 0; i < num_entries; ++i) {
    int32_t expert = ids[i];
    if (expert >= num_experts) {
      ++num_invalid;
    } else if (expert >= 0) {
      ++expert_counts[expert];
    }
  }
  int32_t row = 0;
  for (int e = 0; e < num_experts; ++e) {
    expert_offsets[e] = row;
    row += (expert_counts[e] + tile_m - 1) / tile_m * tile_m;
  }
  expert_offsets[num_experts] = row;
  const int32_t num_rows = row;

  // Padding and tail rows first; placed entries overwrite their own rows.
  std::fill(row_tokens, row_tokens + capacity, -1);
  std::fill(row_entries, row_entries + capacity, -1);
  if (row_weights) {
    std::fill(row_weights, row_weights + capacity, 0.0f);
  }
  for (int e = 0; e < num_experts; ++e) {
    std::fill(row_experts + expert_offsets[e], row_experts + expert_offsets[e + 1], e);
  }
  std::fill(row_experts + num_rows, row_experts + capacity, num_experts - 1);

  // Entries in ascending flat order: the sort is stable within an expert.
  std::vector<int32_t> next_row(expert_offsets, expert_offsets + num_experts);
  for (int64_t i = 0; i < num_entries; ++i) {
    int32_t expert = ids[i];
    if (expert < 0 || expert >= num_experts) {
      positions[i] = -1;
      continue;
    }
    int32_t r = next_row[expert]++;
    positions[i] = r;
    row_tokens[r] = static_cast<int32_t>(i / top_k);
    row_entries[r] = static_cast<int32_t>(i);
    if (row_weights) {
      row_weights[r] = weights[i];
    }
  }

  const int64_t max_tiles = capacity / tile_m;
  const int32_t num_tiles = num_rows / tile_m;
  for (int64_t t = 0; t < max_tiles; ++t) {
    tile_experts[t] = t < num_tiles ? row_experts[t * tile_m] : -1;
  }
  *num_rows_out = num_rows;
  *num_tiles_out = num_tiles;
  *num_invalid_out = num_invalid;
}

} // namespace

std::vector<mx::array> plan(
    const mx::array& ids,
    const std::optional<mx::array>& weights,
    int num_experts,
    int tile_m,
    int top_k,
    mx::StreamOrDevice s) {
  if (ids.dtype() != mx::int32 || ids.ndim() != 1) {
    throw std::invalid_argument("ids: expected a flat int32 array");
  }
  if (num_experts < 1 || tile_m < 1 || top_k < 1) {
    throw std::invalid_argument("num_experts, tile_m and top_k must be at least 1");
  }
  if (ids.size() % top_k != 0) {
    throw std::invalid_argument("ids: size is not a multiple of top_k");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {mx::contiguous(ids, false, stream)};
  if (weights) {
    if (weights->dtype() != mx::float32 || weights->shape() != ids.shape()) {
      throw std::invalid_argument("weights: expected float32 of the ids' shape");
    }
    inputs.push_back(mx::contiguous(*weights, false, stream));
  }
  auto primitive = std::make_shared<Plan>(stream, num_experts, tile_m, top_k, weights.has_value());
  auto shapes = primitive->output_shapes(inputs);
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::int32);
  if (weights) {
    dtypes[plan_output("row_weights")] = mx::float32;
  }
  return mx::array::make_arrays(std::move(shapes), dtypes, primitive, inputs);
}

std::vector<mx::Shape> Plan::output_shapes(const std::vector<mx::array>& inputs) {
  const int64_t num_entries = inputs[0].size();
  const int capacity = static_cast<int>(capacity_for(num_entries, num_experts_, tile_m_));
  const int entries = static_cast<int>(num_entries);
  auto shape_of = [&](std::string_view name) -> mx::Shape {
    if (name == "row_tokens" || name == "row_experts" || name == "row_entries" ||
        name == "row_weights") {
      return {capacity};
    }
    if (name == "tile_experts") {
      return {capacity / tile_m_};
    }
    if (name == "positions") {
      return {entries};
    }
    if (name == "expert_counts") {
      return {num_experts_};
    }
    if (name == "expert_offsets") {
      return {num_experts_ + 1};
    }
    if (name == "num_rows" || name == "num_tiles" || name == "num_invalid") {
      return {};
    }
    throw std::logic_error("MoEPlan: no shape for an output of kPlanOutputs");
  };
  // Every output in kPlanOutputs order; row_weights, the last, only with weights.
  const std::size_t count = kPlanOutputs.size() - (has_weights_ ? 0 : 1);
  std::vector<mx::Shape> shapes;
  for (std::size_t i = 0; i < count; ++i) {
    shapes.push_back(shape_of(kPlanOutputs[i]));
  }
  return shapes;
}

void Plan::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& out : outputs) {
    encoder.set_output_array(out);
  }
  const mx::array ids = inputs[0];
  const std::optional<mx::array> weights =
      has_weights_ ? std::optional<mx::array>(inputs[1]) : std::nullopt;
  std::vector<mx::array> outs = outputs;
  encoder.dispatch([ids, weights, outs, num_experts = num_experts_, tile_m = tile_m_,
                    top_k = top_k_]() mutable {
    auto field = [&outs](std::size_t output) { return outs[output].data<int32_t>(); };
    plan_cpu(
        ids.data<int32_t>(),
        weights ? weights->data<float>() : nullptr,
        ids.size(),
        num_experts,
        tile_m,
        top_k,
        outs[plan_output("row_tokens")].size(),
        field(plan_output("row_tokens")),
        field(plan_output("row_experts")),
        weights ? outs[plan_output("row_weights")].data<float>() : nullptr,
        field(plan_output("row_entries")),
        field(plan_output("positions")),
        field(plan_output("expert_counts")),
        field(plan_output("expert_offsets")),
        field(plan_output("tile_experts")),
        field(plan_output("num_rows")),
        field(plan_output("num_tiles")),
        field(plan_output("num_invalid")));
  });
}

void Plan::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("MoEPlan: the C++ primitive is the CPU path; GPU streams use the kernels");
}

std::vector<mx::array> Plan::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>&,
    const std::vector<int>& argnums,
    const std::vector<mx::array>&) {
  // The integer outputs carry no gradient, and row_weights is a permutation
  // of the weights that only the plan's own consumers read: none flows back.
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    grads.push_back(mx::zeros_like(primals[arg], stream()));
  }
  return grads;
}

bool Plan::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Plan&>(other);
  return num_experts_ == o.num_experts_ && tile_m_ == o.tile_m_ && top_k_ == o.top_k_ &&
      has_weights_ == o.has_weights_;
}

} // namespace mlx_moe_plan
