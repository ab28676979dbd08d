"""mlx-lm's own commands, with every model they load patched by `patch_model`.

    python -m mlx_moe_plan.lm [--no-patch] [--tile-m N] [--no-fuse] [--no-dense-rows] [--no-dense]
                              [--no-submit] [--expert-parallel] COMMAND [ARGS ...]
    mlx-moe-lm [--no-patch] [--tile-m N] [--no-fuse] [--no-dense-rows] [--no-dense]
               [--no-submit] [--expert-parallel] COMMAND [ARGS ...]

COMMAND is one of mlx-lm's commands that run a model (`COMMANDS`: generate,
chat, server, benchmark, ...) and ARGS are that command's own arguments.
mlx-lm's dispatch (`mlx_lm.cli.main`, what `mlx_lm COMMAND` runs) runs the
command itself, so its arguments, output and exit codes are mlx-lm's.

The hook is mlx-lm's model loader, `mlx_lm.utils.load_model`: `load` and
`sharded_load`, the loaders of every command (draft models and the server's
models included), call it through their module's global, so replacing that
global patches every model a command loads, and nothing of mlx-lm's command
code is copied. Each model is patched as it is loaded, before any adapter or
sharding is applied to it (sharding splits the same projection modules in
place; the fused blocks of a sharded model keep their own call). A line on
stderr says what was patched (once, however often the same model loads), or
that a model has no MoE layer and runs unpatched: its command still runs, with
mlx-lm's exit code, since an unpatched model is what `--no-patch` runs too.

With `--expert-parallel`, under `mlx.launch` (an `mx.distributed` group of
N > 1 processes), every model loaded is also split by `nn.shard_experts`: each
process keeps and computes E / N experts of every MoE layer. The hook loads
the model lazily, patches and shards it, and only then evaluates its
parameters (unless the caller asked for a lazy load), the experts array by
array: a process holds its own experts and, while loading, one whole expert
array, never the whole model's experts. How a command loads under a group
decides whether it can run so (`EXPERT_PARALLEL`): generate, perplexity,
cache_prompt and evaluate call `load` on every rank, which the hook shards;
benchmark, chat and server call `sharded_load`, which would cut every expert
in width by mlx-lm's tensor-parallel `model.shard()` (which `shard_experts`
refuses), so inside the block their modules' `sharded_load` is `load` through
the hook instead (`--pipeline` is refused). Every rank must run the same
tokens: the ranks agree on one random seed first (a sampled token is then the
same on each), the commands that print the same output on every rank print it
on rank 0 only, and evaluate, which splits its requests among the ranks, and
cache_prompt, whose ranks would all write one file, are refused
(`NOT_EXPERT_PARALLEL`). In a group of one process (not started by
`mlx.launch`) the option warns and the command runs patched, unsplit.

Errors of mlx-lm (a model the Hub does not have, a bad argument) read as they
do from `mlx_lm COMMAND`: the same message and exit code, its traceback
without the frames of this module; errors of ours (no mlx-lm, no hook point, a
bad option of ours, a model whose experts do not divide among the ranks) are
one line and a non-zero exit. So is a model path that does not exist
(`missing_model_path`), which mlx-lm would take for a Hugging Face repo id and
reject as one without naming the path: one line that names it, with mlx-lm's
exit code for that failure (1).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import os
import sys
import traceback
import types
from typing import Callable, Iterator

import mlx.core as mx

# The mlx-lm these commands are written and tested against.
MLX_LM_VERSION = "0.32.2"

# mlx-lm's commands that load a model and run it: the ones worth patching.
COMMANDS = {
    "generate": "generate text from a prompt",
    "chat": "chat in the terminal",
    "server": "an OpenAI-compatible HTTP server",
    "benchmark": "prompt and generation tokens/s",
    "cache_prompt": "save a prompt's KV cache",
    "perplexity": "a model's perplexity on a dataset",
    "evaluate": "lm-evaluation-harness tasks (needs lm_eval)",
}
# mlx-lm's other commands, and why they are not run patched here.
NOT_PATCHED = {
    **dict.fromkeys(("convert", "fuse", "awq", "dwq", "dynamic_quant", "gptq"),
                    "it writes a model, which the patch would not change"),
    "lora": "training runs mlx-lm's own layers",
    **dict.fromkeys(("manage", "upload", "share"), "it runs no model"),
}

# The commands --expert-parallel runs, and the others with why not. Every rank
# of an expert-parallel model must run the same tokens: each computes its own
# experts' part of the same MoE outputs.
NOT_EXPERT_PARALLEL = {
    "evaluate": "it splits its requests among the ranks, and expert parallelism "
                "needs every rank to run the same tokens",
    "cache_prompt": "its ranks would all write the same file: run it as one process "
                    "(the KV cache it saves serves an expert-parallel generate as it is)",
}
EXPERT_PARALLEL = tuple(command for command in COMMANDS if command not in NOT_EXPERT_PARALLEL)
# Commands that know nothing of ranks and print the same output on each: under
# --expert-parallel only rank 0's standard output is kept (the others' errors
# still reach stderr).
PRINT_ON_EVERY_RANK = ("generate", "perplexity")

_PREFIX = "mlx-moe-plan:"

# The options of mlx-lm's commands that name a model to load: a directory, or
# a Hugging Face repo id.
MODEL_OPTIONS = ("--model", "--draft-model")


class UsageError(Exception):
    """A problem with the environment this module reports in one line."""


def say(message: str) -> None:
    """One line of ours on stderr, apart from the command's own output."""
    print(f"{_PREFIX} {message}", file=sys.stderr, flush=True)


def _model_name(model, config: dict) -> str:
    """The name a model goes by: its Hugging Face class, else mlx-lm's model type."""
    architectures = config.get("architectures")
    if isinstance(architectures, str):
        architectures = [architectures]
    if architectures:
        return str(architectures[0])
    return str(config.get("model_type") or type(model).__module__.rpartition(".")[2])


def describe_patch(model, config: dict, replaced: int, tile_m: int | None) -> str:
    """What `patch_model` did to a loaded model, as the line `say` prints."""
    from .nn import MLX_LM, FusedMoEBlock

    name = _model_name(model, config)
    if replaced == 0:
        return f"no MoE layers (mlx-lm SwitchGLU) found in {name}: running unpatched"
    fused = sum(isinstance(module, FusedMoEBlock) for _, module in model.named_modules())
    if tile_m is None:
        formulation = "GEMMs by the measured rule"
    elif tile_m == MLX_LM:
        formulation = "GEMMs as mlx-lm's own call (tile_m 0)"
    else:
        formulation = f"tile_m {tile_m}"
    layers = "layer" if replaced == 1 else "layers"
    return f"patched {replaced} MoE {layers} of {name} ({fused} blocks fused, {formulation})"


def _sharded_layers(model) -> list:
    """The layers of `model` whose experts `shard_experts` split."""
    from .nn import SwitchGLU

    return [layer for _, layer in model.named_modules()
            if isinstance(layer, SwitchGLU) and layer.expert_group is not None]


def describe_sharding(model, group: mx.distributed.Group) -> str:
    """How `shard_experts` split a loaded model's experts, to follow `describe_patch`."""
    ranks = group.size()
    # A sharded layer's num_experts is its own E / N.
    totals = sorted({layer.num_experts * ranks for layer in _sharded_layers(model)})
    if not totals:
        return f"nothing to split: each of the {ranks} ranks runs the whole model"
    each = ", ".join(f"{total // ranks} of {total}" for total in totals)
    return f"sharded across {ranks} ranks ({each} experts a layer each)"


class _OncePerMessage:
    """Says each distinct message once: `sharded_load` loads a model twice,
    and a server may load the same model again."""

    def __init__(self, report: Callable[[str], None]):
        self.report = report
        self.said: set[str] = set()

    def __call__(self, message: str) -> None:
        if message not in self.said:
            self.said.add(message)
            self.report(message)


def hook_point() -> types.ModuleType:
    """`mlx_lm.utils`, checked to hold the loader this module replaces.

    Raises:
        UsageError: mlx-lm is missing, or has no `utils.load_model`.
    """
    try:
        utils = importlib.import_module("mlx_lm.utils")
    except ImportError as error:
        raise UsageError(f"mlx-lm is not installed ({error}): "
                         f"pip install mlx-lm=={MLX_LM_VERSION}") from None
    if not callable(getattr(utils, "load_model", None)):
        raise UsageError(f"mlx-lm {installed_mlx_lm_version()} has no "
                         f"mlx_lm.utils.load_model to patch models at; this command "
                         f"needs mlx-lm {MLX_LM_VERSION}")
    return utils


def installed_mlx_lm_version() -> str:
    """The installed mlx-lm's version, as its package metadata gives it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-lm")
    except PackageNotFoundError:
        return "(unknown version)"


@contextlib.contextmanager
def patched_loads(*, tile_m: int | None = None, fuse: bool = True, dense_rows: bool = True,
                  dense: bool = True, submit: bool = True,
                  expert_group: mx.distributed.Group | None = None,
                  report: Callable[[str], None] = say) -> Iterator[None]:
    """Patch every model mlx-lm loads inside the block with `patch_model`.

    Replaces `mlx_lm.utils.load_model` with a wrapper that patches the model
    it returns and reports it (`describe_patch`, each message once); the
    original is restored on exit. With an `expert_group` of more than one
    rank, the wrapper also splits the model's experts (`shard_experts`), and
    `sharded_load` (in `mlx_lm.utils` and in every mlx-lm module already
    imported that imported it by name) becomes `load` through the wrapper.

    Args:
        tile_m (int, optional): `patch_model`'s `tile_m`. Default: its rule.
        fuse (bool): `patch_model`'s `fuse`. Default: ``True``.
        dense_rows (bool): `patch_model`'s `dense_rows`. Default: ``True``.
        dense (bool): `patch_model`'s `dense`. Default: ``True``.
        submit (bool): `patch_model`'s `submit`. Default: ``True``.
        expert_group (Group, optional): The ranks to split the experts among.
          Default: ``None``, every process keeps every expert.
        report (Callable[[str], None]): Where the messages go. Default: stderr
          (under an expert group, rank 0's only: the message is the same on
          every rank).

    Raises:
        UsageError: Inside the block, a model's experts do not divide among
          the ranks, mlx-lm's `--pipeline` asks for `sharded_load`'s pipeline,
          or LoRA adapters are to be applied to an expert-parallel model.
    """
    utils = hook_point()  # before importing nn, which needs mlx-lm
    from . import expert_parallel
    from .nn import patch_model, shard_experts

    load_model = utils.load_model
    patch = functools.partial(patch_model, tile_m=tile_m, fuse=fuse, dense_rows=dense_rows,
                              dense=dense, submit=submit)
    report_once = _OncePerMessage(report)
    if expert_group is not None and expert_group.size() == 1:
        expert_group = None  # shard_experts is a no-op there

    @functools.wraps(load_model)
    def patching_load_model(*args, **kwargs):
        model, config = load_model(*args, **kwargs)
        replaced = patch(model)
        report_once(describe_patch(model, config, replaced, tile_m))
        return model, config

    # The caller's arguments, whichever way they are passed, to read and set `lazy`.
    signature = inspect.signature(load_model)

    @functools.wraps(load_model)
    def sharding_load_model(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        lazy = bound.arguments.get("lazy", False)
        # Lazily, whatever the caller asked: the other ranks' experts are cut
        # from the still unread arrays, so this rank's parameters only ever
        # hold its own.
        bound.arguments["lazy"] = True
        model, config = load_model(*bound.args, **bound.kwargs)
        replaced = patch(model)
        try:
            shard_experts(model, expert_group)
        except ValueError as error:  # experts that do not divide among the ranks
            raise UsageError(str(error)) from None
        if not lazy:  # the experts array by array, not the whole of each at once
            expert_parallel.evaluate_sharded(model)
        if expert_group.rank() == 0:
            report_once(f"{describe_patch(model, config, replaced, tile_m)}; "
                        f"{describe_sharding(model, expert_group)}")
        return model, config

    def expert_parallel_load(repo, pipeline_group=None, tensor_group=None,
                             return_config=False, *, tokenizer_config=None,
                             trust_remote_code=False):
        """`sharded_load`'s call, answered by `load` (whose `load_model` shards
        the experts) in place of mlx-lm's tensor or pipeline parallelism: the
        `tensor_group` a command passes is the group of every rank, the
        expert group itself."""
        if pipeline_group is not None:
            raise UsageError("--expert-parallel and mlx-lm's --pipeline each split the "
                             "model among the ranks: use one or the other")
        model, tokenizer, config = utils.load(
            repo, tokenizer_config=tokenizer_config or {"trust_remote_code": True},
            return_config=True, trust_remote_code=trust_remote_code)
        # As sharded_load ends: no rank starts while another is still loading.
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=expert_group))
        return (model, tokenizer, config) if return_config else (model, tokenizer)

    def refusing_load_adapters(model, adapter_path):
        # Adapters of the experts' projections hold every expert, and the
        # projections they wrap only this rank's.
        raise UsageError("--expert-parallel: LoRA adapters are not split among the "
                         "ranks; fuse them into the model first (mlx_lm fuse)")

    originals = {(utils, "load_model"): load_model}
    if expert_group is None:
        utils.load_model = patching_load_model
    else:
        utils.load_model = sharding_load_model
        originals[utils, "load_adapters"] = utils.load_adapters
        utils.load_adapters = refusing_load_adapters
        sharded_load = utils.sharded_load
        for name, module in list(sys.modules.items()):
            if (name == "mlx_lm" or name.startswith("mlx_lm.")) and \
                    getattr(module, "sharded_load", None) is sharded_load:
                originals[module, "sharded_load"] = sharded_load
                module.sharded_load = expert_parallel_load
    try:
        yield
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)


def missing_model_path(args: list[str]) -> str | None:
    """The first model a command's arguments name (`MODEL_OPTIONS`) that can
    only be a local path, and does not exist; None if there is none.

    mlx-lm loads a model from the path given if it exists, and otherwise takes
    it for a Hugging Face repo id (`name` or `namespace/name`), which the Hub
    validates first. A value that exists, or that is a valid repo id (such as
    `mlx-community/Qwen3-30B-A3B-4bit`, or a relative `models/qwen` that is
    not there), is left to mlx-lm; one the Hub would reject as a repo id
    (absolute, `./...`, `~/...`, or more than one separator) is a path that
    does not exist.

    Args:
        args (list[str]): The command's own arguments.

    Returns:
        str or None: The value as given.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    for i, arg in enumerate(args):
        option, equals, value = arg.partition("=")
        if option not in MODEL_OPTIONS or not (equals or i + 1 < len(args)):
            continue
        value = value if equals else args[i + 1]
        if os.path.exists(value):
            continue
        try:
            validate_repo_id(value)
        except HFValidationError:
            return value
    return None


def _tile_m(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"expected 0 (mlx-lm's own call), 1 (sorted rows) or a tile height above 1, "
            f"got {text!r}")
    return value


def _program_name() -> str:
    launched_as = os.path.basename(sys.argv[0]) if sys.argv else ""
    return "mlx-moe-lm" if launched_as.startswith("mlx-moe-lm") else "python -m mlx_moe_plan.lm"


def argument_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """Our options, COMMAND, and everything after it for mlx-lm."""
    commands = "\n".join(f"  {name:<14}{what}" for name, what in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog=prog or _program_name(),
        usage="%(prog)s [-h] [--no-patch] [--tile-m N] [--no-fuse] [--no-dense-rows] [--no-dense] "
              "[--no-submit] [--expert-parallel] COMMAND [ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one of mlx-lm's commands with every MoE model it loads patched "
                    "by mlx_moe_plan.nn.patch_model. Options of ours come before COMMAND; "
                    "what follows COMMAND is mlx-lm's (COMMAND --help shows them).",
        epilog=f"commands (mlx-lm {MLX_LM_VERSION}'s):\n{commands}\n\n"
               "Compare with mlx-lm itself: the same command with --no-patch.\n\n"
               "Expert parallelism, two processes on this machine:\n"
               "  mlx.launch -n 2 --backend ring -- python -m mlx_moe_plan.lm "
               "--expert-parallel generate --model PATH --prompt ...")
    parser.add_argument("--no-patch", action="store_true",
                        help="run mlx-lm's command as it is, models unpatched")
    parser.add_argument("--tile-m", type=_tile_m, default=None, metavar="N",
                        help="GEMM formulation of every patched layer: 0 mlx-lm's own call, "
                             "1 sorted rows, more: tiles of N rows (default: the measured "
                             "rule, per call)")
    parser.add_argument("--no-fuse", action="store_true",
                        help="keep every MoE block's own weighted sum of its experts")
    parser.add_argument("--no-dense-rows", action="store_true",
                        help="keep mlx-lm's shape for the dense quantized projections of a "
                             "decoding batch (default: one matrix of rows, and one GEMM for "
                             "those on one input, where measured faster, patch_model's "
                             "dense_rows)")
    parser.add_argument("--no-dense", action="store_true",
                        help="keep MLX's GEMM for the dense quantized projections (default: "
                             "the package's grouped kernel where its GEMM was measured "
                             "faster, on CUDA; patch_model's dense)")
    parser.add_argument("--no-submit", action="store_true",
                        help="leave a decoding step's or a prompt chunk's graph to be "
                             "evaluated whole (default: the fused MoE blocks hand their output "
                             "to the GPU as they are built, where measured faster, on CUDA; "
                             "patch_model's submit)")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="under mlx.launch, split every MoE layer's experts among the "
                             "processes (nn.shard_experts): each holds and computes E/N of "
                             "them; for " + ", ".join(EXPERT_PARALLEL))
    # Optional to argparse, so that its absence gets our message, not one
    # that also calls the remainder required.
    parser.add_argument("command", metavar="COMMAND", nargs="?",
                        help="one of: " + ", ".join(COMMANDS))
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="the command's own arguments, passed to mlx-lm unchanged")
    return parser


def _this_file(frame: types.FrameType) -> bool:
    return os.path.abspath(frame.f_code.co_filename) == os.path.abspath(__file__)


def _without_our_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback `tb` without the frames of this module (dispatch and hook)."""
    frames = []
    while tb is not None:
        if not _this_file(tb.tb_frame):
            frames.append(tb)
        tb = tb.tb_next
    trimmed = None
    for entry in reversed(frames):
        trimmed = types.TracebackType(trimmed, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return trimmed


def _raised_by_us(tb: types.TracebackType | None) -> bool:
    """Whether the innermost frame of `tb` is in this package."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    innermost = None
    while tb is not None:
        innermost, tb = tb, tb.tb_next
    return innermost is not None and \
        os.path.abspath(innermost.tb_frame.f_code.co_filename).startswith(package)


def run_command(command: str, args: list[str], *, patch: bool = True,
                tile_m: int | None = None, fuse: bool = True, dense_rows: bool = True,
                dense: bool = True, submit: bool = True,
                expert_group: mx.distributed.Group | None = None,
                prog: str | None = None) -> None:
    """Run `mlx_lm COMMAND ARGS` through mlx-lm's own dispatch, models patched.

    Args:
        command (str): One of `COMMANDS`.
        args (list[str]): The command's own arguments.
        patch (bool): Patch the models the command loads. Default: ``True``.
        tile_m (int, optional): `patch_model`'s `tile_m`. Default: its rule.
        fuse (bool): `patch_model`'s `fuse`. Default: ``True``.
        dense_rows (bool): `patch_model`'s `dense_rows`. Default: ``True``.
        dense (bool): `patch_model`'s `dense`. Default: ``True``.
        submit (bool): `patch_model`'s `submit`. Default: ``True``.
        expert_group (Group, optional): Split the experts of every model among
          these ranks (`patched_loads`), which all run this same command.
          Default: ``None``, not split.
        prog (str, optional): The name the command's usage goes by.

    Exceptions and `SystemExit` of the command propagate as they are.
    """
    from mlx_lm import cli

    argv = sys.argv
    # mlx-lm's dispatch reads the command from argv[1] and drops it; the
    # command's parser then names itself after argv[0].
    sys.argv = [f"{prog or _program_name()} {command}", command, *args]
    try:
        with contextlib.ExitStack() as stack:
            if expert_group is not None:
                _same_on_every_rank(command, expert_group, stack)
            if patch:
                stack.enter_context(patched_loads(tile_m=tile_m, fuse=fuse,
                                                  dense_rows=dense_rows, dense=dense,
                                                  submit=submit, expert_group=expert_group))
            cli.main()
    finally:
        sys.argv = argv


def _same_on_every_rank(command: str, group: mx.distributed.Group,
                        stack: contextlib.ExitStack) -> None:
    """Set up an expert-parallel run of `command`: its module imported (so that
    `patched_loads` finds its `sharded_load`), one random seed for every rank,
    and rank 0's standard output only where the command prints on every rank."""
    importlib.import_module(f"mlx_lm.{command}")
    # Sampled tokens must be the same on every rank: ranks that ran different
    # tokens would add up parts of different MoE outputs, and one that stopped
    # first would leave the others waiting in their all_sum. MLX seeds each
    # process from the clock; mlx-lm's server agrees on a seed this way.
    seed = mx.distributed.all_sum(mx.random.state[0], group=group)
    mx.random.seed(seed.view(mx.uint64).item())
    if command in PRINT_ON_EVERY_RANK and group.rank() != 0:
        stack.enter_context(contextlib.redirect_stdout(
            stack.enter_context(open(os.devnull, "w"))))


def main(argv: list[str] | None = None) -> int:
    """The command line: our options, COMMAND, mlx-lm's arguments. Returns the exit code."""
    parser = argument_parser()
    options = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if options.command is None:
        parser.error("a COMMAND is required: one of " + ", ".join(COMMANDS))
    if options.command in NOT_PATCHED:
        parser.error(f"mlx-lm's {options.command} is not run here "
                     f"({NOT_PATCHED[options.command]}): run `mlx_lm {options.command}`")
    if options.command not in COMMANDS:
        parser.error(f"unknown command {options.command!r}: expected one of "
                     + ", ".join(COMMANDS))
    if options.no_patch and (options.tile_m is not None or options.no_fuse
                             or options.no_dense_rows or options.no_dense
                             or options.no_submit):
        parser.error("--tile-m, --no-fuse, --no-dense-rows, --no-dense and --no-submit choose "
                     "how models are patched: not with --no-patch")
    if options.expert_parallel and options.no_patch:
        parser.error("--expert-parallel splits the experts of the patched layers: "
                     "not with --no-patch")
    if options.expert_parallel and options.command in NOT_EXPERT_PARALLEL:
        parser.error(f"mlx-lm's {options.command} does not run with --expert-parallel "
                     f"({NOT_EXPERT_PARALLEL[options.command]})")
    try:
        hook_point()
    except UsageError as error:
        say(f"error: {error}")
        return 1
    installed = installed_mlx_lm_version()
    if installed != MLX_LM_VERSION:
        say(f"warning: mlx-lm {installed} is installed; these commands are tested with "
            f"mlx-lm {MLX_LM_VERSION}: patching through mlx_lm.utils.load_model anyway")
    missing = missing_model_path(options.args)
    if missing is not None:
        say(f"error: no model at {missing}: that path does not exist (and it is not a "
            "Hugging Face repo id, namespace/name)")
        return 1  # mlx-lm's exit code for it (an uncaught HFValidationError)
    if options.no_patch:
        say("--no-patch: models run unpatched, as mlx-lm's own")
    expert_group = None
    if options.expert_parallel:
        expert_group = mx.distributed.init()
        if expert_group.size() == 1:
            # Not an error: the same command line runs, and can be compared,
            # without the launcher.
            say("warning: --expert-parallel: this is one process (mlx.launch starts "
                "several): the experts are not split, models run patched only")
            expert_group = None

    try:
        run_command(options.command, options.args, patch=not options.no_patch,
                    tile_m=options.tile_m, fuse=not options.no_fuse,
                    dense_rows=not options.no_dense_rows, dense=not options.no_dense,
                    submit=not options.no_submit, expert_group=expert_group, prog=parser.prog)
    except UsageError as error:  # ours, raised inside mlx-lm's command by the hook
        say(f"error: {error}")
        return 1
    except Exception as error:  # noqa: BLE001  (printed as Python would, then exit 1)
        ours = _raised_by_us(error.__traceback__)
        # mlx-lm's error, as `mlx_lm COMMAND` shows it: our frames only pass it along.
        tb = error.__traceback__ if ours else _without_our_frames(error.__traceback__)
        traceback.print_exception(type(error), error, tb)
        if ours:
            say("the patch failed; --no-patch runs mlx-lm's command unpatched")
        else:
            say(f"mlx-lm's {options.command} failed with {type(error).__name__} "
                "(its traceback above, as mlx-lm prints it)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
