"""Small mlx-lm model directories on disk, made offline, for the command tests.

Each directory is what mlx-lm's `load` reads from a converted checkpoint:
`config.json`, `model.safetensors` (plus its index) written by mlx-lm's own
`save_model` and `save_config`, 4-bit ones quantized by its `quantize_model`
(so the config carries its `quantization` entry), and a tokenizer built here
with the `tokenizers` library: a word-level vocabulary with a chat template
and an end-of-sequence token (`benchmarks.model_dir.write_tokenizer`, which
also writes the real configurations' directories), so `generate`, `chat` and
the server's chat completions run on it as on a real model's.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from benchmarks import model_dir
from benchmarks.model_dir import EOS_TOKEN, SPECIAL_TOKENS

WORDS = (
    "the a an of to in on for with and or but not is are was be this that it we you "
    "they model expert experts token tokens route router layer layers weight weights "
    "sum plan gather combine sort row rows tile tiles fast slow prefill decode batch "
    "user assistant system hello world"
).split()
VOCABULARY = SPECIAL_TOKENS + WORDS
VOCAB_SIZE = len(VOCABULARY)

# The models' width, and the quantization group of the 4-bit ones.
HIDDEN_SIZE = 64
GROUP_SIZE = 32
_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
               eos_token_id=VOCABULARY.index(EOS_TOKEN), tie_word_embeddings=False)
# Two layers each, every one an MoE layer; widths of 32 and more, so 4-bit
# quantization (group size 32) reaches every projection.
CONFIGS = {
    "qwen3_moe": dict(_COMMON, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                      num_hidden_layers=2, intermediate_size=96, num_experts=16,
                      num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[],
                      moe_intermediate_size=32, head_dim=16, max_position_embeddings=512,
                      norm_topk_prob=True),
    "mixtral": dict(_COMMON, model_type="mixtral", architectures=["MixtralForCausalLM"],
                    num_hidden_layers=2, intermediate_size=64, num_local_experts=8,
                    num_experts_per_tok=2),
    "gpt_oss": dict(_COMMON, model_type="gpt_oss", architectures=["GptOssForCausalLM"],
                    num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=64, head_dim=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
    # No MoE layer at all: the commands run it unpatched and say so.
    "llama": dict(_COMMON, model_type="llama", architectures=["LlamaForCausalLM"],
                  num_hidden_layers=2, intermediate_size=96, head_dim=16),
}
# Seeds of the random weights whose greedy text varies from token to token
# (some seeds repeat one word), so that a changed logit would show.
WEIGHT_SEEDS = {"qwen3_moe": 3}
# Routed experts a token (K) of each MoE configuration.
TOP_K = {"qwen3_moe": 4, "mixtral": 2, "gpt_oss": 2}


def write_tokenizer(path: Path) -> None:
    """A word-level tokenizer over `VOCABULARY`: tokenizer.json and its config."""
    model_dir.write_tokenizer(path, VOCABULARY)


def write_model(path: Path, name: str, *, bits: int | None = None,
                seed: int | None = None, config: dict | None = None) -> Path:
    """Build mlx-lm's `name` model from `CONFIGS`, with random weights, and save it.

    Float32 weights, normal with standard deviation 0.2 (biases too, so no
    term is zero), or quantized to `bits` by mlx-lm's `quantize_model` with
    group size 32. `seed`: default `WEIGHT_SEEDS[name]`, else 0. `config`:
    the configuration instead of `CONFIGS[name]`. Returns `path`.
    """
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    config = dict(CONFIGS[name] if config is None else config)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(WEIGHT_SEEDS.get(name, 0) if seed is None else seed)
    model.update(tree_map(
        lambda p: mx.array(rng.standard_normal(p.shape).astype(np.float32) * 0.2)
        if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))
    if bits is not None:
        model, config = quantize_model(model, config, group_size=GROUP_SIZE, bits=bits)
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    write_tokenizer(path)
    return path


def write_adapter(path: Path, model_path: Path, *, seed: int = 1) -> Path:
    """LoRA adapters for the model at `model_path`, random, as mlx-lm's `lora` saves them.

    Random `lora_b` as well as `lora_a` (training starts it at zero), so the
    adapters change the output. Returns `path`.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(model_path)
    config = {"fine_tune_type": "lora", "num_layers": 2,
              "lora_parameters": {"rank": 4, "scale": 1.0, "dropout": 0.0}}
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"])
    rng = np.random.default_rng(seed)
    adapters = {name: mx.array(rng.standard_normal(value.shape).astype(np.float32) * 0.2)
                for name, value in tree_flatten(model.parameters())
                if name.rpartition(".")[2] in ("lora_a", "lora_b")}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), adapters)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path
