"""Whole-model tokens/s, patched against mlx-lm, as mlx-lm's generate runs a model.

    python -m benchmarks.model                          # GPU: Qwen3-30B-A3B
                                                        # CPU: the ops, then a small model
    python -m benchmarks.model --models gpt-oss-20b,qwen3-30b-a3b --processes 3
    python -m benchmarks.model --models deepseek-v3 --layers 4 --json out.json
    python -m benchmarks.model --model PATH             # an mlx-lm model directory on disk

A model of a real configuration (`benchmarks/workloads.py`) with random
weights, bfloat16 and 4-bit (group 64, mlx-lm's `quantize_model`), or one
loaded from disk, runs twice in one process: unpatched (mlx-lm) and patched
(`patch_model`) on the same weight arrays. Measured as mlx-lm's `generate`
and server run it:

- prefill: the prompt in chunks of 2048 tokens into a KV cache, the cache
  evaluated after each chunk, then the last token's logits (tokens/s);
- decode: at each batch size, from a context already in the cache, one step
  at a time: build the step's graph (the model on one token a sequence, the
  greedy next token), evaluate it, and take the wall time of both; the build
  time is reported beside it. `pipelined` is generate's own loop, which builds
  step n+1 while step n runs (`mx.async_eval`): host time then hides behind
  GPU time where the GPU is the longer. Its steps overlap, so each side runs
  it in a turn of its own, and its ratios scatter more than the interleaved
  one-eval ones (on the H200, up to 10% between two identical models:
  `--control` shows a run's spread).

The sides alternate so that drift hits both, and the figures are medians:
prefill, each side in turn, `--rounds` times; decode, at each batch size
`--decode-rounds` times from the same context, the sides' one-eval steps
interleaved one by one (with `--control`, another side: an unpatched copy of
mlx-lm's model; with `--variant-tile-m M`, another: the model patched with
`tile_m=M`, a formulation weighed against the rule's in the same run; with
`--variant-no-dense-rows`, the model patched without dense rows; with
`--variant-no-dense`, patched with `dense=False`; with `--variant-no-submit`,
patched with `submit=False`), then generate's loop a turn a side.
`--no-dense` patches with `dense=False` (dense projections by MLX's GEMM,
not by the grouped kernel where its rules say so: a decoding batch's, and a
prefill's lm_head, where the last chunk's logits are computed); `--no-submit`
with `submit=False` (a decoding step evaluated once it is built whole).
`--processes N`
runs the whole benchmark in N processes and reports the median of their
figures and the lowest ratio; `--warm-process` runs a short untimed one
first, in which a fresh CUDA machine compiles MLX's kernels. The logits of
both sides are compared (relative L2 difference, float32); with
`--float32-logits`, the prefill's logits of each side also against those of
a float32 run of the same weights (mlx-lm's model, its floating arrays in
float32, its quantized ones shared), untimed. Progress goes to
stderr; the table to stdout; `--json` writes every figure.

On a CPU the run starts with the ops (`--ops`): `benchmarks.moe` at two
models' shapes, at a decode step's and a prefill's T, checked against the
reference before it times them. A CPU's whole-model ratios stay near 1.00x
(`CPU_NOTE`, printed after the tables): the ops are where a CPU shows what the
package does.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .timing import without_options
from .workloads import DEFAULT_LAYERS, MODELS, with_layers

PREFILL_STEP = 2048  # mlx-lm's generate and server prefill in chunks of this many tokens
BATCHES = (1, 4, 8, 16, 32, 64)
DEFAULTS = {  # device type -> (models, prompt tokens, batches, context tokens, dtype, steps)
    "gpu": (["qwen3-30b-a3b"], 8192, BATCHES, 512, "bfloat16", 10),
    # A CPU computes bfloat16 by conversion to float32, several times slower;
    # fewer steps keep the whole run near a minute.
    "cpu": (["small-qwen3-moe"], 512, BATCHES, 128, "float32", 5),
}
# The ops a CPU run starts with (`benchmarks.moe`'s arguments): two models'
# shapes at their own hidden size, T of a decode batch and of a prompt; about
# 30 s on two cores, the whole run under 3 minutes.
CPU_OPS_ARGS = ["--shapes", "qwen3-30b-a3b,mixtral", "--tokens", "64,512", "--hidden", "model",
                "--no-progress"]
CPU_NOTE = (
    "On a CPU the whole model runs at about 1.00x of mlx-lm: the patched layers run "
    "mlx-lm's own call below 64 routed entries and the same MLX GEMMs on sorted rows above, "
    "and those GEMMs and attention take nearly all of a step, so what the package changes "
    "there is the ops' time (plan, gather, combine, unsort: `python -m benchmarks.moe`, the "
    "first table of a default CPU run).")


def default_by_device(gpu, cpu) -> str:
    """A help text's default that depends on the device: "(default: GPU on a
    GPU, CPU on a CPU)", lists written comma-separated as the options take them."""
    def text(value) -> str:
        return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)

    return f"(default: {text(gpu)} on a GPU, {text(cpu)} on a CPU)"


def add_quantization_arguments(parser: argparse.ArgumentParser) -> None:
    """--bits and --group-size of the models a benchmark builds (mlx-lm's
    quantize_model's), the same in every benchmark that builds one."""
    parser.add_argument("--bits", type=int, default=4,
                        help="0: no quantization (default: %(default)s)")
    parser.add_argument("--group-size", type=int, default=64,
                        help="quantization group size (default: %(default)s)")


# --layers' default where a benchmark builds a configuration (with_layers).
DEFAULT_LAYERS_HELP = "(default: all; " + ", ".join(
    f"{name} {layers}" for name, layers in DEFAULT_LAYERS.items()) + ")"


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the models


def model_module(config: dict):
    """mlx-lm's module of `config`'s model type."""
    return importlib.import_module(f"mlx_lm.models.{config['model_type']}")


def random_model(config: dict, *, dtype: mx.Dtype, bits: int | None, group_size: int,
                 seed: int = 0) -> tuple[nn.Module, dict]:
    """mlx-lm's model of `config` with its own random initialization, in `dtype`,
    quantized to `bits` by mlx-lm's `quantize_model` (None: not quantized),
    evaluated a layer at a time so that only one layer's float32 weights exist
    at once. Returns the model and its configuration as mlx-lm saves it (with
    its `quantization` entry)."""
    from mlx_lm.utils import quantize_model

    module = model_module(config)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    if bits:
        with contextlib.redirect_stdout(sys.stderr):  # it prints its bits per weight
            model, config = quantize_model(model, config, group_size=group_size, bits=bits)
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model, config


def shared_copy(module: nn.Module) -> nn.Module:
    """A copy of `module`'s tree of modules holding the same arrays.

    Patching the copy swaps modules in the copy only: the original stays
    mlx-lm's, and no weight is stored twice, but for the projections a
    patch joins on CUDA (`projections.Siblings`), whose stacked arrays are
    the copy's own."""
    new = copy.copy(module)
    for key, value in module.items():
        new[key] = _shared_value(value)
    return new


def _shared_value(value):
    if isinstance(value, nn.Module):
        return shared_copy(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_shared_value(v) for v in value)
    if isinstance(value, dict):
        return {k: _shared_value(v) for k, v in value.items()}
    return value


def set_our_layers(model: nn.Module, **attributes) -> None:
    """Set `attributes` (`compile_max_tokens`, ...) on every one of our layers in `model`."""
    from mlx_moe_plan.nn import SwitchGLU

    for _, layer in model.named_modules():
        if isinstance(layer, SwitchGLU):
            for name, value in attributes.items():
                setattr(layer, name, value)


def patched_copy(model: nn.Module, tile_m: int | None, no_compile: bool,
                 dense_rows: bool = True, dense: bool = True, submit: bool = True):
    """A copy of `model` sharing its weights, patched with `tile_m`,
    `dense_rows`, `dense` and `submit` (never compiled with `no_compile`),
    and how many layers were patched."""
    from mlx_moe_plan.nn import patch_model

    patched = shared_copy(model)
    replaced = patch_model(patched, tile_m=tile_m, dense_rows=dense_rows, dense=dense,
                           submit=submit)
    if no_compile:
        set_our_layers(patched, compile_max_tokens=0)
    return patched, replaced


def load_pair(args) -> tuple[str, nn.Module, nn.Module, dict]:
    """(name, mlx-lm's model, the patched one, description) for one benchmark."""
    if args.model:
        from mlx_lm.utils import load_model

        progress(f"loading {args.model}")
        model, config = load_model(Path(args.model))
        name = Path(args.model).name
        describe = {"path": str(args.model), "model_type": config.get("model_type")}
    else:
        name = args.current
        layers = args.layers or DEFAULT_LAYERS.get(name)
        config = with_layers(MODELS[name], layers)
        progress(f"building {name} ({config['num_hidden_layers']} layers, random weights, "
                 f"{args.dtype}, {args.bits or 'no'}-bit)")
        model, _ = random_model(config, dtype=getattr(mx, args.dtype), bits=args.bits,
                                group_size=args.group_size)
        describe = {"config": config, "dtype": args.dtype, "bits": args.bits,
                    "group_size": args.group_size}
    patched, replaced = patched_copy(model, args.tile_m, args.no_compile, args.dense_rows,
                                     args.dense, args.submit)
    describe["patched_layers"] = replaced
    describe["dense_rows"] = args.dense_rows
    describe["dense"] = args.dense
    describe["submit"] = args.submit
    describe["weights_gb"] = sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e9
    progress(f"patched {replaced} MoE layers; weights {describe['weights_gb']:.1f} GB")
    return name, model, patched, describe


# ---------------------------------------------------------------- measurements


def relative_difference(got: mx.array, want: mx.array) -> float:
    """||got - want|| / ||want|| in float32."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return float(mx.linalg.norm(got - want) / mx.linalg.norm(want))


def prefill(model, prompt: mx.array, cache, builds: list[float] | None = None) -> mx.array:
    """mlx-lm's generate: chunks, the cache evaluated after each, then the
    last token's logits. Returns the last token's logits, evaluated. With
    `builds`, each call's graph-building seconds are appended to it: the
    host's part, during which the GPU waits (the chunk before is evaluated)."""
    def built(call):
        start = time.perf_counter()
        out = call()
        if builds is not None:
            builds.append(time.perf_counter() - start)
        return out

    while prompt.shape[1] > 1:
        step = min(PREFILL_STEP, prompt.shape[1] - 1)
        built(lambda: model(prompt[:, :step], cache=cache))
        mx.eval([c.state for c in cache])
        prompt = prompt[:, step:]
    logits = built(lambda: model(prompt, cache=cache)[:, -1, :])
    mx.eval(logits)
    return logits


def warmup_prompt(prompt: mx.array) -> mx.array:
    """The start of `prompt` whose `prefill` chunks have the sizes of the whole
    prompt's: run untimed first, it keeps MLX's kernel compilation (minutes on
    a fresh CUDA machine) out of the timed prefill."""
    tokens = prompt.shape[1]
    return prompt[:, : min(tokens, PREFILL_STEP + (tokens - 1) % PREFILL_STEP + 1)]


class Sides:
    """mlx-lm's model and the patched one, and optionally a control (an
    unpatched copy of mlx-lm's), a variant (the model patched with another
    `tile_m`) and more patched sides by name (`patched_sides`), taking turns.

    Each round runs every side, the first rotating from round to round, so
    that drift hits all of them. MLX's CUDA backend can fail to launch mlx-lm's
    graphs (`cuGraphAddKernelNode ... invalid argument`, sorted `gather_qmm`
    over many rows): mlx-lm's sides (its model and the control) are then
    dropped and `failure` says why; a failure of a patched side is raised.
    """

    PATCHED = ("patched", "variant")
    EXTRA = ("control", "variant")  # the optional sides, each compared with mlx-lm's

    def __init__(self, model, patched, control=None, variant=None,
                 patched_sides: dict | None = None):
        self.models = {"mlx-lm": model, "patched": patched}
        if control is not None:
            self.models["control"] = control
        if variant is not None:
            self.models["variant"] = variant
        self.models.update(patched_sides or {})
        self.patched = {*self.PATCHED, *(patched_sides or {})}
        self.failure: str | None = None

    def turns(self, rounds: int, start: int = 0):
        """(side, model) for each turn of `rounds` rounds, numbered from `start`."""
        names = list(self.models)
        for r in range(start, start + rounds):
            shift = r % len(names)
            for side in names[shift:] + names[:shift]:
                if side not in self.patched and self.failure:
                    continue
                yield side, self.models[side]

    def attempt(self, side: str, what: str, run):
        """`run()`, or None if it is one of mlx-lm's sides and MLX failed to launch it."""
        try:
            return run()
        except RuntimeError as error:
            if side in self.patched:
                raise
            self.failure = f"{type(error).__name__}: {error}"
            progress(f"  {what}, mlx-lm: {self.failure}")
            return None


def timed_prefill(model, prompt: mx.array,
                  builds: list[float] | None = None) -> tuple[float, mx.array]:
    """Wall seconds of `prefill` of `prompt` into a new KV cache, and its
    logits; with `builds`, `prefill`'s."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.synchronize()
    start = time.perf_counter()
    logits = prefill(model, prompt, cache, builds)
    return time.perf_counter() - start, logits


def float32_copy(model: nn.Module) -> nn.Module:
    """`model` (mlx-lm's, unpatched) with its floating arrays (scales,
    biases, norms) cast to float32 and its quantized ones shared: a float32
    run of the same weights, against which each side's bfloat16 logits are
    measured."""
    reference = shared_copy(model)
    reference.set_dtype(mx.float32)  # floating arrays only: the copy's, not the model's
    return reference


def measure_prefill(model, patched, tokens: int, rounds: int, vocab: int,
                    float32: bool = False) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.random.randint(0, vocab, (1, tokens))
    sides = Sides(model, patched)
    times = {"mlx-lm": [], "patched": []}
    logits = {}
    warm = warmup_prompt(prompt)
    for side, m in sides.turns(1):
        sides.attempt(side, "prefill", lambda: prefill(m, warm, make_prompt_cache(m)))
    progress(f"  warmed up on {warm.shape[1]} tokens")
    for side, m in sides.turns(rounds):
        result = sides.attempt(side, "prefill", lambda: timed_prefill(m, prompt))
        if result is None:
            continue
        seconds, logits[side] = result
        times[side].append(seconds)
        progress(f"  prefill {tokens} tokens, {side}: {seconds * 1e3:.1f} ms")
        mx.clear_cache()  # the turn's cache, freed, back to MLX before the next turn's
    row = {"tokens": tokens}
    for side, samples in times.items():
        row[f"{side}_ms"] = statistics.median(samples) * 1e3 if samples else None
        row[f"{side}_tokens_per_s"] = tokens / statistics.median(samples) if samples else None
    row["mlx-lm_error"] = sides.failure
    row["speedup"] = (row["mlx-lm_ms"] / row["patched_ms"]) if row["mlx-lm_ms"] else None
    row["logits_rel_diff"] = relative_difference(logits["patched"], logits["mlx-lm"]) \
        if "mlx-lm" in logits else None
    if float32:
        reference = float32_copy(model)
        want = prefill(reference, prompt, make_prompt_cache(reference))
        del reference
        mx.clear_cache()
        for side in times:
            row[f"{side}_float32_rel_diff"] = relative_difference(logits[side], want) \
                if side in logits else None
        progress(f"  {_against_float32(row)}")
    return row


def _fresh(value):
    """A new handle of each array in `value`: decoding overwrites a cache's
    arrays in place (slice assignment), which must not reach a snapshot."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(v) for v in value)
    return value


def snapshot(cache) -> list[dict]:
    return [{k: _fresh(v) for k, v in c.__dict__.items()} for c in cache]


def restore(cache, saved: list[dict]) -> None:
    for c, state in zip(cache, saved):
        c.__dict__.update({k: _fresh(v) for k, v in state.items()})


def build_step(model, cache, y: mx.array) -> tuple[mx.array, mx.array]:
    """A step's graph, unevaluated: the next token (greedy) and the logits."""
    logits = model(y, cache=cache)[:, -1, :]
    return mx.argmax(logits, axis=-1)[:, None], logits


def decode_step(model, cache, y: mx.array) -> tuple[mx.array, mx.array, float, float]:
    """One step, one eval: the next token, the logits, and the build and wall seconds."""
    start = time.perf_counter()
    next_y, logits = build_step(model, cache, y)
    built = time.perf_counter()
    mx.eval(next_y, logits)  # the logits are computed for the token anyway
    return next_y, logits, built - start, time.perf_counter() - start


def decode_steps(model, cache, first: mx.array, steps: int, warmup: int):
    """One side's steps, one eval a step: (build s, wall s) of each timed step,
    and the first step's logits."""
    y, builds, walls, first_logits = first, [], [], None
    for i in range(warmup + steps):
        y, logits, build_s, wall_s = decode_step(model, cache, y)
        if i == 0:
            first_logits = logits
        if i >= warmup:
            builds.append(build_s)
            walls.append(wall_s)
    return builds, walls, first_logits


def decode_interleaved(sides: "Sides", caches: dict, first: mx.array, steps: int,
                       warmup: int, start: int, what: str) -> dict:
    """One eval a step, the sides' steps interleaved: step i of each side in
    turn, the first side rotating from step to step (from `start`), each side
    decoding its own cache. Drift slower than a step then hits every side
    alike: with whole turns of steps a side, single processes of identical
    kernels scattered from 0.77x to 1.35x (benchmarks/HISTORY.md, "The grouped
    kernel in the rule").

    Returns:
        dict: side -> (build s of each timed step, wall s of each, the first
        step's logits), for the sides that ran.
    """
    ys = {side: first for side in caches}
    builds = {side: [] for side in caches}
    walls = {side: [] for side in caches}
    first_logits = {}
    for i in range(warmup + steps):
        for side, model in sides.turns(1, start=start + i):
            if side not in ys:
                continue
            stepped = sides.attempt(side, what,
                                    lambda: decode_step(model, caches[side], ys[side]))
            if stepped is None:  # mlx-lm's graph failed to launch: the side is dropped
                del ys[side]
                continue
            ys[side], logits, build_s, wall_s = stepped
            first_logits.setdefault(side, logits)
            if i >= warmup:
                builds[side].append(build_s)
                walls[side].append(wall_s)
    return {side: (builds[side], walls[side], first_logits[side])
            for side in ys if side in first_logits}


def decode_pipelined(model, cache, first: mx.array, steps: int) -> float:
    """mlx-lm's generate loop: step n+1 is built and queued before step n is
    waited for. Seconds a step."""
    def step(y):
        return mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1)[:, None]

    y = step(first)
    mx.async_eval(y)
    mx.eval(y)  # the first step carries no pipelining: not timed
    start = time.perf_counter()
    for _ in range(steps):
        next_y = step(y)
        mx.async_eval(next_y)
        mx.eval(y)
        y = next_y
    mx.eval(y)
    return (time.perf_counter() - start) / (steps + 1)


# With `fill_context`'s batch caches, sequence b's prompt is shorter than the
# context by (b % BATCH_CACHE_SPREAD) * BATCH_CACHE_PADDING tokens.
BATCH_CACHE_SPREAD = 4
BATCH_CACHE_PADDING = 16


def fill_context(patched, batch: int, context: int, vocab: int, batch_cache: bool = False):
    """A cache holding `context` tokens of `batch` sequences (filled by the
    patched model, the faster; both sides then decode from the same state).
    With `batch_cache`, as mlx-lm's batch generation holds them: each
    sequence's prompt filled alone, of up to (BATCH_CACHE_SPREAD - 1) *
    BATCH_CACHE_PADDING tokens fewer, then merged into batch caches (their
    prompts left-padded to the longest, a boolean mask every step)."""
    from mlx_lm.models.cache import make_prompt_cache

    if batch_cache:
        prompts = []
        for b in range(batch):
            length = context - (b % BATCH_CACHE_SPREAD) * BATCH_CACHE_PADDING
            one, _ = fill_context(patched, 1, max(length, 1), vocab)
            prompts.append(one)
        cache = [layer[0].merge(list(layer)) for layer in zip(*prompts)]
        mx.eval([c.state for c in cache])
        return cache, mx.random.randint(0, vocab, (batch, 1))
    cache = make_prompt_cache(patched)
    tokens = mx.random.randint(0, vocab, (batch, context))
    step = max(PREFILL_STEP // batch, 1)
    for i in range(0, context, step):
        patched(tokens[:, i : i + step], cache=cache)
        mx.eval([c.state for c in cache])
    return cache, mx.random.randint(0, vocab, (batch, 1))


def measure_decode(model, patched, batch: int, context: int, steps: int, warmup: int,
                   rounds: int, vocab: int, pipelined: bool, control=None,
                   variant=None) -> dict:
    """One batch size's decode. With `control`, an unpatched copy of `model`
    decodes too, interleaved with both: its ratio to mlx-lm's ("control") is
    what two identical models give in the same run, the run's noise. With
    `variant`, a copy patched another way decodes with them: mlx-lm's speed
    over it is "variant"."""
    from mlx_lm.models.cache import make_prompt_cache

    cache, first = fill_context(patched, batch, context, vocab)
    saved = snapshot(cache)
    sides = Sides(model, patched, control, variant)
    caches = {"mlx-lm": cache, **{side: make_prompt_cache(m) for side, m in sides.models.items()
                                  if side != "mlx-lm"}}
    samples = {side: {"build": [], "wall": [], "pipelined": []} for side in sides.models}
    logits = {}
    what = f"decode batch {batch}"
    # Each round: every side from the same context, their one-eval steps
    # interleaved; then generate's pipelined loop, a turn a side (its steps
    # overlap one another and cannot be interleaved with another side's).
    for r in range(rounds):
        running = {side: caches[side] for side, _ in sides.turns(1)}
        for side_cache in running.values():
            restore(side_cache, saved)
        stepped = decode_interleaved(sides, running, first, steps, warmup, r, what)
        for side, (builds, walls, first_logits) in stepped.items():
            logits.setdefault(side, first_logits)
            samples[side]["build"] += builds
            samples[side]["wall"] += walls
        if not pipelined:
            continue
        for side, m in sides.turns(1, start=r):
            restore(caches[side], saved)
            pipelined_s = sides.attempt(
                side, what, lambda: decode_pipelined(m, caches[side], first, steps))
            if pipelined_s is not None:
                samples[side]["pipelined"].append(pipelined_s)
    row = {"batch": batch, "context": context, "steps": steps * rounds,
           "mlx-lm_error": sides.failure}
    for side, sample in samples.items():
        for what, values in sample.items():
            row[f"{side}_{what}_ms"] = statistics.median(values) * 1e3 if values else None
        wall = row[f"{side}_wall_ms"]
        row[f"{side}_tokens_per_s"] = batch / wall * 1e3 if wall else None
    theirs, ours = row["mlx-lm_wall_ms"], row["patched_wall_ms"]
    row["speedup"] = theirs / ours if theirs else None
    theirs_p, ours_p = row["mlx-lm_pipelined_ms"], row["patched_pipelined_ms"]
    row["pipelined_speedup"] = theirs_p / ours_p if theirs_p and ours_p else None
    for extra in Sides.EXTRA:
        if extra not in sides.models:
            continue
        extra_wall, extra_p = row[f"{extra}_wall_ms"], row[f"{extra}_pipelined_ms"]
        row[f"{extra}_speedup"] = theirs / extra_wall if theirs and extra_wall else None
        row[f"{extra}_pipelined_speedup"] = theirs_p / extra_p if theirs_p and extra_p else None
    row["logits_rel_diff"] = relative_difference(logits["patched"], logits["mlx-lm"]) \
        if "mlx-lm" in logits else None
    if variant is not None:
        row["variant_logits_rel_diff"] = relative_difference(
            logits["variant"], logits["mlx-lm"]) if "mlx-lm" in logits else None
    extras = [extra for extra in Sides.EXTRA if extra in sides.models]
    walls = "".join(f", {extra} {_ms(row.get(f'{extra}_wall_ms'))}" for extra in extras)
    builds = " / ".join(_ms(row[f"{side}_build_ms"]) for side in ("mlx-lm", "patched", *extras))
    progress(f"  decode batch {batch}: mlx-lm {_ms(theirs)} ms/step, patched {_ms(ours)}{walls} "
             f"(build {builds})")
    return row


def _ms(value) -> str:
    return "fails" if value is None else f"{value:.2f}"


def _ratio(value) -> str:
    return "" if value is None else f"{value:.2f}x"


# ---------------------------------------------------------------- report


def format_tables(result: dict) -> str:
    lines = []
    for entry in result["models"]:
        p = entry["prefill"]
        lines.append(f"{entry['name']}: {entry['describe'].get('patched_layers')} MoE layers "
                     f"patched")
        if p:
            lines.append(f"  prefill {p['tokens']} tokens (chunks of {PREFILL_STEP}): mlx-lm "
                         f"{_ms(p['mlx-lm_ms'])} ms, patched {_ms(p['patched_ms'])} ms, "
                         f"{_ratio(p['speedup'])}; logits rel. diff {_fmt(p['logits_rel_diff'])}"
                         + (f"; {_against_float32(p)}" if "patched_float32_rel_diff" in p
                            else ""))
        extras = [extra for extra in Sides.EXTRA
                  if any(f"{extra}_speedup" in d for d in entry["decode"])]
        lines.append(f"  {'batch':>5s} {'mlx-lm ms':>10s} {'build':>7s} {'patched ms':>11s} "
                     f"{'build':>7s} {'tok/s':>8s} {'speedup':>8s} {'pipelined':>10s} "
                     f"{'logits':>8s}" + "".join(f" {extra:>8s}" for extra in extras))
        for d in entry["decode"]:
            lines.append(
                f"  {d['batch']:5d} {_ms(d['mlx-lm_wall_ms']):>10s} "
                f"{_ms(d['mlx-lm_build_ms']):>7s} {_ms(d['patched_wall_ms']):>11s} "
                f"{_ms(d['patched_build_ms']):>7s} {d['patched_tokens_per_s']:8.0f} "
                f"{_ratio(d['speedup']):>8s} {_ratio(d['pipelined_speedup']):>10s} "
                f"{_fmt(d['logits_rel_diff']):>8s}"
                + "".join(f" {_ratio(d.get(f'{extra}_speedup')):>8s}" for extra in extras))
        if "control" in extras:
            lines.append("  control: mlx-lm's speed over an unpatched copy of its model, "
                         "decoded with the two (the run's noise)")
        if "variant" in extras:
            describe = entry["describe"]
            lines.append(f"  variant: mlx-lm's speed over the model patched with tile_m="
                         f"{describe.get('variant_tile_m')}, dense rows "
                         f"{'on' if describe.get('variant_dense_rows', True) else 'off'}"
                         f"{'' if describe.get('variant_dense', True) else ', dense=False'}"
                         f"{'' if describe.get('variant_submit', True) else ', submit=False'}, "
                         "decoded with the others")
    return "\n".join(lines)


def _against_float32(prefill: dict) -> str:
    """A prefill's logits against the float32 run, as the progress and the table say it."""
    return (f"against float32: mlx-lm {_fmt(prefill['mlx-lm_float32_rel_diff'])}, "
            f"patched {_fmt(prefill['patched_float32_rel_diff'])}")


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.1e}"


def median_of_processes(results: list[dict]) -> dict:
    """One result whose figures are the medians over processes, with the
    lowest ratio of any process beside each ratio (`*_min`)."""
    merged = copy.deepcopy(results[0])
    for m, entry in enumerate(merged["models"]):
        rows = [("prefill", None)] + [("decode", i) for i in range(len(entry["decode"]))]
        for section, index in rows:
            target = entry[section] if index is None else entry[section][index]
            if not target:
                continue
            for key, value in list(target.items()):
                if not isinstance(value, float):
                    continue
                values = [r["models"][m][section] if index is None
                          else r["models"][m][section][index] for r in results]
                values = [v[key] for v in values if v and isinstance(v.get(key), float)]
                target[key] = statistics.median(values)
                if key.endswith("speedup"):
                    target[f"{key}_min"] = min(values)
    merged["processes"] = len(results)
    return merged


def runs_ops(args) -> bool:
    """Whether this run starts with the ops (`--ops`: auto runs them on a CPU)."""
    if args.ops == "auto":
        return mx.default_device().type == mx.cpu
    return args.ops == "on"


def run_ops() -> dict | None:
    """`python -m benchmarks.moe` with `CPU_OPS_ARGS`, its table printed.
    Returns its JSON document, or None if it failed (a check, or the
    extension's import; moe says which on stderr, and nothing is timed)."""
    from . import moe

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ops.json")
        progress(f"the ops: python -m benchmarks.moe {' '.join(CPU_OPS_ARGS)}")
        if moe.main([*CPU_OPS_ARGS, "--json", out]) != 0:
            return None
        print(flush=True)
        with open(out) as f:
            return json.load(f)


def run(args) -> dict:
    device = "gpu" if mx.default_device().type == mx.gpu else "cpu"
    models, prompt, batches, context, dtype, steps = DEFAULTS[device]
    args.dtype = args.dtype or dtype
    args.steps = args.steps or steps
    names = [None] if args.model else (args.models.split(",") if args.models else models)
    result = {"date": datetime.date.today().isoformat(), "device": str(mx.default_device()),
              "mlx": mx.__version__, "command": "python -m benchmarks.model " +
              " ".join(args.argv), "models": []}
    for name in names:
        args.current = name
        name, model, patched, describe = load_pair(args)
        vocab = model.args.vocab_size if hasattr(model, "args") else 1000
        entry = {"name": name, "describe": describe, "prefill": None, "decode": []}
        tokens = prompt if args.prompt is None else args.prompt
        if tokens:
            progress(f"{name}: prefill of {tokens} tokens")
            entry["prefill"] = measure_prefill(model, patched, tokens, args.rounds, vocab,
                                               args.float32_logits)
        control = shared_copy(model) if args.control else None
        variant = None
        if (args.variant_tile_m is not None or args.variant_no_dense_rows
                or args.variant_no_dense or args.variant_no_submit):
            tile_m = args.tile_m if args.variant_tile_m is None else args.variant_tile_m
            dense_rows = args.dense_rows and not args.variant_no_dense_rows
            dense = args.dense and not args.variant_no_dense
            submit = args.submit and not args.variant_no_submit
            variant, _ = patched_copy(model, tile_m, args.no_compile, dense_rows, dense, submit)
            describe["variant_tile_m"] = tile_m
            describe["variant_dense_rows"] = dense_rows
            describe["variant_dense"] = dense
            describe["variant_submit"] = submit
        for batch in (args.batches or batches):
            progress(f"{name}: decode at batch {batch}")
            entry["decode"].append(measure_decode(
                model, patched, batch, args.context or context, args.steps, args.warmup,
                args.decode_rounds, vocab, not args.no_pipelined, control, variant))
        result["models"].append(entry)
        del model, patched, control, variant
        mx.clear_cache()
    return result


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model",
                                     description=__doc__.split("\n\n")[0])
    gpu, cpu = DEFAULTS["gpu"], DEFAULTS["cpu"]
    parser.add_argument("--models", help=f"comma list from {', '.join(MODELS)} "
                        + default_by_device(gpu[0], cpu[0]))
    parser.add_argument("--model", metavar="PATH", help="an mlx-lm model directory instead "
                        "(default: none, the configurations of --models)")
    parser.add_argument("--layers", type=int,
                        help="decoder layers of a configuration " + DEFAULT_LAYERS_HELP)
    parser.add_argument("--prompt", type=int, help="prefill tokens, 0: no prefill "
                        + default_by_device(gpu[1], cpu[1]))
    parser.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")],
                        help="decode batch sizes (default: " + ",".join(map(str, BATCHES)) + ")")
    parser.add_argument("--context", type=int, help="tokens in the cache before decoding "
                        + default_by_device(gpu[3], cpu[3]))
    parser.add_argument("--steps", type=int, help="timed decode steps a turn "
                        + default_by_device(gpu[5], cpu[5]))
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed decode steps first (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="prefill turns of each side (default: %(default)s)")
    parser.add_argument("--decode-rounds", type=int, default=4,
                        help="decode rounds at each batch size, each from the same context "
                             "(default: %(default)s)")
    parser.add_argument("--no-pipelined", action="store_true",
                        help="skip generate's pipelined loop")
    parser.add_argument("--control", action="store_true",
                        help="decode an unpatched copy of mlx-lm's model too, interleaved "
                             "with both sides: the ratio two identical models give, the "
                             "run's noise")
    parser.add_argument("--dtype", help="activations and unquantized weights "
                        + default_by_device(gpu[4], cpu[4]))
    add_quantization_arguments(parser)
    parser.add_argument("--tile-m", type=int, help="the patched layers' formulation "
                        "(default: the measured rule, nn.default_tile_m)")
    parser.add_argument("--variant-tile-m", type=int, metavar="M",
                        help="decode the model patched with tile_m=M too, interleaved with "
                             "the others: a formulation against the rule in one run "
                             "(default: none)")
    parser.add_argument("--no-dense-rows", dest="dense_rows", action="store_false",
                        help="the patched model's dense quantized projections take a "
                             "decoding batch as mlx-lm's do (patch_model's dense_rows=False)")
    parser.add_argument("--no-dense", dest="dense", action="store_false",
                        help="the patched model's dense quantized projections keep MLX's "
                             "GEMM where the grouped kernel's measured faster "
                             "(patch_model's dense=False; the kernel runs on CUDA only)")
    parser.add_argument("--variant-no-dense-rows", action="store_true",
                        help="decode the model patched without dense rows too, interleaved "
                             "with the others (with --variant-tile-m, that variant)")
    parser.add_argument("--variant-no-dense", action="store_true",
                        help="decode the model patched with dense=False too, interleaved "
                             "with the others (with --variant-tile-m or "
                             "--variant-no-dense-rows, that variant)")
    parser.add_argument("--no-submit", dest="submit", action="store_false",
                        help="the patched model's fused blocks leave a decoding step's "
                             "output lazy (patch_model's submit=False)")
    parser.add_argument("--variant-no-submit", action="store_true",
                        help="decode the model patched with submit=False too, interleaved "
                             "with the others (with another --variant option, that variant)")
    parser.add_argument("--no-compile", action="store_true",
                        help="the patched layers never compiled (compile_max_tokens=0), and "
                             "so no decoding step's block submitted as it is built")
    parser.add_argument("--float32-logits", action="store_true",
                        help="the prefill's logits of each side also against a float32 run "
                        "of the same weights (untimed)")
    parser.add_argument("--processes", type=int, default=1,
                        help="run in N processes; report medians and the lowest ratio "
                             "(default: %(default)s)")
    parser.add_argument("--warm-process", action="store_true",
                        help="with --processes: first one short untimed process of the "
                             "same models and sizes, which fills MLX's kernel cache on a "
                             "fresh machine (its figures are not reported)")
    parser.add_argument("--ops", choices=("auto", "on", "off"), default="auto",
                        help="first the ops, checked and timed by benchmarks.moe " +
                        " ".join(CPU_OPS_ARGS) + "; auto: on a CPU only (default: %(default)s)")
    parser.add_argument("--json", metavar="PATH",
                        help="write every figure as JSON (default: none)")
    args = parser.parse_args(argv)
    args.argv = list(argv)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    ops = None
    if runs_ops(args):
        ops = run_ops()
        if ops is None:
            return 1
    if args.processes > 1:
        results = []
        # What each process runs: this command but for --processes, --json and
        # --warm-process, without the ops, run here once.
        child = [a for a in without_options(argv, ("--json", "--processes"))
                 if a != "--warm-process"] + ["--ops", "off"]
        with tempfile.TemporaryDirectory() as tmp:
            if args.warm_process:
                # MLX's CUDA backend compiles each kernel at its first use and
                # keeps it in a disk cache: on a fresh machine the first process
                # spends minutes compiling, and its decode figures at batch 4
                # and 8 were 0.87x to 0.90x where the later processes' were 1.02x
                # to 1.05x (benchmarks/HISTORY.md, "Three processes, at f4ee542").
                progress("warm-up process (not reported)")
                subprocess.run([sys.executable, "-m", "benchmarks.model", *child, "--steps", "1",
                                "--warmup", "1", "--rounds", "1", "--decode-rounds", "1",
                                "--no-pipelined"], check=True, stdout=subprocess.DEVNULL)
            for p in range(args.processes):
                out = os.path.join(tmp, f"{p}.json")
                progress(f"process {p + 1} of {args.processes}")
                subprocess.run([sys.executable, "-m", "benchmarks.model", *child, "--json", out],
                               check=True)
                with open(out) as f:
                    results.append(json.load(f))
        result = median_of_processes(results)
        result["command"] = "python -m benchmarks.model " + " ".join(argv)
        result["per_process"] = results
    else:
        result = run(args)
    if ops is not None:
        result["ops"] = ops
    print(format_tables(result))
    if args.processes > 1:
        print(_lowest_ratios(result))
    if mx.default_device().type == mx.cpu:
        print(CPU_NOTE)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _lowest_ratios(result: dict) -> str:
    lines = [f"lowest ratio of {result['processes']} processes:"]
    for entry in result["models"]:
        p = entry["prefill"]
        parts = [f"prefill {_ratio(p.get('speedup_min'))}"] if p else []
        parts += [f"b{d['batch']} {_ratio(d.get('speedup_min'))}" for d in entry["decode"]]
        lines.append(f"  {entry['name']}: " + ", ".join(parts))
        for extra in Sides.EXTRA:
            if any(f"{extra}_speedup_min" in d for d in entry["decode"]):
                lines.append(f"  {entry['name']}, {extra}: " + ", ".join(
                    f"b{d['batch']} {_ratio(d.get(f'{extra}_speedup_min'))}"
                    for d in entry["decode"]))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
