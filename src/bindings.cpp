// Python bindings of the C++ primitives; binds only. The public API, with its
// argument checks, is mlx_moe_plan (Python).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <string_view>

#include "primitives.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() =
      "CPU primitives of mlx_moe_plan (plan, gather_rows, combine_rows), and what MLX's "
      "transforms are doing (traced, transforming).";
  // The MLX this extension was compiled against; it links that libmlx's ABI.
  m.attr("built_with_mlx") = BUILT_WITH_MLX;
  // The names of plan's outputs, in order (kPlanOutputs): the Python side
  // checks them against mlx_moe_plan/_sizes.py's PLAN_FIELDS.
  nb::list plan_outputs;
  for (std::string_view name : mlx_moe_plan::kPlanOutputs) {
    plan_outputs.append(nb::str(name.data(), name.size()));
  }
  m.attr("plan_outputs") = nb::tuple(plan_outputs);

  // MLX marks a transform's inputs as tracers and every array made from one
  // as one too, for as long as the transform runs (array::is_tracer); its
  // Python API does not say. The GPU glue asks, to carry a launch's gradient
  // only where a transform could ask for it (mlx_moe_plan/_gpu.py).
  m.def(
      "traced",
      [](const std::vector<mlx::core::array>& arrays) {
        for (const auto& array : arrays) {
          if (array.is_tracer()) {
            return true;
          }
        }
        return false;
      },
      "arrays"_a,
      R"(Whether a running transform traces any of ``arrays``.

      ``mx.grad``, ``mx.vjp``, ``mx.jvp``, ``mx.vmap`` and ``mx.compile``
      trace their function's inputs and every array made from them while the
      function runs, and no array once its transform has returned. A yes can
      be more than that, never less: every array while a vjp's backward pass
      runs, or one flagged by a transform that has returned while another
      runs.

      Args:
          arrays (list(array)): The arrays to ask about.

      Returns:
          bool: True where one of them is traced.
      )");

  // array::is_tracer is its flag and whether a transform runs now: a probe
  // flagged a tracer answers the second alone. A placeholder, as MLX's own
  // tracers are made: no data, nothing allocated.
  m.def(
      "transforming",
      [] {
        mlx::core::array probe(mlx::core::Shape{}, mlx::core::bool_, nullptr, {});
        probe.set_tracer(true);
        return probe.is_tracer();
      },
      R"(Whether a transform (``mx.grad``, ``mx.vjp``, ``mx.jvp``, ``mx.vmap``,
      ``mx.compile``) runs now, on this thread.

      Returns:
          bool: True inside one.
      )");

  m.def(
      "plan",
      &mlx_moe_plan::plan,
      "ids"_a,
      "weights"_a.none(),
      "num_experts"_a,
      "tile_m"_a,
      "top_k"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      R"(Stable counting sort of flat int32 expert ids.

      Args:
          ids (array): Flat int32 expert ids, ``T * top_k`` of them.
          weights (array, optional): Flat float32 weights, or None.
          num_experts (int): Number of experts.
          tile_m (int): Padding multiple of each expert's rows.
          top_k (int): Entries per token.

      Returns:
          list(array): The fields named in ``plan_outputs``, in that order:
          row_tokens, row_experts, row_entries, tile_experts, positions,
          expert_counts, expert_offsets, num_rows, num_tiles, num_invalid,
          then row_weights only with weights.
      )");

  m.def(
      "gather_rows",
      &mlx_moe_plan::gather_rows,
      "src"_a,
      "index"_a,
      "inverse"_a.none(),
      "dtype"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      R"(``out[r] = src[index[r]]`` as ``dtype``; zeros where ``index[r] < 0``.

      Args:
          src (array): Rows ``[N, H]``.
          index (array): int32 ``[R]``.
          inverse (array, optional): int32 ``[N, M]``, the out rows reading
            each src row; needed for the gradient only.
          dtype (Dtype): Output dtype.

      Returns:
          array: ``[R, H]``.
      )");

  m.def(
      "combine_rows",
      &mlx_moe_plan::combine_rows,
      "src"_a,
      "index"_a,
      "weights"_a.none(),
      "inverse"_a.none(),
      "dtype"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      R"(``out[n] = sum_m weights[n, m] * src[index[n, m]]`` in float32.

      Args:
          src (array): Rows ``[R, H]``.
          index (array): int32 ``[N, M]``; negative entries add nothing.
          weights (array, optional): float32 ``[N, M]``; None means 1.
          inverse (array, optional): int32 ``[R]``, the flat entry reading
            each src row; needed for the gradient w.r.t. ``src`` only.
          dtype (Dtype): Output dtype.

      Returns:
          array: ``[N, H]``.
      )");
}
