"""The models every benchmark measures, in one table.

Each entry is an mlx-lm configuration, as its checkpoint's `config.json` gives
it (the fields mlx-lm's `ModelArgs` reads). `benchmarks.model` builds the whole
model from it with random weights; the layer and op benchmarks take their MoE
shapes from it (`layer_shape`), so the four shapes are written once.
"""

from __future__ import annotations

from dataclasses import dataclass

_QWEN3 = dict(vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=False,
              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)

MODELS: dict[str, dict] = {
    "qwen3-30b-a3b": dict(
        _QWEN3, model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
        intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        rope_theta=1e6, max_position_embeddings=40960),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", num_hidden_layers=24, num_local_experts=32,
        num_experts_per_tok=4, vocab_size=201088, rms_norm_eps=1e-5, hidden_size=2880,
        intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
        sliding_window=128, rope_theta=150000,
        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                          original_max_position_embeddings=4096, truncate=False),
        layer_types=["sliding_attention", "full_attention"] * 12),
    "qwen3-next-80b-a3b": dict(
        _QWEN3, model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48,
        intermediate_size=5120, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
        num_experts_per_tok=10, shared_expert_intermediate_size=512,
        moe_intermediate_size=512, rope_theta=1e7, partial_rotary_factor=0.25,
        max_position_embeddings=262144, full_attention_interval=4),
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_experts_per_tok=2,
        num_key_value_heads=8, num_local_experts=8, rms_norm_eps=1e-5, rope_theta=1e6),
    # 61 layers of 6 GB each at 4 bits: the benchmark takes 4 unless told
    # (DEFAULT_LAYERS), the first dense as in the checkpoint's first three.
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, n_group=8, topk_group=4,
        num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3,
        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=dict(type="yarn", factor=40, beta_fast=32, beta_slow=1, mscale=1.0,
                          mscale_all_dim=1.0, original_max_position_embeddings=4096)),
    # Not a real model: Qwen3-MoE's code at a size a 2-core CPU decodes in
    # milliseconds, the whole-model benchmark's default there.
    "small-qwen3-moe": dict(
        _QWEN3, model_type="qwen3_moe", vocab_size=4096, hidden_size=256,
        num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=128, rope_theta=1e6, max_position_embeddings=4096),
}

# Layers the whole-model benchmark builds where the full depth does not fit a
# GPU in random bfloat16 and 4-bit weights (--layers overrides).
DEFAULT_LAYERS = {"deepseek-v3": 4}


def with_layers(config: dict, layers: int | None) -> dict:
    """`config` with `layers` decoder layers (all of them if None)."""
    config = dict(config)
    if layers is not None:
        config["num_hidden_layers"] = layers
        if "layer_types" in config:  # gpt-oss: the pattern, cut or repeated
            pattern = config["layer_types"]
            config["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
        if "first_k_dense_replace" in config:  # DeepSeek-V3: a quarter dense, one at most 3
            config["first_k_dense_replace"] = min(config["first_k_dense_replace"],
                                                  max(layers // 4, 1 if layers > 1 else 0))
    return config


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer's expert work: D, I, E, K."""

    hidden: int  # D
    intermediate: int  # I
    experts: int  # E
    top_k: int  # K


def layer_shape(config: dict) -> LayerShape:
    """The MoE layer shape of an mlx-lm configuration."""
    experts = config.get("num_experts") or config.get("num_local_experts") or \
        config["n_routed_experts"]
    intermediate = config.get("moe_intermediate_size") or config["intermediate_size"]
    return LayerShape(config["hidden_size"], intermediate, experts,
                      config["num_experts_per_tok"])


# The layer and op benchmarks' shapes, by their short names.
LAYER_SHAPES: dict[str, LayerShape] = {
    "qwen3-next": layer_shape(MODELS["qwen3-next-80b-a3b"]),
    "qwen3-30b-a3b": layer_shape(MODELS["qwen3-30b-a3b"]),
    "deepseek-v3": layer_shape(MODELS["deepseek-v3"]),
    "mixtral": layer_shape(MODELS["mixtral-8x7b"]),
}
