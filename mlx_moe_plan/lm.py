"""mlx-lm's own commands, with every model they load patched by `patch_model`.

    python -m mlx_moe_plan.lm [--no-patch] [--tile-m N] [--no-fuse] COMMAND [ARGS ...]
    mlx-moe-lm [--no-patch] [--tile-m N] [--no-fuse] COMMAND [ARGS ...]

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

Errors of mlx-lm (a missing model, a bad argument) read as they do from
`mlx_lm COMMAND`: the same message and exit code, its traceback without the
frames of this module; errors of ours (no mlx-lm, no hook point, a bad option
of ours) are one line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import sys
import traceback
import types
from typing import Callable, Iterator

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

_PREFIX = "mlx-moe-plan:"


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
def patched_loads(*, tile_m: int | None = None, fuse: bool = True,
                  report: Callable[[str], None] = say) -> Iterator[None]:
    """Patch every model mlx-lm loads inside the block with `patch_model`.

    Replaces `mlx_lm.utils.load_model` with a wrapper that patches the model
    it returns and reports it (`describe_patch`, each message once); the
    original is restored on exit.

    Args:
        tile_m (int, optional): `patch_model`'s `tile_m`. Default: its rule.
        fuse (bool): `patch_model`'s `fuse`. Default: ``True``.
        report (Callable[[str], None]): Where the messages go. Default: stderr.
    """
    utils = hook_point()  # before importing nn, which needs mlx-lm
    from .nn import patch_model

    load_model = utils.load_model
    report_once = _OncePerMessage(report)

    @functools.wraps(load_model)
    def patching_load_model(*args, **kwargs):
        model, config = load_model(*args, **kwargs)
        replaced = patch_model(model, tile_m=tile_m, fuse=fuse)
        report_once(describe_patch(model, config, replaced, tile_m))
        return model, config

    utils.load_model = patching_load_model
    try:
        yield
    finally:
        utils.load_model = load_model


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
        usage="%(prog)s [-h] [--no-patch] [--tile-m N] [--no-fuse] COMMAND [ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one of mlx-lm's commands with every MoE model it loads patched "
                    "by mlx_moe_plan.nn.patch_model. Options of ours come before COMMAND; "
                    "what follows COMMAND is mlx-lm's (COMMAND --help shows them).",
        epilog=f"commands (mlx-lm {MLX_LM_VERSION}'s):\n{commands}\n\n"
               "Compare with mlx-lm itself: the same command with --no-patch.")
    parser.add_argument("--no-patch", action="store_true",
                        help="run mlx-lm's command as it is, models unpatched")
    parser.add_argument("--tile-m", type=_tile_m, default=None, metavar="N",
                        help="GEMM formulation of every patched layer: 0 mlx-lm's own call, "
                             "1 sorted rows, more: tiles of N rows (default: the measured "
                             "rule, per call)")
    parser.add_argument("--no-fuse", action="store_true",
                        help="keep every MoE block's own weighted sum of its experts")
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
                tile_m: int | None = None, fuse: bool = True, prog: str | None = None) -> None:
    """Run `mlx_lm COMMAND ARGS` through mlx-lm's own dispatch, models patched.

    Exceptions and `SystemExit` of the command propagate as they are.
    """
    from mlx_lm import cli

    argv = sys.argv
    # mlx-lm's dispatch reads the command from argv[1] and drops it; the
    # command's parser then names itself after argv[0].
    sys.argv = [f"{prog or _program_name()} {command}", command, *args]
    try:
        if patch:
            with patched_loads(tile_m=tile_m, fuse=fuse):
                cli.main()
        else:
            cli.main()
    finally:
        sys.argv = argv


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
    if options.no_patch and (options.tile_m is not None or options.no_fuse):
        parser.error("--tile-m and --no-fuse choose how models are patched: "
                     "not with --no-patch")
    try:
        hook_point()
    except UsageError as error:
        say(f"error: {error}")
        return 1
    installed = installed_mlx_lm_version()
    if installed != MLX_LM_VERSION:
        say(f"warning: mlx-lm {installed} is installed; these commands are tested with "
            f"mlx-lm {MLX_LM_VERSION}: patching through mlx_lm.utils.load_model anyway")
    if options.no_patch:
        say("--no-patch: models run unpatched, as mlx-lm's own")

    try:
        run_command(options.command, options.args, patch=not options.no_patch,
                    tile_m=options.tile_m, fuse=not options.no_fuse, prog=parser.prog)
    except Exception as error:  # noqa: BLE001  (printed as Python would, then exit 1)
        tb = error.__traceback__
        if not _raised_by_us(tb):
            # mlx-lm's error, as `mlx_lm COMMAND` shows it: our frames only
            # pass it along.
            tb = _without_our_frames(tb)
        traceback.print_exception(type(error), error, tb)
        if _raised_by_us(error.__traceback__):
            say("the patch failed; --no-patch runs mlx-lm's command unpatched")
        else:
            say(f"mlx-lm's {options.command} failed with {type(error).__name__} "
                "(its traceback above, as mlx-lm prints it)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
