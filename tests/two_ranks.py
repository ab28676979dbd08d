# Two processes of one `mx.distributed` group on this machine: a command run
# by `mlx.launch --hosts 127.0.0.1 -n 2 --backend ring` on the loopback, for
# the tests of expert parallelism (tests/test_expert_parallel.py runs
# tests/ep_worker.py so; tests/test_lm.py runs `python -m mlx_moe_plan.lm
# --expert-parallel`). A launch costs seconds: the tests keep to few.
# MLX_MOE_PLAN_TEST_BACKEND=nccl runs them over NCCL instead, one GPU a rank
# (tests/gpu_suite.sh's expert-parallel step, on a machine of two GPUs).

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest


def mlx_launch() -> str | None:
    """MLX's launcher next to this interpreter (a virtual environment's bin), or on PATH."""
    beside = Path(sys.executable).with_name("mlx.launch")
    return str(beside) if beside.exists() else shutil.which("mlx.launch")


def free_port() -> int:
    """A port free on the loopback now (for the ring: its first; rank 0 listens on it,
    rank 1 on the next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# The launcher's backend: ring (the loopback, any MLX) unless the environment
# names another (nccl: MLX's CUDA build, one GPU a rank).
BACKEND = os.environ.get("MLX_MOE_PLAN_TEST_BACKEND", "ring")


def why_not_two_ranks() -> str | None:
    """Why the tests' backend (BACKEND) cannot run here, or None if it can."""
    if mlx_launch() is None:
        return "mlx.launch is not installed"
    if not mx.distributed.is_available(backend=BACKEND):
        return f"this MLX has no {BACKEND} backend"
    return None


# The mark of a test that launches two ranks: skipped, with why, where they cannot run.
needs_two_ranks = pytest.mark.skipif(why_not_two_ranks() is not None,
                                     reason=str(why_not_two_ranks()))


def launch(argv: list[str], *, timeout_s: float, cwd: Path | None = None,
           env: dict[str, str] | None = None, stdin: str | None = None,
           merge_stderr: bool = False) -> subprocess.CompletedProcess:
    """`argv` run as ranks 0 and 1 of a ring on the loopback (or of BACKEND's
    group on this machine), to completion.

    The launcher forwards both ranks' output, and `stdin` to both. It runs
    in its own process group, so that a hung run is killed whole, launcher
    and ranks, after `timeout_s`, and the test fails with the output so far.

    Returns:
        CompletedProcess: The launcher's exit code, stdout and stderr (stderr
        in stdout with `merge_stderr`). MLX 0.32.4's launcher exits 0 even
        where a rank failed (it warns on stderr): check what the ranks print.
    """
    command = [mlx_launch(), "-n", "2", "--backend", BACKEND]
    if BACKEND == "ring":
        command += ["--hosts", "127.0.0.1", "--starting-port", str(free_port())]
    command += ["--", *map(str, argv)]
    # The launcher's stdin is a pipe held open until it exits: it polls its
    # stdin, and one at its end (closed, or /dev/null) is always readable,
    # which keeps it spinning on a core the ranks need.
    read_end, write_end = os.pipe()
    try:
        if stdin:
            os.write(write_end, stdin.encode())  # a few lines: within the pipe's buffer
        process = subprocess.Popen(
            command, cwd=cwd, stdin=read_end, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            text=True, start_new_session=True, env=env)
        os.close(read_end)
        read_end = None
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"the two ranks of {argv} did not finish in {timeout_s} s:\n"
                        f"{stdout[-4000:]}\n{(stderr or '')[-4000:]}")
    finally:
        for end in (read_end, write_end):
            if end is not None:
                os.close(end)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
