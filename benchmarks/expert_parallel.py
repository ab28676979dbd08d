"""Expert parallelism against mlx-lm's tensor parallelism and one device, under `mlx.launch`.

    mlx.launch -n 2 --backend nccl -- python -m benchmarks.expert_parallel    # 2 GPUs
    mlx.launch --hosts 127.0.0.1 -n 2 --backend ring -- \\
        python -m benchmarks.expert_parallel                                  # CPU: small model

Every rank builds the same model of a real configuration (`benchmarks/workloads.py`,
random weights from one seed, bfloat16 and 4-bit on a GPU) once per side, and
the sides run one after another:

- `one`: `patch_model`, no group: each rank runs the whole model by itself, so
  rank 0's figures are one device's;
- `tensor`: mlx-lm's own tensor parallelism, `model.shard(group)` (attention,
  dense layers and every expert cut in width, an `all_sum` a block), unpatched;
- `tensor+patch`: the same, then `patch_model` (the experts' GEMMs ours; the
  sharded blocks keep their own call);
- `expert`: `nn.shard_experts(model, group)`: E/N whole experts a rank,
  attention and dense layers replicated, one `all_sum` a MoE block;
- `expert+tensor`: `nn.shard_experts(model, group, tensor_parallel=True)`:
  the same experts a rank, attention and dense layers cut by mlx-lm's
  `model.shard(group)` as in `tensor`.

For each side: the first MoE block alone on T tokens (wall time of building and
evaluating it, median of several calls), a whole-model prefill in mlx-lm's
chunks of 2048 (`benchmarks.model.prefill`), and decoding one step at a time
from a context in the KV cache, wall time with graph building
(`benchmarks.model.decode_steps`), the building's own time beside it; the
bytes of the experts a rank holds, and its peak memory. The last prefill
logits are compared with `one`'s. Once a model, for the block's sizes: one
`all_sum` of the block's `[T, D]` output alone (throughput, 8 a graph), the
all-reduce an expert-parallel block adds to its halved GEMMs. Rank 0 prints
the table and writes `--json`; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import mlx.core as mx

from . import model as whole
from .timing import time_calls
from .workloads import DEFAULT_LAYERS, MODELS, with_layers

SIDES = ("one", "tensor", "tensor+patch", "expert", "expert+tensor")
EXPERT_SIDES = ("expert", "expert+tensor")
TENSOR_PARALLEL_SIDES = ("tensor", "tensor+patch", "expert+tensor")  # need mlx-lm's shard()
DEFAULTS = {  # device type -> (models, prompts, block tokens, batches, context, dtype)
    "gpu": (["qwen3-30b-a3b", "deepseek-v3"], (2048, 8192), (1, 32, 2048, 8192), (1, 32),
            512, "bfloat16"),
    "cpu": (["small-qwen3-moe"], (256,), (1, 32, 256), (1, 8), 64, "float32"),
}


def expert_bytes(model) -> int:
    """Bytes of the experts' projections (mlx-lm's SwitchGLU or ours) this rank holds."""
    from mlx_lm.models.switch_layers import SwitchGLU as MlxLmSwitchGLU

    from mlx_moe_plan import expert_parallel
    from mlx_moe_plan.nn import SwitchGLU

    return sum(expert_parallel.expert_bytes(layer) for _, layer in model.named_modules()
               if isinstance(layer, (SwitchGLU, MlxLmSwitchGLU)))


def build_side(side: str, config: dict, args, group) -> tuple[object, str | None]:
    """The model of `side` on this rank, evaluated; or None and why it cannot run."""
    from mlx_moe_plan.nn import patch_model, shard_experts

    if side in TENSOR_PARALLEL_SIDES and not hasattr(whole.model_module(config).Model, "shard"):
        return None, f"mlx-lm's {config['model_type']} has no shard()"
    model, _ = whole.random_model(config, dtype=getattr(mx, args.dtype), bits=args.bits,
                                  group_size=args.group_size, seed=0)
    if side.startswith("tensor"):
        model.shard(group)
        if side == "tensor+patch":
            patch_model(model)
    elif side in EXPERT_SIDES:
        shard_experts(model, group, tensor_parallel=side == "expert+tensor")
    else:
        patch_model(model)
    options = {"compile_max_tokens": 0} if args.no_compile else {}  # as benchmarks.model's
    if args.sync_from_entries is not None:
        options["sync_from_entries"] = args.sync_from_entries
    if args.expert_tile_m is not None and side in EXPERT_SIDES:
        options["tile_m"] = args.expert_tile_m
    if args.static_share is not None:
        options["static_share"] = args.static_share
    whole.set_our_layers(model, **options)
    mx.eval(model.parameters())
    mx.clear_cache()
    return model, None


def first_moe_block(model):
    """The first decoder layer's MoE block (whatever holds its SwitchGLU)."""
    for layer in model.layers:
        block = getattr(layer, "mlp", None)
        if block is not None and any(hasattr(block, n) for n in ("switch_mlp", "experts")):
            return block
    raise ValueError("no MoE block found")


def time_block(block, tokens: int, hidden: int, dtype, calls: int) -> float:
    """Median wall seconds of building and evaluating `block` on `[1, tokens, D]`."""
    x = mx.random.normal((1, tokens, hidden), key=mx.random.key(tokens)).astype(dtype)
    mx.eval(x)
    for _ in range(2):
        mx.eval(block(x))
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        mx.eval(block(x))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_all_sums(group, tokens: int, hidden: int, dtype, repeats: int) -> float:
    """Median milliseconds of one `all_sum` over `group` of a block's output
    `[tokens, hidden]`, 8 independent ones a graph: the expert sides' cost a
    MoE block beside their GEMMs. Fixed repeats: every rank makes the calls."""
    outputs = [mx.random.normal((tokens, hidden), key=mx.random.key(i)).astype(dtype)
               for i in range(8)]
    mx.eval(outputs)
    timing = time_calls(lambda i: mx.distributed.all_sum(outputs[i], group=group), 8,
                        warmup=2, repeats=repeats)
    return timing.median_s * 1e3


def measure_side(model, config: dict, args) -> dict:
    """One side's figures; a figure whose graph MLX failed to run is None, and
    its error is in `row["errors"]` (every rank fails alike: same shapes)."""
    from mlx_lm.models.cache import make_prompt_cache

    dtype = getattr(mx, args.dtype)
    row: dict = {"expert_bytes": expert_bytes(model), "block_ms": {}, "prefill_ms": {},
                 "decode_ms": {}, "decode_build_ms": {}, "errors": {}, "logits": None}

    def attempt(table: str, key: int, measure) -> None:
        try:
            row[table][key] = measure()
        except RuntimeError as error:  # e.g. MLX CUDA's graph launch at some shapes
            row[table][key] = None
            row["errors"][f"{table} {key}"] = str(error)
            whole.progress(f"  {table} {key}: failed: {error}")

    block = first_moe_block(model)
    for tokens in args.block_tokens:
        attempt("block_ms", tokens, lambda: time_block(
            block, tokens, config["hidden_size"], dtype, args.calls) * 1e3)
    vocab = config["vocab_size"]
    mx.reset_peak_memory()

    def time_prefill(prompt) -> float:
        whole.prefill(model, whole.warmup_prompt(prompt), make_prompt_cache(model))
        samples = []
        for _ in range(args.rounds):
            seconds, row["logits"] = whole.timed_prefill(model, prompt)
            samples.append(seconds)
        return statistics.median(samples) * 1e3

    for tokens in args.prompts:
        prompt = mx.random.randint(0, vocab, (1, tokens), key=mx.random.key(1))
        attempt("prefill_ms", tokens, lambda: time_prefill(prompt))
    row["peak_gb"] = mx.get_peak_memory() / 1e9

    def time_decode(batch) -> float:
        mx.random.seed(2)  # the same context and first tokens on every side
        cache, first = whole.fill_context(model, batch, args.context, vocab)
        builds, walls, _ = whole.decode_steps(model, cache, first, args.steps, args.warmup)
        # The host's part of a step beside its wall time: a sharded side slower
        # than another with the same kernels is slower in one or the other.
        row["decode_build_ms"][batch] = statistics.median(builds) * 1e3
        return statistics.median(walls) * 1e3

    for batch in args.batches:
        attempt("decode_ms", batch, lambda: time_decode(batch))
    mx.clear_cache()
    return row


def run(args) -> dict:
    group = mx.distributed.init()
    rank = group.rank()
    say = whole.progress if rank == 0 else (lambda message: None)
    result = {"date": datetime.date.today().isoformat(), "device": str(mx.default_device()),
              "mlx": mx.__version__, "ranks": group.size(),
              "command": "python -m benchmarks.expert_parallel " + " ".join(args.argv),
              "models": []}
    if group.size() < 2:
        raise SystemExit("run under mlx.launch with 2 or more ranks (a group of one has "
                         "nothing to split)")
    for name in args.model_names:
        config = with_layers(MODELS[name], args.layers or DEFAULT_LAYERS.get(name))
        entry = {"name": name, "layers": config["num_hidden_layers"],
                 "hidden": config["hidden_size"], "sides": {},
                 "all_sum_ms": {t: time_all_sums(group, t, config["hidden_size"],
                                                 getattr(mx, args.dtype), args.calls)
                                for t in args.block_tokens}}
        reference = None
        for side in args.sides:
            say(f"{name}: {side}")
            model, why = build_side(side, config, args, group)
            if model is None:
                entry["sides"][side] = {"error": why}
                say(f"  {side}: {why}")
                continue
            row = measure_side(model, config, args)
            logits = row.pop("logits")
            if reference is None:
                reference = logits
            row["logits_rel_diff"] = None if logits is None or reference is None else \
                whole.relative_difference(logits, reference)
            entry["sides"][side] = row
            say(f"  {side}: prefill {row['prefill_ms']} ms, decode {row['decode_ms']} ms")
            del model, logits
            mx.clear_cache()
        result["models"].append(entry)
    return result


def format_tables(result: dict) -> str:
    lines = [f"{result['ranks']} ranks, {result['device']}, MLX {result['mlx']}"]
    for entry in result["models"]:
        sides = {s: r for s, r in entry["sides"].items() if "error" not in r}
        lines.append(f"{entry['name']} ({entry['layers']} layers); ms, and each expert "
                     "side's speedup over the others")
        rows = [("expert MB", lambda r: r["expert_bytes"] / 1e6, False),
                ("peak MB", lambda r: r["peak_gb"] * 1e3, False)]
        if sides:  # every side measured the same sizes
            first = next(iter(sides.values()))
            rows += [(f"block T={t}", lambda r, t=t: r["block_ms"][t], True)
                     for t in first["block_ms"]]
            rows += [(f"prefill {t}", lambda r, t=t: r["prefill_ms"][t], True)
                     for t in first["prefill_ms"]]
            for b in first["decode_ms"]:
                rows += [(f"decode b{b}", lambda r, b=b: r["decode_ms"][b], True),
                         ("  its build", lambda r, b=b: r["decode_build_ms"].get(b), False)]
        pairs = [(e, s) for e in EXPERT_SIDES if e in sides
                 for s in sides if s not in EXPERT_SIDES]
        width = max((len(f"{e} vs {s}") for e, s in pairs), default=0) + 2
        lines.append("  " + f"{'':16s}" + "".join(f"{s:>14s}" for s in sides) +
                     "".join(f"{e + ' vs ' + s:>{width}s}" for e, s in pairs))
        def ratio(numerator, denominator) -> str:
            if numerator is None or denominator is None:
                return f"{'-':>{width}s}"
            return f"{numerator / denominator:{width - 1}.2f}x"

        for label, value, timed in rows:
            cells = "".join(f"{'failed':>14s}" if value(r) is None else f"{value(r):14.2f}"
                            for r in sides.values())
            ratios = "".join(ratio(value(sides[s]), value(sides[e]))
                             for e, s in pairs) if timed else ""
            lines.append(f"  {label:16s}{cells}{ratios}")
        if "one" in sides:
            full = sides["one"]["expert_bytes"]
            lines.append("  experts' bytes a rank holds, of one device's: " + ", ".join(
                f"{s} {r['expert_bytes'] / full:.3f}" for s, r in sides.items()) +
                f" (1/N = {1 / result['ranks']:.3f})")
        lines.append(f"  one all_sum of a block's [T, {entry['hidden']}] output, ms: " + ", ".join(
            f"T={t} {ms:.3f}" for t, ms in entry["all_sum_ms"].items()))
        lines.append("  logits rel. diff vs one: " + ", ".join(
            f"{s} {r['logits_rel_diff']:.1e}" for s, r in sides.items()
            if r["logits_rel_diff"] is not None))
        for side, row in sides.items():
            for what, error in row["errors"].items():
                lines.append(f"  {side}: {what} failed: {error}")
        for side, row in entry["sides"].items():
            if "error" in row:
                lines.append(f"  {side}: not run ({row['error']})")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.expert_parallel",
                                     description=__doc__.split("\n\n")[0])
    gpu, cpu = DEFAULTS["gpu"], DEFAULTS["cpu"]
    parser.add_argument("--models", help=f"comma list from {', '.join(MODELS)} "
                        + whole.default_by_device(gpu[0], cpu[0]))
    parser.add_argument("--layers", type=int,
                        help="decoder layers of each configuration " + whole.DEFAULT_LAYERS_HELP)
    parser.add_argument("--sides", default=",".join(SIDES),
                        help=f"comma list from {', '.join(SIDES)}; the first is the logits' "
                             "reference (default: %(default)s)")
    parser.add_argument("--prompts", type=_ints,
                        help="prefill tokens " + whole.default_by_device(gpu[1], cpu[1]))
    parser.add_argument("--block-tokens", type=_ints, help="tokens of the block-alone timings "
                        + whole.default_by_device(gpu[2], cpu[2]))
    parser.add_argument("--batches", type=_ints,
                        help="decode batch sizes " + whole.default_by_device(gpu[3], cpu[3]))
    parser.add_argument("--context", type=int, help="tokens in the cache before decoding "
                        + whole.default_by_device(gpu[4], cpu[4]))
    parser.add_argument("--steps", type=int, default=10,
                        help="timed decode steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed decode steps first (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="timed prefills a side (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=10,
                        help="timed block calls a size (default: %(default)s)")
    parser.add_argument("--no-compile", action="store_true",
                        help="our layers' small calls uncompiled (compile_max_tokens = 0)")
    parser.add_argument("--sync-from-entries", type=int, metavar="N",
                        help="expert-parallel layers sync to run their GEMMs over their own "
                             "rows from N routed entries; a huge N: never (default: the "
                             "layer's, EXPERT_PARALLEL_SYNC_FROM_ENTRIES)")
    parser.add_argument("--static-share", type=float, metavar="S",
                        help="expert-parallel layers run their GEMMs over this share of "
                             "their plan's capacity and the grouped kernel over the rest, "
                             "instead of the sync (SwitchGLU.static_share; e.g. 1.25 / N) "
                             "(default: none, the sync)")
    parser.add_argument("--expert-tile-m", type=int, metavar="M",
                        help="the expert sides' layers in one GEMM formulation at every size "
                             "(SwitchGLU.tile_m: -1 the grouped kernel, which reads each "
                             "expert's rows on the device and needs no sync; 1 sorted rows; "
                             "16 or 64 tiles) (default: the layer's rule)")
    parser.add_argument("--dtype", help="activations and unquantized weights "
                        + whole.default_by_device(gpu[5], cpu[5]))
    whole.add_quantization_arguments(parser)
    parser.add_argument("--json", metavar="PATH",
                        help="write every figure as JSON (default: none)")
    args = parser.parse_args(argv)
    args.argv = list(argv)
    device = "gpu" if mx.default_device().type == mx.gpu else "cpu"
    models, prompts, block_tokens, batches, context, dtype = DEFAULTS[device]
    args.model_names = args.models.split(",") if args.models else models
    args.prompts = args.prompts or list(prompts)
    args.block_tokens = args.block_tokens or list(block_tokens)
    args.batches = args.batches or list(batches)
    args.context = args.context or context
    args.dtype = args.dtype or dtype
    args.sides = args.sides.split(",")
    unknown = set(args.sides) - set(SIDES)
    if unknown:
        parser.error(f"--sides: unknown {', '.join(sorted(unknown))}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = run(args)
    if mx.distributed.init().rank() == 0:
        print(format_tables(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
