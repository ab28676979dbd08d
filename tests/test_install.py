# Installing the layer the two supported ways: `patch_model` on a built model
# (twice: the second call changes nothing), and mlx-lm's
# `switch_layers.SwitchGLU` replaced by ours before models are built, for
# every model family of the installed mlx-lm that builds a SwitchGLU. Each
# family is built small (2 layers, 4 for llama4; widths of 16 to 64) with
# random weights, unpatched and installed, and gives the same logits.

from __future__ import annotations

import copy
import importlib
import inspect
import pkgutil
import warnings

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm", reason="mlx-lm is the reference of the layer tests")
from mlx_lm import models as mlx_lm_models  # noqa: E402
from mlx_lm.models import switch_layers  # noqa: E402
from test_nn import make_model, tree_map_random  # noqa: E402  (beside this file)

from mlx_moe_plan import nn as moe_nn  # noqa: E402
from mlx_moe_plan.nn import SwitchGLU, patch_model  # noqa: E402

# What every family's ModelArgs may read, small; each family's own fields below.
_SMALL = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, intermediate_size=64,
              moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rms_norm_eps=1e-5, norm_eps=1e-5, layer_norm_epsilon=1e-5,
              rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
              num_experts=8, n_routed_experts=8, num_local_experts=8, num_experts_per_tok=2,
              first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[],
              n_shared_experts=1, num_shared_experts=1, moe_layer_freq=1,
              norm_topk_prob=True, shared_expert_intermediate_size=32, kv_lora_rank=32,
              q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
              n_group=1, topk_group=1, routed_scaling_factor=1.0, attention_bias=False,
              sliding_window=8, layer_types=["sliding_attention", "full_attention"])
FAMILY_FIELDS = {
    "ernie4_5_moe": dict(use_bias=False, moe_num_experts=8, moe_k=2),
    "minimax": dict(shared_intermediate_size=32, rotary_dim=8),
    "step3p5": dict(num_attention_groups=2),
    "lfm2_moe": dict(use_expert_bias=True, num_dense_layers=0, conv_bias=True, conv_L_cache=3,
                     full_attn_idxs=[1]),
    "glm4_moe": dict(rope_scaling=None, use_qk_norm=False, partial_rotary_factor=0.5),
    "granitemoe": dict(logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0,
                       residual_multiplier=1.0),
    "qwen3_next": dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       partial_rotary_factor=0.25, full_attention_interval=2),
    "bailing_moe_linear": dict(layer_group_size=2, group_norm_size=1),
    "bailing_hybrid": dict(layer_group_size=2, group_norm_size=1),
    "exaone_moe": dict(is_moe_layer=[True, True]),
    "afmoe": dict(num_dense_layers=0),
    "deepseek_v2": dict(rope_scaling={"type": "yarn", "factor": 1.0}),
    "granitemoehybrid": dict(logits_scaling=1.0, attention_multiplier=0.25,
                             embedding_multiplier=1.0, residual_multiplier=1.0,
                             layer_types=["mamba", "attention"], shared_intermediate_size=32,
                             mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                             mamba_d_state=8, mamba_d_conv=4, mamba_proj_bias=False,
                             mamba_conv_bias=True),
    "hunyuan": dict(moe_topk=2, num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True,
                    use_cla=True, cla_share_factor=2,
                    rope_scaling={"type": "dynamic", "factor": 1.0, "alpha": 1.0}),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=0,
                  expert_layer_period=1, mamba_d_conv=4, mamba_d_state=8, mamba_expand=2),
    "kimi_linear": dict(linear_attn_config={"kda_layers": [1], "num_heads": 4, "head_dim": 16,
                                            "short_conv_kernel_size": 4},
                        model_max_length=256, num_experts_per_token=2, mla_use_nope=True),
    "longcat_flash": dict(attention_method="MLA", num_layers=2, ffn_hidden_size=64,
                          expert_ffn_hidden_size=32, moe_topk=2, zero_expert_type="identity",
                          zero_expert_num=2, mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "mellum": dict(rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                                    "full_attention": {"rope_theta": 10000.0}}),
    "mimo_v2_flash": dict(hybrid_layer_pattern=[1, 0], moe_layer_freq=[1, 1],
                          sliding_window_size=8, add_swa_attention_sink_bias=True,
                          add_full_attention_sink_bias=False, topk_method="noaux_tc",
                          scoring_func="sigmoid", layernorm_epsilon=1e-5,
                          partial_rotary_factor=0.5, swa_rope_theta=10000.0,
                          swa_num_attention_heads=4, swa_num_key_value_heads=2,
                          swa_head_dim=16, swa_v_head_dim=16),
    # Mistral 4 reads both its rope (yarn here) and its Llama 4 scaling of the
    # queries from rope_parameters, which it has no default for.
    "mistral4": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 64,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}),
    # No layer shares keys and values: a sharing layer takes them from an earlier
    # layer of its attention kind, which two layers, one of each, lack. The
    # per-layer input table is the small vocabulary's, not 262144 rows.
    "gemma4_text": dict(enable_moe_block=True, top_k_experts=2, num_kv_shared_layers=0,
                        global_head_dim=32, vocab_size_per_layer_input=64,
                        hidden_size_per_layer_input=8),
    # The families below take these fields as their text_config. Kimi K3's
    # optional latent experts (a narrower width between two projections) and
    # attention residuals (each layer's input a learned mix of earlier blocks')
    # are on, so the layer is checked on those paths too.
    "kimi_k3": dict(linear_attn_config={"kda_layers": [1], "num_heads": 4, "head_dim": 16,
                                        "short_conv_kernel_size": 4},
                    num_experts_per_token=2, routed_expert_hidden_size=32,
                    latent_moe_use_norm=True, attn_res_block_size=1, mla_use_output_gate=True),
    # Llama 4 attends globally every 4th layer and finds that layer's mask at
    # index 3 whatever the depth: 4 layers, every second one MoE. Its MoE routes
    # each token to one expert only.
    "llama4": dict(num_hidden_layers=4, interleave_moe_layer_step=2, num_experts_per_tok=1,
                   attention_chunk_size=8, intermediate_size_mlp=64, rope_scaling=None,
                   use_qk_norm=True),
    # MiniMax M3 reads moe_layer_freq per layer, and attends sparsely (to the
    # key blocks an indexer picks) in each layer not of full attention, the first.
    "minimax_m3_vl": dict(moe_layer_freq=[1, 1], shared_intermediate_size=32,
                          dense_intermediate_size=64,
                          sparse_attention_config={"sparse_num_index_heads": 2,
                                                   "sparse_index_dim": 16,
                                                   "sparse_block_size": 4,
                                                   "sparse_topk_blocks": 2,
                                                   "sparse_local_block": 1}),
    # Muse Spark's experts run at moe_hidden_size between two projections; a
    # rope theta of 0 makes its second layer one without RoPE.
    "muse_spark": dict(post_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0},
                       layer_rope_theta=[10000.0, 0], final_logit_softcapping=30.0,
                       output_multiplier=1.0, moe_hidden_size=32, num_shared_experts=0),
}

# Families whose mlx-lm model calls its own Metal kernels (mlx_lm.kernels, made
# with mx.fast.metal_kernel) with no other path: muse_spark's qk norm and rope,
# pre-norms, expert routing and expert combine. Only MLX's Metal back-end runs them.
METAL_KERNEL_FAMILIES = {"muse_spark"}


def _families() -> list[str]:
    """mlx-lm's model modules that build a SwitchGLU."""
    found = []
    for info in pkgutil.iter_modules(mlx_lm_models.__path__):
        spec = importlib.util.find_spec(f"mlx_lm.models.{info.name}")
        if info.name != "switch_layers" and "SwitchGLU" in spec.loader.get_source(spec.name):
            found.append(info.name)
    return found


def _small_config(module, name: str) -> dict:
    """The family's small config, nested as `text_config` where its ModelArgs
    wraps a text model's (the VLM and multimodal families)."""
    config = dict(_SMALL, model_type=name, **FAMILY_FIELDS.get(name, {}))
    if "text_config" in inspect.signature(module.ModelArgs).parameters:
        return dict(model_type=name, text_config=config)
    return config


def _build(module, name: str):
    args = module.ModelArgs.from_dict(_small_config(module, name))
    mx.random.seed(3)
    return module.Model(args)


def test_families_are_found():
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"} <= set(_families())


@pytest.mark.parametrize("name", _families())
def test_replaced_switch_glu_gives_mlx_lms_logits(name, monkeypatch):
    if name in METAL_KERNEL_FAMILIES and not mx.metal.is_available():
        pytest.skip(f"{name}: runs mlx-lm's Metal kernels (mlx_lm.kernels), and this MLX has "
                    "no Metal back-end")
    module = importlib.import_module(f"mlx_lm.models.{name}")
    try:
        theirs = _build(module, name)
    except Exception as error:  # noqa: BLE001  a family needing more than the fields above
        pytest.skip(f"{name}: no small configuration here ({type(error).__name__}: {error})")
    if not any(isinstance(m, switch_layers.SwitchGLU) for _, m in theirs.named_modules()):
        pytest.skip(f"{name}: the small configuration has no MoE layer")
    theirs.update(tree_map_random(theirs.parameters()))
    mx.eval(theirs.parameters())
    try:
        mx.eval(theirs(mx.array([[1, 2]])))
    except Exception as error:  # noqa: BLE001  a family needing more than the fields above
        pytest.skip(f"{name}: the small configuration does not run ({type(error).__name__}: "
                    f"{error})")
    # The family module bound mlx-lm's class at its own import: replace it there too.
    monkeypatch.setattr(switch_layers, "SwitchGLU", SwitchGLU)
    monkeypatch.setattr(module, "SwitchGLU", SwitchGLU)
    ours = _build(module, name)
    monkeypatch.undo()
    ours.update(theirs.parameters())
    assert sum(isinstance(m, SwitchGLU) for _, m in ours.named_modules()) > 0
    assert not any(isinstance(m, switch_layers.SwitchGLU) for _, m in ours.named_modules())
    rng = np.random.default_rng(4)
    for length in (5, 40):  # K * T below and above mlx-lm's sort threshold
        tokens = mx.array(rng.integers(0, 64, (1, length)))
        want, got = theirs(tokens), ours(tokens)
        if length == 5 and mx.default_device().type == mx.cpu:  # mlx-lm's own call: its bits
            np.testing.assert_array_equal(np.array(got), np.array(want), err_msg=name)
        elif length == 5:
            # On a GPU MLX's compiled graphs fuse their elementwise operations
            # into kernels of their own, whose rounding can differ from the
            # same operations run one by one: gemma4_text's (GeGLU, a compiled
            # tanh GELU) came 1.8e-7 apart on an H100, its bits equal with
            # MLX_DISABLE_COMPILE=1. Within float32's rounding there.
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6,
                                       err_msg=name)
        else:
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4,
                                       err_msg=name)


def test_patching_twice_changes_nothing_and_says_so():
    model = make_model("qwen3_moe", quantized=False)
    assert patch_model(model, tile_m=8) == 2
    before = copy.copy(dict(model.named_modules()))
    with pytest.warns(UserWarning, match="patched already"):
        assert patch_model(model, tile_m=16) == 0
    after = dict(model.named_modules())
    assert after.keys() == before.keys()
    assert all(after[path] is module for path, module in before.items())
    assert {m.tile_m for m in after.values() if isinstance(m, SwitchGLU)} == {8}


def test_patching_a_model_built_with_the_layer_fuses_it_silently(monkeypatch):
    # Built with switch_layers.SwitchGLU replaced: nothing to replace, the
    # blocks to fuse; then a second call warns.
    module = importlib.import_module("mlx_lm.models.qwen3_moe")
    monkeypatch.setattr(module, "SwitchGLU", SwitchGLU)
    model = make_model("qwen3_moe", quantized=False)
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert patch_model(model) == 0
    assert sum(isinstance(m, moe_nn.FusedMoEBlock) for _, m in model.named_modules()) == 2
    with pytest.warns(UserWarning, match="patched already"):
        assert patch_model(model) == 0


def test_tile_m_given_to_layers_of_ours_is_not_applied_and_said(monkeypatch):
    # Built with the layer, its blocks still to fuse: the call fuses them and
    # says that its tile_m did not reach the layers, which keep theirs.
    module = importlib.import_module("mlx_lm.models.qwen3_moe")
    monkeypatch.setattr(module, "SwitchGLU", SwitchGLU)
    model = make_model("qwen3_moe", quantized=False)
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="tile_m=16 not applied"):
        assert patch_model(model, tile_m=16) == 0
    assert sum(isinstance(m, moe_nn.FusedMoEBlock) for _, m in model.named_modules()) == 2
    assert {m.tile_m for _, m in model.named_modules() if isinstance(m, SwitchGLU)} == {None}


def test_a_model_without_moe_layers_is_not_warned_about():
    import mlx.nn as nn

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert patch_model(nn.Sequential(nn.Linear(8, 8))) == 0
