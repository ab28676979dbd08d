# One rank of tests/test_expert_parallel.py's two-process run (mlx.launch -n 2
# --backend ring): every rank builds the same models from the same seeds,
# shards them, and checks its logits and gradients against the single-process
# model it also holds. Prints one line per check, "FAIL ..." for a failure,
# and exits 1 if any failed.

from __future__ import annotations

import copy
import sys
import traceback

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import switch_layers

from mlx_moe_plan import expert_parallel
from mlx_moe_plan.nn import SwitchGLU, patch_model, shard_experts
from test_nn import count_switch_glu, make_model

# The models of the layer tests, mlx-lm 0.32.2's.
MODELS = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen3_next"]
# One token (a decode step: sorted rows where one process runs mlx-lm's call),
# 10 and 80 tokens run compiled (the all_sum inside the trace); 600 tokens
# route 1200 to 2400 entries, past EXPERT_PARALLEL_SYNC_FROM_ENTRIES, uncompiled.
PROMPT_SHAPES = [(1, 1), (2, 5), (2, 40), (2, 300)]

group = mx.distributed.init()
rank = group.rank()
failures = []


def check(label: str, condition_or_callable) -> None:
    try:
        result = condition_or_callable() if callable(condition_or_callable) else \
            condition_or_callable
        assert result is None or result, "false"
        print(f"rank {rank} ok   {label}", flush=True)
    except Exception:  # noqa: BLE001: report every check, then fail the run
        failures.append(label)
        print(f"rank {rank} FAIL {label}\n{traceback.format_exc()}", flush=True)


# On the CPU the ranks' float32 sums differ from one process's in their last
# bits only. MLX's CUDA float32 GEMMs round differently from kernel to kernel
# (about 5e-4 relative between two of them on the H200: benchmarks/HISTORY.md,
# "Gate and up in one launch, rows from the tokens"),
# and a rank's GEMMs have other shapes than one process's.
TOLERANCE = 1e-5 if mx.default_device().type == mx.cpu else 2e-3


def close(got: mx.array, want: mx.array, label: str) -> None:
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=TOLERANCE, atol=TOLERANCE,
                               err_msg=label)


def logits(model, shape) -> mx.array:
    tokens = mx.array(np.random.default_rng(11).integers(0, 96, shape))
    out = model(tokens)
    mx.eval(out)
    return out


def expert_bytes(model) -> int:
    return sum(expert_parallel.expert_bytes(layer) for _, layer in model.named_modules()
               if isinstance(layer, SwitchGLU))


for name in MODELS:
    for quantized in (False, True):
        variant = f"{name} {'4bit' if quantized else 'float'}"
        model = make_model(name, quantized)
        layers = count_switch_glu(model, switch_layers.SwitchGLU)
        wants = {shape: logits(model, shape) for shape in PROMPT_SHAPES}

        patched = copy.deepcopy(model)
        patch_model(patched)
        full_bytes = expert_bytes(patched)
        sharded = copy.deepcopy(model)
        check(f"{variant}: shard_experts shards every MoE layer",
              lambda: shard_experts(sharded, group) == layers)
        check(f"{variant}: a rank holds 1/2 of the experts' bytes",
              lambda: expert_bytes(sharded) * 2 == full_bytes)
        for shape, want in wants.items():
            check(f"{variant} {shape}: expert-parallel logits", lambda: close(
                logits(sharded, shape), want, f"{variant} {shape}"))
        check(f"{variant}: sharding again is a no-op",
              lambda: shard_experts(sharded, group) == 0)

        # mlx-lm's tensor parallelism cuts each expert's hidden width in two:
        # the test models' 32 hold a single 4-bit group of 32, which cannot
        # be cut, so it runs on the float models (qwen3_moe, deepseek_v3 and
        # gpt_oss; mixtral and qwen3_next have no shard()).
        if hasattr(model, "shard") and not quantized:
            parallel = copy.deepcopy(model)
            parallel.shard(group)
            patch_model(parallel)
            for shape, want in wants.items():
                check(f"{variant} {shape}: model.shard() then patch_model", lambda: close(
                    logits(parallel, shape), want, f"{variant} {shape} tensor-parallel"))
            # The other order, mlx-lm's sharded_load through the command-line
            # hook (patched at load_model, then shard()): the fused blocks see
            # their sharding_group and keep their own call.
            patched_first = copy.deepcopy(model)
            patch_model(patched_first)
            patched_first.shard(group)
            for shape, want in wants.items():
                check(f"{variant} {shape}: patch_model then model.shard()", lambda: close(
                    logits(patched_first, shape), want, f"{variant} {shape} patched first"))

            def refuses_tensor_parallel():
                try:
                    shard_experts(parallel, group)
                except ValueError as error:
                    return "tensor-parallel" in str(error)
                return False

            check(f"{variant}: shard_experts after model.shard() raises",
                  refuses_tensor_parallel)

        # Both at once: mlx-lm's shard() cuts attention and dense layers, the
        # MoE blocks stay whole and their experts are split by rank. (The 4-bit
        # DeepSeek-V3 test model's dense layer is one 4-bit group wide: mlx-lm
        # cannot cut it.)
        if hasattr(model, "shard") and not (quantized and name == "deepseek_v3"):
            both = copy.deepcopy(model)
            check(f"{variant}: shard_experts(tensor_parallel=True) shards every MoE layer",
                  lambda: shard_experts(both, group, tensor_parallel=True) == layers)
            check(f"{variant}: with tensor-parallel attention, 1/2 of the experts' bytes",
                  lambda: expert_bytes(both) * 2 == full_bytes)
            check(f"{variant}: attention cut by mlx-lm's sharded linears",
                  lambda: any(type(m).__name__.endswith("AllToShardedLinear")
                              for _, m in both.named_modules()))
            check(f"{variant}: tensor-parallel attention, MoE blocks not marked",
                  lambda: not any(getattr(m, "sharding_group", None) is not None
                                  for _, m in both.named_modules()))
            for shape, want in wants.items():
                check(f"{variant} {shape}: expert-parallel, tensor-parallel attention",
                      lambda: close(logits(both, shape), want,
                                    f"{variant} {shape} expert+tensor"))

# mlx-lm's generation loop (its own stream, KV cache, pipelined evals) runs a
# sharded model: greedy tokens as one process's (these seeds have no near-tie).
for name in ("qwen3_moe", "gpt_oss"):
    model = make_model(name, quantized=True)
    sharded = copy.deepcopy(model)
    shard_experts(sharded, group)
    prompt = mx.array([1, 5, 9, 17, 33])
    check(f"{name} 4bit: generate_step gives the single-process tokens",
          lambda: [t for t, _ in generate_step(prompt, sharded, max_tokens=12)] ==
          [t for t, _ in generate_step(prompt, model, max_tokens=12)])

def weight_grads(layer, loss, x) -> dict[str, mx.array]:
    """The gradients of `loss(x)` with respect to `layer`'s parameters, by name."""
    return dict(tree_flatten(nn.value_and_grad(layer, loss)(x)[1]))


# One layer's gradients. Its input gradient: summed over the ranks, the whole
# layer's. Its weights': a rank's experts are rows [start, stop) of the
# whole layer's, and so are their gradients (the all_sum passes the
# cotangent through unchanged).
for tile_m in (None, 1, 8):
    mx.random.seed(2)
    theirs = switch_layers.SwitchGLU(32, 48, 8, bias=True)
    ours = SwitchGLU.from_mlx_lm(copy.deepcopy(theirs), tile_m=tile_m)
    mx.eval(theirs.parameters(), ours.parameters())
    shard_experts(ours, group)
    for tokens in (40, 400):
        x = mx.random.normal((tokens, 32), key=mx.random.key(3))
        indices = mx.argpartition(-mx.random.normal((tokens, 8), key=mx.random.key(4)), 2,
                                  axis=-1)[..., :3]
        dy = mx.random.normal((tokens, 3, 32), key=mx.random.key(5))
        scores = mx.softmax(mx.random.normal((tokens, 3), key=mx.random.key(6)), axis=-1)

        def losses(layer):
            """The layer's loss on input v, unfused and fused (weighted sum)."""
            unfused = lambda v: (layer(v, indices) * dy).sum()  # noqa: E731
            fused = (lambda v: (layer.weighted_sum(v, indices, scores) * dy[:, 0]).sum()) \
                if isinstance(layer, SwitchGLU) else \
                (lambda v: ((layer(v, indices) * scores[..., None]).sum(-2) * dy[:, 0]).sum())
            return unfused, fused

        plan = ours._plan(indices, ours._formulation(x, indices))
        used = ours._used_rows(plan)
        # From 1024 entries a rank runs its GEMMs over its own rows (about
        # half, rounded up a little); below, over all of them.
        check(f"layer tile_m={tile_m} T={tokens}: GEMM rows {used} of {plan.capacity}",
              lambda: used < plan.capacity if tokens * 3 >= 1024 else used == plan.capacity)
        ours.sync_from_entries = 10**9  # never: the whole capacity, no sync
        check(f"layer tile_m={tile_m} T={tokens}: no sync, all {plan.capacity} GEMM rows",
              lambda: ours._used_rows(plan) == plan.capacity)
        del ours.sync_from_entries  # the class's again
        for got_loss, want_loss, how in zip(losses(ours), losses(theirs), ("unfused", "fused")):
            got, want = mx.grad(got_loss)(x), mx.grad(want_loss)(x)
            check(f"layer tile_m={tile_m} T={tokens}: {how} input gradient",
                  lambda: close(got, want, f"gradient {how}"))

        start, stop = ours.expert_offset, ours.expert_offset + ours.num_experts
        for got_loss, want_loss, how in zip(losses(ours), losses(theirs), ("unfused", "fused")):
            def rank_slice_of_whole(got_loss=got_loss, want_loss=want_loss, how=how):
                got, want = weight_grads(ours, got_loss, x), weight_grads(theirs, want_loss, x)
                assert sorted(got) == sorted(want) == sorted(
                    f"{p}.{k}" for p in ("gate_proj", "up_proj", "down_proj")
                    for k in ("weight", "bias")), sorted(got)
                for name in want:
                    close(got[name], want[name][start:stop], f"{how} {name} gradient")

            check(f"layer tile_m={tile_m} T={tokens}: {how} weight gradients of experts "
                  f"[{start}, {stop})", rank_slice_of_whole)

# Bad setups: clear errors or no-ops, never a hang.
uneven = SwitchGLU(16, 24, 3)


def refuses_uneven():
    try:
        shard_experts(uneven, group)
    except ValueError as error:
        return "E = 3" in str(error) and "N = 2" in str(error)
    return False


check("3 experts among 2 ranks raises a ValueError naming E and N", refuses_uneven)
check("a model without MoE layers: 0", lambda: shard_experts(
    nn.Sequential(nn.Linear(8, 8), nn.ReLU()), group) == 0)


def refuses_without_shard():
    try:
        shard_experts(make_model("mixtral", False), group, tensor_parallel=True)
    except ValueError as error:
        return "has no shard()" in str(error)
    return False


check("tensor_parallel on a model without mlx-lm's shard() raises", refuses_without_shard)

print(f"rank {rank} done: {len(failures)} failed", flush=True)
sys.exit(1 if failures else 0)
