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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=48,
                        help="calls in one graph (default: %(default)s)")
    args = parser.parse_args(argv)
    print(f"{mx.default_device()}, mlx {mx.__version__}, {args.calls} calls a graph, "
          "median eval us per call")
    for name, call in cases(args.calls).items():
        timing = time_calls(call, args.calls, warmup=2, min_repeats=20, max_repeats=200,
                            target_s=0.3)
        print(f"{name:40s} {timing.median_s * 1e6:8.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
