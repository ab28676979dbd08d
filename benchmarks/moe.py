"""Benchmark of plan, gather, combine and unsort against the path mlx-lm uses today.

    python -m benchmarks.moe                 # quick: Qwen3-Next shape, T = 128 and 2048
    python -m benchmarks.moe --full          # every model shape, T = 128 ... 16384
    python -m benchmarks.moe --shapes mixtral,deepseek-v3 --tokens 512,4096 --json out.json
    python -m benchmarks.moe --layer         # the MoE layer end to end (benchmarks/layer.py)

Runs on MLX's default device (CPU, Metal or CUDA). First it checks every op
bit for bit against `mlx_moe_plan.reference` (and that the mlx-lm path it times
computes the same thing), then times it against mlx-lm's `switch_layers` path
and a copy of the same bytes. This module is the command line; the parts are:

- `benchmarks.workloads`: the model shapes (experts, top_k, hidden), shared
  with the layer and model benchmarks.
- `benchmarks.op_inputs`: the routing and rows each op runs on.
- `benchmarks.op_peers`: what ours is timed against, mlx-lm's path and a copy.
- `benchmarks.op_checks`: the checks before timing.
- `benchmarks.op_measure`: the timing of each op at one shape.
- `benchmarks.op_report`: the table, the targets and the JSON document.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

import mlx.core as mx

from mlx_moe_plan.kernels import launch

from .op_checks import CheckError, check_shape, checks_per_shape
from .op_inputs import DTYPES
from .op_measure import Settings, measure_shape, memory_budget, timed_cases
from .op_peers import MLX_LM_MISSING, mlx_lm
from .op_report import (HEADLINE, device_description, format_table, header, json_document,
                        page_fault_note, summarize, targets)
from .workloads import LAYER_SHAPES

FULL_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_SHAPES = ("qwen3-next",)
QUICK_TOKENS = (128, 2048)
DEFAULT_HIDDEN = 2560


class Progress:
    """A one-line counter on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.width = 0

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        text = f"[{self.done:>{len(str(self.total))}}/{self.total}] {elapsed:6.1f}s  {label}"
        if self.tty:
            sys.stderr.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()


def parse_list(text: str, convert, what: str):
    try:
        values = [convert(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{what}: {error}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{what}: empty list")
    return values


def shape_list(text: str):
    names = parse_list(text, str, "--shapes")
    unknown = [n for n in names if n not in LAYER_SHAPES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown shape(s) {unknown}; choose from {', '.join(LAYER_SHAPES)}")
    return names


def token_list(text: str):
    values = parse_list(text, int, "--tokens")
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("--tokens: every T must be at least 1")
    return values


def hidden_arg(text: str):
    if text == "model":
        return text
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("--hidden: must be at least 1 or 'model'")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.moe",
        description="Check mlx_moe_plan's ops against the NumPy reference, then time them "
                    "against mlx-lm's switch_layers path and a copy of the same bytes.",
    )
    parser.add_argument("--full", action="store_true",
                        help=f"every model shape ({', '.join(LAYER_SHAPES)}) and T in "
                             f"{', '.join(map(str, FULL_TOKENS))}")
    parser.add_argument("--shapes", type=shape_list,
                        help=f"comma list from {', '.join(LAYER_SHAPES)} (default: "
                             f"{','.join(QUICK_SHAPES)}; every one with --full)")
    parser.add_argument("--tokens", type=token_list,
                        help="comma list of token counts T (default: "
                             f"{','.join(map(str, QUICK_TOKENS))}; with --full "
                             f"{','.join(map(str, FULL_TOKENS))})")
    parser.add_argument("--hidden", type=hidden_arg, default=DEFAULT_HIDDEN,
                        help="hidden size H for every shape, or 'model' for each model's own "
                             "(default: %(default)s)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float16",
                        help="activation dtype (default: %(default)s)")
    parser.add_argument("--calls", type=int,
                        help="calls built into one graph, each on its own inputs (default: 48; "
                             "4 for gather, combine, unsort on a CPU; fewer where memory is short)")
    parser.add_argument("--repeats", type=int, help="timed graph evaluations (default: by time)")
    parser.add_argument("--mem-gb", type=float,
                        help="memory for one graph's inputs and outputs (default: a quarter "
                             "of the device's, at most 32 GiB on a GPU, 4 on a CPU)")
    parser.add_argument("--seed", type=int, default=0,
                        help="of the random routings and rows (default: %(default)s)")
    parser.add_argument("--plan-max-groups", type=int, metavar="N",
                        help="the GPU plan's cap on groups, past which each group places "
                             f"several blocks (default: {launch.PLAN_MAX_GROUPS}; "
                             "kernels/launch.py)")
    parser.add_argument("--json", metavar="PATH",
                        help="write every result, with the environment, as JSON (default: none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    args = parser.parse_args(argv)
    if args.calls is not None and args.calls < 1:
        parser.error("--calls: must be at least 1")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats: must be at least 1")
    if args.plan_max_groups is not None and args.plan_max_groups < 1:
        parser.error("--plan-max-groups: must be at least 1")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--layer" in argv:  # the layer end to end: benchmarks/layer.py
        from . import layer

        return layer.main([a for a in argv if a != "--layer"])
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "benchmarks.moe", *argv])
    on_gpu = mx.default_device().type == mx.gpu
    shapes = args.shapes or (list(LAYER_SHAPES) if args.full else list(QUICK_SHAPES))
    tokens = args.tokens or (list(FULL_TOKENS) if args.full else list(QUICK_TOKENS))
    dtype = DTYPES[args.dtype]
    settings = Settings(
        calls=args.calls, on_gpu=on_gpu, repeats=args.repeats,
        min_repeats=5, max_repeats=100 if on_gpu else 30,
        target_s=0.3 if on_gpu else 0.5, warmup=2 if on_gpu else 1,
        budget=memory_budget(args.mem_gb),
    )
    mx.random.seed(args.seed)
    notes = []
    plan_max_groups = launch.PLAN_MAX_GROUPS
    if args.plan_max_groups is not None:
        plan_max_groups = args.plan_max_groups
        notes.append(f"the GPU plan's groups capped at {plan_max_groups}")
    if mlx_lm is None:
        notes.append("mlx-lm's switch_layers path cannot be imported "
                     f"({MLX_LM_MISSING}; pip install mlx-lm): only ours and the copy are timed")
        print(f"note: {notes[-1]}", file=sys.stderr)

    def hidden_of(name):
        return LAYER_SHAPES[name].hidden if args.hidden == "model" else args.hidden

    # The check at the benchmark shape uses the selected T nearest the headline's.
    check_tokens = min(tokens, key=lambda t: (abs(t - HEADLINE["tokens"]), t))
    n_steps = len(shapes) * checks_per_shape() + len(shapes) * len(tokens) * len(timed_cases())
    progress = Progress(n_steps, enabled=not args.no_progress)
    started = time.perf_counter()

    # Plans built inside are what the cap changes: the checked ones and the timed ones.
    with launch.plan_max_groups(plan_max_groups):
        checks = []
        try:
            for name in shapes:
                checks.extend(check_shape(name, LAYER_SHAPES[name], hidden_of(name), check_tokens,
                                          dtype, progress.step))
        except CheckError as error:
            progress.close()
            print(f"CHECK FAILED on {mx.default_device()}: {error}\nNothing was timed.",
                  file=sys.stderr)
            return 1
        except ImportError as error:  # the extension is not built
            progress.close()
            print(f"cannot run mlx_moe_plan: {error}", file=sys.stderr)
            return 2

        results = []
        for name in shapes:
            for t in tokens:
                results.extend(measure_shape(name, LAYER_SHAPES[name], t, hidden_of(name), dtype,
                                             settings, progress.step))
    progress.close()
    elapsed = time.perf_counter() - started

    rows = summarize(results)
    fault_note = page_fault_note(results, on_gpu)
    if fault_note:
        notes.append(fault_note)
    found, targets_text = targets(rows, on_gpu)
    device = device_description()
    hidden_rule = ("each model's own hidden size" if args.hidden == "model"
                   else f"H = {args.hidden} for every shape")

    if args.json:
        document = json_document(
            command=command, device=device,
            run={"dtype": args.dtype, "hidden": args.hidden, "shapes": shapes, "tokens": tokens},
            settings={"calls": settings.calls, "repeats": settings.repeats,
                      "min_repeats": settings.min_repeats, "max_repeats": settings.max_repeats,
                      "target_s": settings.target_s, "warmup": settings.warmup,
                      "memory_budget_bytes": settings.budget, "seed": args.seed,
                      "plan_max_groups": plan_max_groups},
            checks=checks, results=results, rows=rows, found=found, notes=notes, elapsed_s=elapsed)
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=1)
            handle.write("\n")

    print(header(device, args.dtype, hidden_rule, len(checks), elapsed, notes))
    print()
    print(format_table(rows))
    print()
    print(targets_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
