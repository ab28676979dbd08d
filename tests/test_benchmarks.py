# The whole-model benchmark's own machinery, on the CPU: a copy that shares
# weights, cache snapshots, and a short run end to end. The figures it reports
# are only as good as these.

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="the whole-model benchmark runs mlx-lm models")
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import switch_layers  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from benchmarks import model as bench  # noqa: E402
from benchmarks.workloads import LAYER_SHAPES, MODELS, layer_shape, with_layers  # noqa: E402
from mlx_moe_plan.nn import SwitchGLU, patch_model  # noqa: E402


def small_model(name="small-qwen3-moe", layers=2):
    config = with_layers(MODELS[name], layers)
    model, _ = bench.random_model(config, dtype=mx.float32, bits=None, group_size=64)
    return model


def test_shared_copy_shares_weights_and_patches_alone():
    model = small_model()
    patched = bench.shared_copy(model)
    assert patch_model(patched) == 2
    # The original keeps mlx-lm's layers; both hold the very same arrays.
    assert sum(isinstance(m, switch_layers.SwitchGLU) for _, m in model.named_modules()) == 2
    assert not any(isinstance(m, SwitchGLU) for _, m in model.named_modules())
    ours, theirs = dict(tree_flatten(patched.parameters())), dict(tree_flatten(model.parameters()))
    assert ours.keys() == theirs.keys()
    assert all(ours[k] is theirs[k] for k in ours)


def test_restored_cache_decodes_the_same_step():
    model = small_model()
    cache = make_prompt_cache(model)
    model(mx.array(np.random.default_rng(1).integers(0, 4096, (2, 9))), cache=cache)
    mx.eval([c.state for c in cache])
    saved = bench.snapshot(cache)
    token = mx.array([[3], [5]])
    first = model(token, cache=cache)
    mx.eval(first)
    model(token, cache=cache)  # a step more, overwriting the cache's arrays in place
    bench.restore(cache, saved)
    np.testing.assert_array_equal(np.array(model(token, cache=cache)), np.array(first))


def test_layer_shapes_are_the_models():
    assert LAYER_SHAPES["qwen3-30b-a3b"] == layer_shape(MODELS["qwen3-30b-a3b"])
    assert (LAYER_SHAPES["mixtral"].experts, LAYER_SHAPES["mixtral"].top_k) == (8, 2)
    assert with_layers(MODELS["deepseek-v3"], 4)["first_k_dense_replace"] == 1
    assert len(with_layers(MODELS["gpt-oss-20b"], 3)["layer_types"]) == 3


def test_model_benchmark_end_to_end(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert bench.main(["--layers", "1", "--prompt", "20", "--batches", "1,20",
                       "--context", "8", "--steps", "2", "--warmup", "1", "--rounds", "1",
                       "--decode-rounds", "1",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (entry,) = result["models"]
    assert entry["name"] == "small-qwen3-moe" and entry["describe"]["patched_layers"] == 1
    # float32 on the CPU: mlx-lm's own call below 64 entries, the same GEMMs
    # on sorted rows above (batch 20, K 4): the same logits, bit for bit.
    assert entry["prefill"]["logits_rel_diff"] == 0
    assert [d["batch"] for d in entry["decode"]] == [1, 20]
    for row in entry["decode"]:
        assert row["logits_rel_diff"] == 0
        assert row["patched_wall_ms"] >= row["patched_build_ms"] > 0
        assert row["mlx-lm_wall_ms"] >= row["mlx-lm_build_ms"] > 0
    assert "speedup" in capsys.readouterr().out
