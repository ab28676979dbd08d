// MLX primitives of mlx_moe_plan: the CPU implementation of plan, gather and
// combine, lazily evaluated on MLX's CPU stream.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string_view>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_moe_plan {

namespace mx = mlx::core;

// The Plan primitive's outputs, in order: the int32 fields in the order the
// GPU kernel packs them (kernels/plan.h), then row_weights (float32), only
// when the plan has weights. The order of PLAN_FIELDS in
// mlx_moe_plan/_sizes.py, which the bindings expose this list to
// (`_ext.plan_outputs`) and tests/test_structure.py compares it with.
inline constexpr std::array<std::string_view, 11> kPlanOutputs = {
    "row_tokens", "row_experts", "row_entries", "tile_experts", "positions", "expert_counts",
    "expert_offsets", "num_rows", "num_tiles", "num_invalid", "row_weights"};

// The position of output `name` in kPlanOutputs: plan.cpp finds every output
// by name, so kPlanOutputs alone sets the order. A name not in the list does
// not compile.
consteval std::size_t plan_output(std::string_view name) {
  for (std::size_t i = 0; i < kPlanOutputs.size(); ++i) {
    if (kPlanOutputs[i] == name) {
      return i;
    }
  }
  throw "not an output of the Plan primitive";
}

// Without weights the outputs stop before row_weights, so it must be last.
static_assert(plan_output("row_weights") == kPlanOutputs.size() - 1);

// The outputs of kPlanOutputs, of their shapes. `ids` is int32 [N]; `weights`
// float32 [N].
std::vector<mx::array> plan(
    const mx::array& ids,
    const std::optional<mx::array>& weights,
    int num_experts,
    int tile_m,
    int top_k,
    mx::StreamOrDevice s = {});

// out[r] = src[index[r]] converted to `dtype`, zeros where index[r] < 0.
// `inverse` [N, M] lists, for each src row, the out rows that read it (-1 for
// none); only the gradient uses it: d src = combine_rows(d out, inverse).
mx::array gather_rows(
    const mx::array& src,
    const mx::array& index,
    const std::optional<mx::array>& inverse,
    mx::Dtype dtype,
    mx::StreamOrDevice s = {});

// out[n] = sum_m weights[n, m] * src[index[n, m]] in float32, ascending m,
// rounded once to `dtype`; index < 0 adds nothing; no weights means 1.
// `inverse` [R] names, for each src row, the flat entry n * M + m reading it
// (-1 for none); only the gradient w.r.t. src uses it.
mx::array combine_rows(
    const mx::array& src,
    const mx::array& index,
    const std::optional<mx::array>& weights,
    const std::optional<mx::array>& inverse,
    mx::Dtype dtype,
    mx::StreamOrDevice s = {});

class Plan : public mx::Primitive {
 public:
  Plan(mx::Stream stream, int num_experts, int tile_m, int top_k, bool has_weights)
      : mx::Primitive(stream),
        num_experts_(num_experts),
        tile_m_(tile_m),
        top_k_(top_k),
        has_weights_(has_weights) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override {
    return "MoEPlan";
  }

 private:
  int num_experts_;
  int tile_m_;
  int top_k_;
  bool has_weights_;
};

class GatherRows : public mx::UnaryPrimitive {
 public:
  GatherRows(mx::Stream stream, bool has_inverse)
      : mx::UnaryPrimitive(stream), has_inverse_(has_inverse) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override {
    return "MoEGatherRows";
  }

 private:
  bool has_inverse_;
};

class CombineRows : public mx::UnaryPrimitive {
 public:
  CombineRows(mx::Stream stream, bool has_weights, bool has_inverse)
      : mx::UnaryPrimitive(stream), has_weights_(has_weights), has_inverse_(has_inverse) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  bool is_equivalent(const mx::Primitive& other) const override;
  const char* name() const override {
    return "MoECombineRows";
  }

 private:
  bool has_weights_;
  bool has_inverse_;
};

} // namespace mlx_moe_plan
