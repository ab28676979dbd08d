"""What one node of an MLX graph costs, apart from its kernel's work.

    python -m benchmarks.dispatch

The plan's kernels do a few microseconds of GPU work each, so on a GPU the
plan's time per call is mostly what MLX spends per graph node: this measures
that cost for the kinds of node the plan can be built from (a custom kernel
with one or six outputs, and with 8 KiB more source text, a built-in
elementwise op, and the views: slice, reshape, as_strided), on tiny arrays,
as `benchmarks.timing` times everything (48 calls a graph, eval time only).
It guided the plan's design: one kernel, one output, and views made only when
a field is read; and kernel texts compiled without their comments
(`kernels.compact`), since MLX's CUDA backend hashes a custom kernel's whole
source each time it runs it.

With `--package`, the same for the calls a patched decoding step makes, on
tiny shapes (8 rows, 512 values, 128 experts, top 8): MLX's own (an
elementwise op, `rms_norm`, a precise softmax, `quantized_matmul` on `[8, 1,
512]` and on rows), and the package's (the router's top k, the plan, the
weighted sum, a dense projection through the grouped kernel as one expert,
compiled as `patch_model` calls it), each call's building and evaluation
apart: what a decoding step's host pays a node where its GPU work is small.
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from .timing import time_calls

# A comment line of 64 characters: source text that compiles to nothing.
_COMMENT_LINE = "// " + "x" * 60 + "\n"


def _kernel(outputs: int, comment_kib: int = 0):
    names = [f"out{i}" for i in range(outputs)]
    body = _COMMENT_LINE * (16 * comment_kib) + "if (thread_position_in_grid.x == 0) {" + "".join(
        f" {name}[0] = inp[0] + {i};" for i, name in enumerate(names)) + " }"
    name = f"dispatch_{outputs}_{comment_kib}"
    if mx.metal.is_available():
        return mx.fast.metal_kernel(name=name, input_names=["inp"], output_names=names,
                                    source=body)
    body = body.replace("thread_position_in_grid.x", "(blockIdx.x * blockDim.x + threadIdx.x)")
    return mx.fast.cuda_kernel(name=name, input_names=["inp"], output_names=names, source=body)


def cases(calls: int):
    inputs = [mx.arange(i, i + 256, dtype=mx.int32) for i in range(calls)]
    inputs = [x + 0 for x in inputs]  # made by an op: device memory on a GPU
    mx.eval(inputs)
    found = {
        "x + 1": lambda i: inputs[i] + 1,
        "slice x[8:72]": lambda i: inputs[i][8:72],
        "reshape (16, 16)": lambda i: inputs[i].reshape(16, 16),
        "as_strided (8, 8) at 8": lambda i: mx.as_strided(inputs[i], (8, 8), (8, 1), 8),
    }
    if mx.default_device().type == mx.gpu:
        for outputs, comment_kib in ((1, 0), (6, 0), (1, 8)):
            kernel = _kernel(outputs, comment_kib)
            more = f", +{comment_kib} KiB text" if comment_kib else ""
            found[f"custom kernel, {outputs} output(s){more}"] = (
                lambda i, kernel=kernel, outputs=outputs: kernel(
                    inputs=[inputs[i]], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                    output_shapes=[(64,)] * outputs, output_dtypes=[mx.int32] * outputs))
    return found


def package_cases(calls: int):
    """The calls of a patched decoding step, tiny, `calls` input sets each."""
    import functools

    import mlx.nn as nn

    from mlx_moe_plan import _compiled, moe_combine, moe_plan, projections, routing

    rows, dims, experts, top_k = 8, 512, 128, 8
    linear = nn.QuantizedLinear(dims, dims, bias=False, group_size=64, bits=4)
    one_expert = nn.QuantizedLinear(dims, dims, bias=False, group_size=64, bits=4)
    projections.take_rows(one_expert, decoding=True, expert=True)
    norm = nn.RMSNorm(dims)
    for layer in (linear, one_expert, norm):
        layer.set_dtype(mx.bfloat16)  # the scales too: the grouped kernel's rows' dtype
    steps = [mx.random.normal((rows, 1, dims)).astype(mx.bfloat16) for _ in range(calls)]
    scores = [mx.random.normal((rows, experts)).astype(mx.bfloat16) for _ in range(calls)]
    ids = [mx.argsort(mx.random.uniform(shape=(rows, experts)), axis=-1)[:, :top_k]
           .astype(mx.int32) for _ in range(calls)]
    expert_rows = [mx.random.normal((rows * top_k, dims)).astype(mx.bfloat16)
                   for _ in range(calls)]
    made = [steps, scores, ids, expert_rows]
    mx.eval(made, linear.parameters(), one_expert.parameters(), norm.parameters())
    plans = [moe_plan(ids[i], experts, weights=scores[i][:, :top_k]) for i in range(calls)]
    mx.eval([plan.row_tokens for plan in plans])
    dense_call = functools.partial(projections._one_expert, one_expert)
    return {
        "x + 1": lambda i: steps[i] + 1,
        "rms_norm": lambda i: norm(steps[i]),
        "softmax, precise": lambda i: mx.softmax(scores[i], axis=-1, precise=True),
        "quantized_matmul [8, 1, 512]": lambda i: linear(steps[i]),
        "quantized_matmul rows [8, 512]": lambda i: linear(steps[i].reshape(rows, dims)),
        "top k (routing.top_k_scores)": lambda i: routing.top_k_scores(scores[i], top_k),
        "moe_plan, one field": lambda i: moe_plan(ids[i], experts,
                                                  weights=scores[i][:, :top_k]).row_tokens,
        "moe_combine": lambda i: moe_combine(expert_rows[i], plans[i]),
        "one expert, compiled (dense=True)": lambda i: _compiled.compiled_if_small(
            one_expert, dense_call, steps[i], max_tokens=_compiled.COMPILE_MAX_TOKENS,
            key=("dispatch",)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=48,
                        help="calls in one graph (default: %(default)s)")
    parser.add_argument("--package", action="store_true",
                        help="time a patched decoding step's calls instead, on a GPU, "
                             "building and evaluation apart (default: off)")
    args = parser.parse_args(argv)
    if args.package:
        if mx.default_device().type != mx.gpu:
            raise SystemExit("--package: the package's calls run their kernels on a GPU only")
        print(f"{mx.default_device()}, mlx {mx.__version__}, {args.calls} calls a graph, "
              "median us per call: building, evaluation")
        for name, call in package_cases(args.calls).items():
            timing = time_calls(call, args.calls, warmup=2, min_repeats=10, max_repeats=100,
                                target_s=0.3)
            print(f"{name:40s} {timing.build_median_s * 1e6:8.2f} "
                  f"{timing.median_s * 1e6:8.2f}")
        return 0
    print(f"{mx.default_device()}, mlx {mx.__version__}, {args.calls} calls a graph, "
          "median eval us per call")
    for name, call in cases(args.calls).items():
        timing = time_calls(call, args.calls, warmup=2, min_repeats=20, max_repeats=200,
                            target_s=0.3)
        print(f"{name:40s} {timing.median_s * 1e6:8.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
