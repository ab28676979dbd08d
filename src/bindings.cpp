// Python bindings of the C++ primitives; binds only. The public API, with its
// argument checks, is mlx_moe_plan (Python).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "primitives.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "CPU primitives of mlx_moe_plan (plan, gather_rows, combine_rows).";
  // The MLX this extension was compiled against; it links that libmlx's ABI.
  m.attr("built_with_mlx") = BUILT_WITH_MLX;

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
          list(array): row_tokens, row_experts, [row_weights], row_entries,
          positions, expert_counts, expert_offsets, tile_experts, num_rows,
          num_tiles, num_invalid.
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
