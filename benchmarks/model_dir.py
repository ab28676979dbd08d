"""An mlx-lm model directory of a real configuration with random weights.

    python -m benchmarks.model_dir qwen3-30b-a3b OUT_DIR [--layers N] [--bits 4]

For mlx-lm's own commands, which load a model from disk: `mlx_lm benchmark
--model OUT_DIR` against `python -m mlx_moe_plan.lm benchmark --model OUT_DIR`
(`tests/gpu_suite.sh`, step `lm`). The directory is what mlx-lm's `load`
reads from a converted checkpoint: `config.json` and safetensors written by
mlx-lm's own `save_config` and `save_model` (4-bit by its `quantize_model`,
so the config carries its `quantization` entry), and a word-level tokenizer
made here with the `tokenizers` library, offline, one made-up word per token
id so that every id the model can produce decodes. The tests' small model
directories (`tests/lm_fixtures.py`) use the same tokenizer writer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

from .model import DEFAULT_LAYERS_HELP, add_quantization_arguments, progress, random_model
from .workloads import DEFAULT_LAYERS, MODELS, with_layers

# Special tokens first; the chat template marks turns with the first two, and
# "<|im_end|>" ends a turn, so it is the end-of-sequence token.
SPECIAL_TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{{ message['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def write_tokenizer(path: Path, vocabulary: list[str]) -> None:
    """A word-level tokenizer over `vocabulary` (`SPECIAL_TOKENS` first), with
    a chat template and an end-of-sequence token: tokenizer.json and its config."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocabulary)},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
              "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "bos_token": None,
              "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_model_dir(out: Path, config: dict, *, dtype: mx.Dtype, bits: int | None,
                    group_size: int) -> Path:
    """mlx-lm's model of `config`, random, saved as a model directory at `out`."""
    from mlx_lm.utils import save_config, save_model

    model, config = random_model(config, dtype=dtype, bits=bits, group_size=group_size)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    vocabulary = SPECIAL_TOKENS + [f"w{i}" for i in range(len(SPECIAL_TOKENS),
                                                           config["vocab_size"])]
    save_config(dict(config, eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN)), out / "config.json")
    write_tokenizer(out, vocabulary)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model_dir",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=list(MODELS), help="a configuration of workloads.py")
    parser.add_argument("out", type=Path, help="the directory to write")
    parser.add_argument("--layers", type=int, help="decoder layers " + DEFAULT_LAYERS_HELP)
    parser.add_argument("--dtype", default="bfloat16",
                        help="unquantized weights (default: %(default)s)")
    add_quantization_arguments(parser)
    args = parser.parse_args(argv)
    config = with_layers(MODELS[args.name], args.layers or DEFAULT_LAYERS.get(args.name))
    progress(f"writing {args.name} ({config['num_hidden_layers']} layers) to {args.out}")
    write_model_dir(args.out, config, dtype=getattr(mx, args.dtype), bits=args.bits or None,
                    group_size=args.group_size)
    progress("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
