"""Where a decoding step's or a prefill's GPU time goes: its kernels, each one's time, by name.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \\
        --csv --log-file patched.csv python -m benchmarks.step_kernels --side patched
    python -m benchmarks.step_kernels --summarize patched.csv

One side of `benchmarks.model`'s comparison (mlx-lm's model, or the patched
one on the same weights), a real configuration with random weights (bfloat16,
4-bit, group 64) and `--layers` decoder layers, decodes at each batch size
from a context of `--context` tokens: the median build and wall time of 20
steps (after 3 untimed), as a step of generation takes them. Then, on a CUDA
GPU, one more step runs between `cuProfilerStart` and `cuProfilerStop`, after
a marker kernel named for its batch (`step_marker_b32`): a profiler whose
collection starts off (Nsight Compute's `--profile-from-start off`) records
that step's kernels and nothing else, and `--summarize` splits its CSV at the
markers and sums each step's kernels by name. Nsight Compute runs the kernels
one at a time with cold caches: the sums are larger than the same kernels
take in a step, and are for comparing kernels, not for the step's time.

`--variants` compares instead: mlx-lm's model, the patched one as it is,
and the patched one under each variant of the measured rules
(`mlx_moe_plan.rules` constants, upper case) and of the grouped kernel's
tiling (`GroupedQmmTiling` fields, lower case), or with an option of
`VARIANT_OPTIONS` (`attention=sketch` or `sketch-mma`: the decoding attention
sketch of `benchmarks.decode_attention`, on CUDA; `attention=package`,
`package-step` or `package-launched`: the package's launches in its place,
through less and less of their glue; `gradients=always`: every launch in
the custom function that carries its gradient, traced or not, as before the
glue asked), their turns of 20 steps
alternated `--rounds` times at each batch, the median step of each turn,
then the median turn. A variant's compiled forwards and projection routes
are dropped when its turn starts, so each traces under its own rules.
`--interleave` interleaves the decoding steps instead, as
`benchmarks.model` does: every patched side its own patched copy of the
model (the weights shared) and every side its own copy of the context, step
i of each side in turn, the first rotating, so that drift slower than a step
hits every side alike (whole turns a side spread too much on a busy host:
benchmarks/HISTORY.md, "The decoding attention's kernels alone under Nsight
Compute"); the median step over `--rounds` rounds. Each step then enters
its side's settings, mlx-lm's too; the sketch's option also scans the
loaded modules, which its side's building counts. With
`--prefill TOKENS` each turn is one prefill of that many tokens instead, in
generate's chunks of 2048 (a rule or tiling of prefill sizes, measured on the
whole model in one process: `--layers 48`), after an untimed one of the same
chunk sizes in the same turn, which traces anew.

`--build-profile N` builds N more steps under Python's profiler, evaluating
each outside it, and prints where the building went by function, own time
first: the host's part of a step (the model's calls, the layers' rules and
launches), which the GPU waits for. With `--prefill`, N more prefills, the
chunks' evaluation in `prefill`'s own time.

`--prefill TOKENS` without `--variants` times one side's prefills instead of
its steps (the median of 3, after an untimed one: the wall time, and the
chunks' graph building in it, during which the GPU waits), and `--timeline
N` then traces N more prefills: where a prefill's GPU time goes, and how
long the GPU waits for the host while each chunk's graph is built.

`--graph` counts the operations of one more step's graph on mlx-lm's side and
the patched one, by primitive: what evaluating a step walks, which on CUDA
costs the host its encoding.

`--timeline N` runs N more steps under torch's profiler, where torch is
installed, which records every kernel's start and end on the GPU through
CUPTI, MLX's too (Nsight Systems would, where it runs), and the host's CUDA
API calls: how much of a step's evaluation the GPU is busy, each kernel's
time as the step ran it (warm caches, unlike Nsight Compute's), the GPU's
idle time before each kernel (where it waited for the host, and for which
kernel), and the host's time in each API call (where it waited for the
GPU: `cudaEventSynchronize` at a step's end).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import cProfile
import io
import pstats
import re
import statistics
import sys

import mlx.core as mx

from .decode_attention import PACKAGE_FORMS
from .model import (Sides, build_step, decode_interleaved, decode_step, decode_steps,
                    fill_context, patched_copy, prefill, progress, random_model, restore,
                    snapshot, timed_prefill, warmup_prompt)
from .timing import marked_kernels, profiled
from .workloads import MODELS, with_layers

TIMED_STEPS = 20
UNTIMED_STEPS = 3
MARKER = "step_marker_b"
RUN_RANGE = "timed run"  # torch's profiler's range around each traced step or prefill


def kernel_lines(micros: collections.Counter, launches: collections.Counter, top: int,
                 steps: int = 1) -> list[str]:
    """The `top` kernels by time, a line each: microseconds and launches a
    step (of `steps`), name."""
    return [f"  {us / steps:9.1f} us {launches[name] / steps:5.0f}x  {name}"
            for name, us in micros.most_common(top)]


def summarize(path: str, top: int) -> str:
    """Nsight Compute's CSV (gpu__time_duration.sum) as each marked step's
    kernels by total time: microseconds, launches, name."""
    out = []
    for label, micros, launches in marked_kernels(path, MARKER):
        batch = re.match(r"\d+", label).group()
        out.append(f"batch {batch}: {sum(launches.values())} kernels, "
                   f"{sum(micros.values()):.1f} us")
        out.extend(kernel_lines(micros, launches, top))
    return "\n".join(out)


def profile_builds(build, runs: int, top: int) -> str:
    """`runs` calls of `build` under cProfile: the `top` functions by own
    time. A decoding step's `build` returns its graph, evaluated outside the
    profile; a prefill evaluates each chunk inside it, in `prefill`'s own
    time. MLX's ops and `mx.eval`, C++ functions the profiler does not see,
    count in their Python callers' own time."""
    profile = cProfile.Profile()
    for _ in range(runs):
        mx.eval(profile.runcall(build))
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def graph_nodes(outputs) -> collections.Counter:
    """The operations of the graph that evaluating `outputs` walks, counted by
    primitive (`mx.export_to_dot`'s nodes; arrays already evaluated, the
    weights and the cache's buffers among them, are not operations)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, outputs)
    return collections.Counter(re.findall(r'\[label ="([^"]*)", shape=rectangle\]',
                                          dot.getvalue()))


def step_graphs(sides: dict, cache, y: mx.array, layers: int, top: int) -> str:
    """One decoding step's graph on each of `sides` (name -> model), built
    from `cache` and `y` with no block submitted (`rules.submits_block`), so
    that it is whole, then evaluated: its operations a step and a layer, and
    the `top` primitives by count. On CUDA each operation costs the host its
    encoding when the step is evaluated, beside the building."""
    from mlx_moe_plan import rules

    lines = []
    for name, side in sides.items():
        kept, rules.SUBMIT_BLOCKS_FROM_TOKENS = rules.SUBMIT_BLOCKS_FROM_TOKENS, 1 << 30
        try:
            outputs = build_step(side, cache, y)
        finally:
            rules.SUBMIT_BLOCKS_FROM_TOKENS = kept
        counts = graph_nodes(outputs)
        mx.eval(outputs)
        total = sum(counts.values())
        lines.append(f"  {name}: {total} operations a step, {total / layers:.1f} a layer; "
                     + ", ".join(f"{label} {count}" for label, count in counts.most_common(top)))
    return "\n".join(lines)


def _by_name(intervals) -> tuple[collections.Counter, collections.Counter]:
    """`(start, stop, name)` intervals as microseconds and counts by name."""
    micros, counts = collections.Counter(), collections.Counter()
    for start, stop, name in intervals:
        micros[name] += stop - start
        counts[name] += 1
    return micros, counts


def timeline(run, runs: int, top: int, unit: str = "step") -> str:
    """`runs` calls of `run` under torch's profiler, each one decoding step or
    one prefill (`unit`) returning its build and wall seconds: their median
    build and wall time, the GPU's busy time a run (the union of its kernels'
    intervals) against the evaluation's (wall less build; a prefill's build
    is its chunks' building, each before its chunk's evaluation), the
    `top` kernels by time a run, the `top` kernels by the GPU's idle time
    just before them (where the GPU waited for the host's dispatch, and for
    what), and the `top` CUDA API calls by their host time a run (what of
    the host's dispatch is the driver's: CUPTI's runtime and driver records)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function
    except ImportError:
        raise SystemExit("--timeline: torch's profiler is not installed")
    torch.cuda.init()  # the context CUPTI attaches to, which MLX's kernels share
    timed = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            with record_function(RUN_RANGE):  # where the first run starts
                timed.append(run())
    kernels, api_calls, run_starts = [], [], []
    for event in prof.events():
        interval = (event.time_range.start, event.time_range.end, event.name[:70])
        if event.name == RUN_RANGE:
            run_starts.append(event.time_range.start)
        elif not str(event.device_type).endswith("CUDA"):
            api_calls.append(interval)
        elif not event.name.startswith(("Memcpy", "Memset")):
            kernels.append(interval)
    kernels.sort()
    # The idle time before the first run's first kernel counts from that
    # run's start, as the later runs' count from the kernel before them:
    # every run's wait for its building, not all but the first's (where the
    # profiler's clocks agree that the run started first).
    first_start = min(run_starts, default=None)
    if first_start is not None and kernels and first_start > kernels[0][0]:
        first_start = None
    busy_us, end = 0.0, first_start
    idle, idle_before = collections.Counter(), collections.Counter()
    for start, stop, name in kernels:  # the union of the intervals
        if end is None or start > end:
            if end is not None:
                idle[name] += start - end
            idle_before[name] += 1
            busy_us, end = busy_us + stop - start, stop
        elif stop > end:
            busy_us, end = busy_us + stop - end, stop
    build = statistics.median(b for b, _ in timed)
    wall = statistics.median(w for _, w in timed)
    busy_ms = busy_us / 1e3 / runs
    lines = [f"  traced: wall {wall * 1e3:.3f} ms, build {build * 1e3:.3f} ms, the GPU busy "
             f"{busy_ms:.3f} ms a {unit} ({busy_ms / ((wall - build) * 1e3):.0%} of the "
             f"evaluation), {len(kernels) / runs:.0f} kernels a {unit}"]
    micros, launches = _by_name(kernels)
    api_micros, api_count = _by_name(api_calls)
    return "\n".join(
        lines + kernel_lines(micros, launches, top, runs)
        + [f"  GPU idle before a kernel, {sum(idle.values()) / runs / 1e3:.3f} ms a {unit}:"]
        + kernel_lines(idle, idle_before, top, runs)
        + [f"  CUDA API calls, {sum(api_micros.values()) / runs / 1e3:.3f} ms a {unit}:"]
        + kernel_lines(api_micros, api_count, top, runs))


def time_prefills(side, config: dict, args, cuda: bool) -> str:
    """`side`'s prefill of `args.prefill` tokens in generate's chunks: the
    median wall and build time of 3 (after an untimed one of the same chunk
    sizes; the build is the chunks' graph building, which the GPU waits
    for), then `args.build_profile` more under cProfile (`profile_builds`)
    and on a CUDA GPU `args.timeline` more under torch's profiler
    (`timeline`)."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.random.randint(0, config["vocab_size"], (1, args.prefill))
    prefill(side, warmup_prompt(prompt), make_prompt_cache(side))

    def timed() -> tuple[float, float]:
        builds = []
        seconds = timed_prefill(side, prompt, builds)[0]
        return sum(builds), seconds

    runs = [timed() for _ in range(3)]
    lines = [f"{args.models} {args.layers} layers, {args.side}, prefill {args.prefill}: "
             f"wall {statistics.median(w for _, w in runs) * 1e3:.3f} ms, "
             f"build {statistics.median(b for b, _ in runs) * 1e3:.3f} ms"]
    if args.build_profile:
        lines.append(profile_builds(lambda: timed_prefill(side, prompt)[1],
                                    args.build_profile, args.top))
    if args.timeline and cuda:
        lines.append(timeline(timed, args.timeline, args.top, "prefill"))
    return "\n".join(lines)


# `--variants`' settings that are neither rules nor tiling, and what each
# value means: `attention`, the form of benchmarks.decode_attention's sketch,
# or of the package's launches in its place, that `sketch_in_models` puts in
# the side's turns; `gradients=always`, the side's launches each in the
# custom function that carries its gradient, whether a transform could
# differentiate it or not (`_gpu.carries_gradients` answering yes).
VARIANT_OPTIONS = {"attention": {"sketch": "cores", "sketch-mma": "mma",
                                  **{form: form for form in PACKAGE_FORMS}},
                   "gradients": {"always": "always"}}


def parse_variants(text: str) -> dict[str, tuple[dict, dict, dict]]:
    """`name:KEY=VALUE,key=VALUE;...` as {name: (rules' constants, tiling
    fields, VARIANT_OPTIONS' settings)}."""
    from mlx_moe_plan import rules
    from mlx_moe_plan.kernels import launch

    variants = {}
    for entry in filter(None, text.split(";")):
        name, _, settings = entry.partition(":")
        constants, tiling, options = {}, {}, {}
        for setting in filter(None, settings.split(",")):
            key, _, value = setting.partition("=")
            if key.isupper() and isinstance(getattr(rules, key, None), int):
                constants[key] = int(value)
            elif key in launch.GroupedQmmTiling.__dataclass_fields__:
                tiling[key] = int(value)
            elif value in VARIANT_OPTIONS.get(key, ()):
                options[key] = value
            else:
                raise SystemExit(f"--variants: {key!r} is neither an int constant of "
                                 f"mlx_moe_plan.rules nor a GroupedQmmTiling field nor one of "
                                 f"{VARIANT_OPTIONS}")
        if name.strip() in ("mlx-lm", "patched"):
            raise SystemExit(f"--variants: {name.strip()!r} is the name of a side every "
                             f"comparison has")
        variants[name.strip()] = constants, tiling, options
    return variants


@contextlib.contextmanager
def gradients_always():
    """Within the block, the GPU glue makes every launch in the custom
    function that carries its gradient, as it did before it asked whether a
    transform could differentiate the launch (`_gpu._when_traced`): what
    those graph nodes and calls cost a step, beside the glue as it is. A
    compiled forward traced in the block keeps them in its tape."""
    from mlx_moe_plan import _gpu

    carries_gradients, _gpu.carries_gradients = _gpu.carries_gradients, lambda arrays: True
    try:
        yield
    finally:
        _gpu.carries_gradients = carries_gradients


@contextlib.contextmanager
def _settings(constants: dict, tiling: dict, options: dict, defaults: dict):
    """Within the block, a side's rules' constants (`defaults` for those it
    leaves), the grouped kernel's tiling and `VARIANT_OPTIONS`' settings."""
    from mlx_moe_plan import rules
    from mlx_moe_plan.kernels import launch

    kept = {key: getattr(rules, key) for key in defaults}
    for key, value in defaults.items():
        setattr(rules, key, constants.get(key, value))
    try:
        attention = contextlib.nullcontext()
        if "attention" in options:
            from .decode_attention import sketch_in_models
            attention = sketch_in_models(VARIANT_OPTIONS["attention"][options["attention"]])
        gradients = gradients_always() if "gradients" in options else contextlib.nullcontext()
        with launch.grouped_qmm_tiling(**tiling), attention, gradients:
            yield
    finally:
        for key, value in kept.items():
            setattr(rules, key, value)


class _OwnSide:
    """A side of `--interleave`, called as `decode_step` calls a model: a
    patched side's own patched copy of `model` (the weights shared), or with
    `patch=False` mlx-lm's model itself, each call under the side's settings
    and with the traces its layers share kept apart from the other sides'
    (`_compiled`'s, keyed by the layers' shapes, not by the rules a trace was
    made under). mlx-lm's side takes the same steps around its calls, so that
    their host time counts on every side alike."""

    def __init__(self, model, settings: tuple[dict, dict, dict], defaults: dict,
                 patch: bool = True):
        self.settings, self.defaults, self.traces = settings, defaults, {}
        with _settings(*settings, defaults):  # what the patch asks the rules at patch time
            self.model = patched_copy(model, tile_m=None, no_compile=False)[0] if patch \
                else model

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        from mlx_moe_plan import _compiled

        with _compiled.shared_traces_in(self.traces), _settings(*self.settings, self.defaults):
            return self.model(inputs, cache=cache)


def interleave_variants(model, patched, config: dict, args) -> str:
    """mlx-lm's model, and one patched anew as it is and under each of
    `args.variants`, each decoding its own copy of the same context (which
    `patched` fills), their steps interleaved one by one
    (`benchmarks.model.decode_interleaved`, the first side rotating from step
    to step), `args.rounds` rounds of 20 steps a side from that context: each
    side's median step over all rounds, and each round's, a batch."""
    from mlx_moe_plan import rules

    variants = {"patched": ({}, {}, {}), **parse_variants(args.variants)}
    defaults = {key: getattr(rules, key) for constants, _, _ in variants.values()
                for key in constants}
    lines = [f"{args.models}, {args.layers} layers: {args.rounds} rounds of {TIMED_STEPS} "
             f"steps a side from a context of {args.context}, the sides' steps interleaved; "
             f"wall ms, build ms (a decoding step's median), speedup over mlx-lm"]
    own = {name: _OwnSide(model, settings, defaults) for name, settings in variants.items()}
    sides = Sides(_OwnSide(model, ({}, {}, {}), defaults, patch=False), own.pop("patched"),
                  patched_sides=own)
    for batch in (int(b) for b in args.batches.split(",")):
        case = f"batch {batch}"
        cache, first = fill_context(patched, batch, args.context, config["vocab_size"],
                                    args.batch_cache)
        saved = snapshot(cache)
        # each side a cache of the filled one's kind (a batch cache's too)
        caches = {name: [copy.copy(layer) for layer in cache] for name in sides.models}
        samples = {name: ([], [], []) for name in sides.models}
        for round_ in range(args.rounds):
            for side_cache in caches.values():
                restore(side_cache, saved)
            stepped = decode_interleaved(sides, caches, first, TIMED_STEPS, UNTIMED_STEPS,
                                         round_, case)
            for name, (builds, walls, _) in stepped.items():
                samples[name][0].extend(builds)
                samples[name][1].extend(walls)
                samples[name][2].append(statistics.median(walls))
            progress(f"{case}, round {round_ + 1}: " + ", ".join(
                f"{name} {statistics.median(walls) * 1e3:.2f} ms"
                for name, (_, walls, _) in stepped.items()))
        reference = statistics.median(samples["mlx-lm"][1]) if samples["mlx-lm"][1] else None
        for name, (builds, walls, rounds) in samples.items():
            if not walls:
                lines.append(f"{case:<9} {name:<12} failed: {sides.failure}")
                continue
            lines.append(_side_line(case, name, statistics.median(walls),
                                    statistics.median(builds), reference, "rounds", rounds))
    return "\n".join(lines)


def _side_line(case: str, name: str, wall: float, build: float, reference: float | None,
               parts: str, part_walls) -> str:
    """A side's line of a comparison: its median wall and build ms, its
    speedup over mlx-lm's `reference` wall (none where mlx-lm's side failed),
    and the wall of each of its turns or rounds (`parts`)."""
    speedup = f"{reference / wall:5.2f}x" if reference else "    -"
    return (f"{case:<9} {name:<12} wall {wall * 1e3:8.3f}  build {build * 1e3:7.3f}  "
            f"{speedup}  {parts} " + " ".join(f"{w * 1e3:.2f}" for w in part_walls))


def compare_variants(model, patched, config: dict, args) -> str:
    """mlx-lm's model, the patched one, and the patched one under each of
    `args.variants`, turns alternated (the order reversed every other round):
    each side's median step of each turn, and the median turn, a batch; with
    `args.prefill`, each turn one prefill of that many tokens instead (in
    generate's chunks, after an untimed one of its chunk sizes in the turn)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_moe_plan import _compiled, projections, rules

    sides = {"mlx-lm": (model, {}, {}, {}), "patched": (patched, {}, {}, {}),
             **{name: (patched, *changes) for name, changes in
                parse_variants(args.variants).items()}}
    defaults = {key: getattr(rules, key) for _, constants, _, _ in sides.values()
                for key in constants}

    def turn(name: str, run):
        """`run(side)` with the side's rules, tiling, options and traces of its own."""
        side, constants, tiling, options = sides[name]
        with _settings(constants, tiling, options, defaults):
            _compiled.forget(patched)  # another side's traces and routes
            projections.read_floors(patched)  # the dense rules' floors, of this side's rules
            return run(side)

    what = (f"one prefill of {args.prefill} tokens" if args.prefill
            else f"{TIMED_STEPS} steps from a context of {args.context}")
    lines = [f"{args.models}, {args.layers} layers: the median of {args.rounds} turns of "
             f"{what}; wall ms, build ms (a decoding step's), speedup over mlx-lm"]
    cases = [f"prefill {args.prefill}"] if args.prefill else \
        [f"batch {b}" for b in args.batches.split(",")]
    try:
        for case in cases:
            if args.prefill:
                prompt = mx.random.randint(0, config["vocab_size"], (1, args.prefill))

                def run(side, prompt=prompt):
                    # Untimed, the chunks' sizes first: the side's traces, which
                    # its turn dropped, and on a fresh machine MLX's kernels.
                    prefill(side, warmup_prompt(prompt), make_prompt_cache(side))
                    seconds = timed_prefill(side, prompt)[0]
                    mx.clear_cache()  # the turn's cache, back to MLX before the next turn's
                    return [0.0], [seconds]
            else:
                cache, y = fill_context(patched, int(case.split()[1]), args.context,
                                        config["vocab_size"], args.batch_cache)

                def run(side, cache=cache, y=y):
                    return decode_steps(side, cache, y, TIMED_STEPS, UNTIMED_STEPS)[:2]
            turns = {name: [] for name in sides}
            for round_ in range(args.rounds):
                for name in (list(sides) if round_ % 2 == 0 else list(reversed(sides))):
                    builds, walls = turn(name, run)
                    turns[name].append((statistics.median(walls), statistics.median(builds)))
                    progress(f"{case}, round {round_ + 1}: {name} "
                             f"{statistics.median(walls) * 1e3:.2f} ms")
            reference = statistics.median(wall for wall, _ in turns["mlx-lm"])
            for name, measured in turns.items():
                lines.append(_side_line(case, name, statistics.median(w for w, _ in measured),
                                        statistics.median(b for _, b in measured), reference,
                                        "turns", [w for w, _ in measured]))
    finally:
        _compiled.forget(patched)
        projections.read_floors(patched)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--summarize", metavar="CSV", help="summarize Nsight Compute's CSV "
                        "instead of running (default: none)")
    parser.add_argument("--top", type=int, default=14,
                        help="kernels a step in the summary (default: %(default)s)")
    parser.add_argument("--side", choices=("mlx-lm", "patched"), default="patched",
                        help="the model run (default: %(default)s)")
    parser.add_argument("--models", default="qwen3-30b-a3b",
                        help=f"one of {', '.join(MODELS)} (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8,
                        help="decoder layers (default: %(default)s)")
    parser.add_argument("--batches", default="1,4,32",
                        help="comma list of batch sizes (default: %(default)s)")
    parser.add_argument("--context", type=int, default=512,
                        help="tokens in the cache (default: %(default)s)")
    parser.add_argument("--batch-cache", action="store_true",
                        help="decode from mlx-lm's batch caches, as its batch generation "
                             "and server do: prompts of up to 48 tokens fewer, left-padded, "
                             "a mask every step (default: one cache of equal prompts)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="activations and unquantized weights (default: %(default)s)")
    parser.add_argument("--build-profile", type=int, default=0, metavar="N",
                        help="profile N more steps a batch by Python function, own time "
                             "(default: %(default)s, none)")
    parser.add_argument("--graph", action="store_true",
                        help="count the operations of one step's graph, mlx-lm's and the "
                             "patched model's, by primitive (default: off)")
    parser.add_argument("--timeline", type=int, default=0, metavar="N",
                        help="run N more steps a batch under torch's profiler: the GPU's "
                             "busy time against the evaluation's (default: %(default)s, none)")
    parser.add_argument("--variants", metavar="NAME:KEY=V,...;...",
                        help="compare mlx-lm's model, the patched one and the patched one "
                             "under these rule constants and tiling fields, alternated, "
                             "instead of one side (default: none)")
    parser.add_argument("--interleave", action="store_true",
                        help="with --variants, decoding: each patched side its own copy of "
                             "the model and every side its own cache, their steps "
                             "interleaved one by one, not in turns (default: turns)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="turns of each side a batch with --variants, or rounds of "
                             "interleaved steps with --interleave (default: %(default)s)")
    parser.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                        help="prefills of this many tokens, in generate's chunks, instead "
                             "of decoding steps: with --variants one a turn, else 3 of "
                             "--side and --timeline's (default: %(default)s, decoding)")
    args = parser.parse_args(argv)
    if args.interleave and (args.variants is None or args.prefill):
        parser.error("--interleave: decoding steps' --variants only")
    if args.summarize:
        print(summarize(args.summarize, args.top))
        return 0
    config = with_layers(MODELS[args.models], args.layers)
    model, _ = random_model(config, dtype=getattr(mx, args.dtype), bits=4, group_size=64)
    patched, _ = patched_copy(model, tile_m=None, no_compile=False)
    progress(f"built {args.models} with {args.layers} layers, and its patched copy")
    if args.variants is not None:
        compare = interleave_variants(model, patched, config, args) if args.interleave else \
            compare_variants(model, patched, config, args)
        print(compare, flush=True)
        return 0
    side = patched if args.side == "patched" else model
    cuda = mx.default_device().type == mx.gpu and mx.cuda.is_available()
    if args.prefill:
        print(time_prefills(side, config, args, cuda), flush=True)
        return 0
    for batch in (int(b) for b in args.batches.split(",")):
        cache, y = fill_context(patched, batch, args.context, config["vocab_size"],
                                args.batch_cache)
        builds, walls, _ = decode_steps(side, cache, y, TIMED_STEPS, UNTIMED_STEPS)
        print(f"{args.models} {args.layers} layers, {args.side}, batch {batch}: "
              f"wall {statistics.median(walls) * 1e3:.3f} ms, "
              f"build {statistics.median(builds) * 1e3:.3f} ms", flush=True)
        if cuda:  # one step more, from the cache as the timed ones left it
            profiled(f"{MARKER}{batch}", lambda: decode_step(side, cache, y))
        if args.graph:
            print(f"one step's graph, batch {batch}:\n"
                  + step_graphs({"mlx-lm": model, "patched": patched}, cache, y, args.layers,
                                args.top), flush=True)
        if args.build_profile:
            steps = {"y": y}  # each step decodes the token the one before chose

            def build_next(steps=steps, cache=cache):
                steps["y"], logits = build_step(side, cache, steps["y"])
                return steps["y"], logits

            print(profile_builds(build_next, args.build_profile, args.top), flush=True)
        if args.timeline and cuda:
            print(timeline(lambda: decode_step(side, cache, y)[2:], args.timeline, args.top),
                  flush=True)
    if not cuda:
        print("no CUDA device: no step was profiled", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
