# Expert parallelism (mlx_moe_plan.nn.shard_experts) across two processes on
# this machine: one `mlx.launch -n 2 --backend ring` run of tests/ep_worker.py
# checks every model and setup (a launch costs seconds; one is enough), and
# the single-process cases run here. The launch itself: tests/two_ranks.py.

from __future__ import annotations

import os
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm", reason="shard_experts shards mlx-lm models")
from mlx_moe_plan.nn import SwitchGLU, shard_experts  # noqa: E402

import two_ranks  # noqa: E402  (beside this file, on sys.path as pytest imports it)

WORKER = Path(__file__).with_name("ep_worker.py")
# The run takes about 12 s on a 2-core CPU; past this it is hung, not slow.
# Over NCCL a GPU's first run also compiles MLX's kernels for every model.
LAUNCH_TIMEOUT_S = 120 if two_ranks.BACKEND == "ring" else 400


@two_ranks.needs_ring
def test_two_ranks_match_one_process():
    # Expert-parallel logits of Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss and
    # Qwen3-Next, float and 4-bit, at 1, 10, 80 and 600 tokens (compiled,
    # uncompiled, and past the used-rows sync), equal the single-process
    # model's within float tolerance: each rank rounds its partial weighted
    # sum before the all_sum adds them, so the last bits differ from one
    # float32 sum. So do mlx-lm's model.shard() then patch_model, one layer's
    # input gradients, and its weight gradients (a rank's experts' slice of
    # the whole layer's), unfused and fused; bad setups raise. See ep_worker.py.
    result = two_ranks.launch(
        [sys.executable, WORKER.name], timeout_s=LAUNCH_TIMEOUT_S, cwd=WORKER.parent,
        merge_stderr=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(WORKER.parent), os.environ.get("PYTHONPATH")]))))
    output = result.stdout
    failed = [line for line in output.splitlines() if " FAIL " in line]
    assert result.returncode == 0 and not failed, output[-8000:]
    for rank in (0, 1):
        assert f"rank {rank} done: 0 failed" in output, output[-8000:]


def test_group_of_one_is_a_no_op():
    # A process not started by a launcher is a group of one: nothing to split.
    group = mx.distributed.init()
    assert group.size() == 1
    layer = SwitchGLU(16, 24, 3)
    weight = layer.gate_proj.weight
    assert shard_experts(layer, group) == 0
    assert shard_experts(layer) == 0
    assert layer.expert_group is None and layer.gate_proj.weight is weight


def test_model_without_moe_layers_is_a_no_op():
    assert shard_experts(nn.Sequential(nn.Linear(8, 8), nn.ReLU())) == 0
