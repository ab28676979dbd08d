"""The one warm-up and timing helper every benchmark uses, for ours and the peer's alike.

MLX is lazy: an op only records a node, and `mx.eval` runs the graph. So a
measurement builds many calls into one graph (one per model layer, each on its
own input arrays, so no call finds the previous call's data in a cache), then
times a single `mx.eval` of the whole graph and divides by the number of calls.
Launch and dispatch costs therefore count, as they do in a model's forward pass.
The Python work of building the graph is timed too: `wall_s` is build plus
eval, what a step of generation pays (it rebuilds its graph every step), the
figure for decode sizes; `eval_s` alone is the throughput of graphs built
ahead, the figure for prefill sizes, where building is a rounding error.
`profiled` marks a region for Nsight Compute, for the benchmarks that read
kernel durations (`profile_marked`: each side's calls after a marker of its
own), and `marked_kernels` reads them back from its CSV. A benchmark that
reports medians of several processes runs its own command in each, less the
options `without_options` drops.
"""

from __future__ import annotations

import collections
import csv
import ctypes
import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

try:
    import resource
except ImportError:  # absent on Windows: page faults are then not counted
    resource = None


def _page_faults() -> int:
    """Minor page faults of this process so far (0 where not available)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


@dataclass(frozen=True)
class Timing:
    """Per-call samples of one measurement, one sample per repeat."""

    eval_s: tuple[float, ...]
    """Seconds per call of `mx.eval` over the whole graph, divided by `calls`."""
    build_s: tuple[float, ...]
    """Seconds per call of Python graph building (not part of `eval_s`)."""
    wall_s: tuple[float, ...]
    """Seconds per call from the start of building to the end of the eval."""
    faults: tuple[float, ...]
    """Minor page faults per call during `mx.eval` (host memory; on a CPU,
    fresh output pages touched for the first time)."""
    calls: int
    warmup: int

    @property
    def repeats(self) -> int:
        return len(self.eval_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.eval_s)

    @property
    def min_s(self) -> float:
        return min(self.eval_s)

    @property
    def build_median_s(self) -> float:
        return statistics.median(self.build_s)

    @property
    def wall_median_s(self) -> float:
        return statistics.median(self.wall_s)


def _run_graph(call: Callable[[int], object], calls: int) -> tuple[float, float, int]:
    """Build `calls` calls into one graph, evaluate it; (build s, eval s, page faults)."""
    mx.synchronize()  # nothing queued earlier may run inside the timed region
    start = time.perf_counter()
    outputs = [call(i) for i in range(calls)]
    built = time.perf_counter()
    faults = _page_faults()
    mx.eval(outputs)
    mx.synchronize()
    done = time.perf_counter()
    faults = _page_faults() - faults
    return built - start, done - built, faults  # `outputs` is freed on return


def time_calls(
    call: Callable[[int], object],
    calls: int,
    *,
    warmup: int = 1,
    repeats: int | None = None,
    min_repeats: int = 3,
    max_repeats: int = 50,
    target_s: float = 0.5,
) -> Timing:
    """Time `call(0) ... call(calls - 1)` built into one graph, evaluated at once.

    Args:
        call (callable): `call(i)` builds call `i` on input set `i` and returns
          its outputs (an array, or a list/tuple/dict of arrays). Its inputs
          must already be evaluated.
        calls (int): Calls per graph.
        warmup (int): Untimed graph evaluations first (kernel compilation,
          allocator warm-up). Default: ``1``.
        repeats (int, optional): Timed evaluations. Default: as many as fit in
          `target_s` judged by the last warm-up, within
          `[min_repeats, max_repeats]`.
        target_s (float): Seconds of timed evaluation to aim for.

    Returns:
        Timing: per-call samples; report its median.
    """
    if calls < 1:
        raise ValueError(f"calls: must be at least 1, got {calls}")
    last = 0.0
    for _ in range(max(warmup, 1)):
        _, last, _ = _run_graph(call, calls)
    if repeats is None:
        repeats = math.ceil(target_s / max(last, 1e-9))
        repeats = min(max(repeats, min_repeats), max_repeats)
    builds, evals, walls, faults = [], [], [], []
    for _ in range(repeats):
        build_s, eval_s, fault_count = _run_graph(call, calls)
        builds.append(build_s / calls)
        evals.append(eval_s / calls)
        walls.append((build_s + eval_s) / calls)
        faults.append(fault_count / calls)
    return Timing(eval_s=tuple(evals), build_s=tuple(builds), wall_s=tuple(walls),
                  faults=tuple(faults), calls=calls, warmup=max(warmup, 1))


def profiled(marker: str, run: Callable[[], object]) -> None:
    """`run()` between cuProfilerStart and cuProfilerStop, after a kernel named
    `marker` (one thread): a profiler whose collection starts off (Nsight
    Compute's `--profile-from-start off`) records the marker, then `run`'s
    kernels, and nothing else. CUDA only."""
    kernel = mx.fast.cuda_kernel(name=marker, input_names=["a"], output_names=["out"],
                                 source="out[0] = a[0];")
    mx.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    try:
        mx.eval(kernel(inputs=[mx.ones((1,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                       output_shapes=[(1,)], output_dtypes=[mx.float32])[0])
        run()
        mx.synchronize()
    finally:
        cuda.cuProfilerStop()


# A side's calls under Nsight Compute (`profile_marked`), each evaluated alone.
NCU_CALLS = 3


def without_options(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`argv` less each of `options` and its value, given as `--name value` or
    `--name=value`."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(f"{option}=" for option in options)):
            kept.append(arg)
    return kept


def marker_name(text: str) -> str:
    """`text` as part of a kernel's name, an identifier: no "/", "-", ":"
    (qwen3-30b-a3b/q, grouped:default)."""
    return re.sub(r"\W", "_", text)


def profile_marked(marker: str, sides: dict[str, Callable[[int], object]],
                   calls: int = NCU_CALLS) -> None:
    """Each side's `calls` calls (`call(i)`, i from `calls` on, after as many
    unprofiled: compiled and warm), each evaluated alone, `profiled` after a
    marker `{marker}_{index}_{side}` (index: the side's place in `sides`),
    which it prints."""
    for index, (side, call) in enumerate(sides.items()):
        mx.eval([call(i) for i in range(calls)])
        name = f"{marker}_{index}_{marker_name(side)}"
        profiled(name, lambda: [mx.eval(call(i)) for i in range(calls, 2 * calls)])
        print(f"{name}: {side}", flush=True)


UNIT_SECONDS = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3,
                "msecond": 1e-3}


def marked_kernels(path: str, marker: str) -> list[tuple[str, collections.Counter,
                                                         collections.Counter]]:
    """Nsight Compute's CSV (gpu__time_duration.sum) of `profiled` regions:
    for each kernel whose name holds `marker`, in order, the text after the
    marker up to its arguments, and the kernels after it up to the next
    marker, by short name: microseconds and launches. Kernels before the
    first marker are not counted."""
    header, regions = None, []
    with open(path, newline="") as lines:
        for row in csv.reader(lines):
            if header is None:  # the log's lines before the table
                if "Kernel Name" in row and "Metric Value" in row:
                    header = row
                continue
            fields = dict(zip(header, row))
            if fields.get("Metric Name") != "gpu__time_duration.sum":
                continue
            name = fields["Kernel Name"]
            if marker in name:
                label = name.split(marker)[1].split("(")[0]
                regions.append((label, collections.Counter(), collections.Counter()))
            elif regions:
                short = name.split("(")[0].split("<")[0].removeprefix("void ")
                seconds = float(fields["Metric Value"].replace(",", "")) \
                    * UNIT_SECONDS[fields["Metric Unit"]]
                regions[-1][1][short] += seconds * 1e6
                regions[-1][2][short] += 1
    return regions
