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
import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="shard_experts shards mlx-lm models")
from conftest import grouped_qmm_by_mlx_ops  # noqa: E402
from mlx_lm.models import switch_layers  # noqa: E402

from mlx_moe_plan import _grouped  # noqa: E402
from mlx_moe_plan.nn import SwitchGLU, shard_experts  # noqa: E402

import two_ranks  # noqa: E402  (beside this file, on sys.path as pytest imports it)
from test_nn import tree_map_random  # noqa: E402

WORKER = Path(__file__).with_name("ep_worker.py")
# The run takes about 12 s on a 2-core CPU; past this it is hung, not slow.
# Over NCCL a GPU's first run also compiles MLX's kernels for every model.
LAUNCH_TIMEOUT_S = 120 if two_ranks.BACKEND == "ring" else 400


@two_ranks.needs_two_ranks
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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("kind", ["fused", "fused_biased", "unfused"])
def test_static_share_computes_every_row(monkeypatch, kind, share, compiled):
    # With static_share, an expert-parallel layer's tile GEMMs cover that
    # share of its plan's capacity and the grouped kernel the rows past it,
    # reading their spans on the device: no sync, compiled or not. Here a
    # group of one process, and a stand-in for the grouped kernel, as no GPU
    # runs it: its semantics in MLX's ops (conftest.grouped_qmm_by_mlx_ops),
    # each row's expert taken from the spans as the kernel takes it, zeros
    # past them. Of the 16 tiles the 120 entries use, the share 0.3 leaves
    # 9 to it, 0.0 all but one.
    rest_rows = []

    def grouped_by_mlx_ops(projection, rows, plan_rows, **fused):
        rest_rows.append(plan_rows.count)
        offsets = plan_rows.expert_offsets
        row = mx.arange(plan_rows.count)
        span_experts = (row[:, None] >= offsets[None, 1:]).sum(-1)
        out = grouped_qmm_by_mlx_ops(
            rows, projection.weight, projection.scales, projection.biases, offsets,
            mx.minimum(span_experts, offsets.size - 2), bits=projection.bits,
            group_size=projection.group_size, **fused)
        return mx.where((row < offsets[-1])[:, None], out, 0)

    used_rows = SwitchGLU._used_rows

    def no_sync(self, plan):
        assert self.expert_group is None, "the layer read its used rows back (a sync)"
        return used_rows(self, plan)

    monkeypatch.setattr(_grouped, "grouped_kernel", grouped_by_mlx_ops)
    monkeypatch.setattr(SwitchGLU, "_can_group", lambda self, dtype: True)
    # the GPU's rule at these sizes: gate and up in one launch where it can
    monkeypatch.setattr(SwitchGLU, "_fuses_gate_up",
                        staticmethod(lambda gate, in_dims, capacity: True))
    monkeypatch.setattr(SwitchGLU, "_used_rows", no_sync)
    mx.random.seed(8)
    # Unfused: an activation the kernel does not mirror (a subclass of
    # mlx-lm's SwiGLU), with biases, which the kernel adds to each projection.
    gates_in_kernel = kind != "unfused"

    class OtherSwiGLU(switch_layers.SwiGLU):
        pass

    theirs = switch_layers.SwitchGLU(64, 96, 16, bias=kind != "fused",
                                     activation=switch_layers.SwiGLU() if gates_in_kernel
                                     else OtherSwiGLU())
    theirs.update(tree_map_random(theirs.parameters()))
    nn.quantize(theirs, group_size=32, bits=4)
    whole = SwitchGLU.from_mlx_lm(theirs, tile_m=16)
    ours = SwitchGLU.from_mlx_lm(theirs, tile_m=16)
    assert ours._gates_in_kernel(mx.float32) == gates_in_kernel
    ours.expert_group = mx.distributed.init()  # one process: the all_sum is the identity
    ours.sync_from_entries = 1
    ours.static_share = share
    ours.compile_max_tokens = 10**6 if compiled else 0
    x = mx.random.normal((40, 64))
    indices = mx.argpartition(-mx.random.normal((40, 16)), 2, axis=-1)[..., :3]
    scores = mx.softmax(mx.random.normal((40, 3)), axis=-1)
    for got, want in ((ours(x, indices), whole(x, indices)),
                      (ours.weighted_sum(x, indices, scores),
                       whole.weighted_sum(x, indices, scores))):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    plan_capacity = 368  # 120 entries + 16 experts * 15 padding rows, whole tiles
    static_rows = {0.0: 16, 0.3: 112, 1.0: plan_capacity}[share]
    # Each call hands the rest to the kernel once a projection (gate and up
    # fused in one launch); the share 1.0 leaves it nothing.
    launches = 2 if gates_in_kernel else 3
    assert rest_rows == ([] if share == 1.0 else [plan_capacity - static_rows] * 2 * launches)


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_static_share_out_of_range_is_refused(share):
    layer = SwitchGLU(16, 24, 4, tile_m=16)
    layer.expert_group = mx.distributed.init()
    layer.static_share = share
    x = mx.random.normal((4, 16))
    indices = mx.zeros((4, 2), mx.int32)
    with pytest.raises(ValueError, match="static_share"):
        layer(x, indices)
