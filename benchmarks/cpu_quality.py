"""What the CPU fast mode costs in quality, against the exact float32 path on the same GGUF.

Run from the repo root: `python -m benchmarks.cpu_quality [--model FILE.gguf] [--out DIR]`.

Both paths read the fixed text `benchmarks/data/public_domain.txt` in one teacher-forced
prefill and give next-token distributions at every position; reported:
  kl_mean        mean KL(float32 || fast) of the next-token distributions, in nats
  ppl_float32    perplexity of the text under the float32 path
  ppl_fast       the same under the fast mode (the issue's bound: within 2% of float32's)
  top1_agreement share of positions whose most likely next token is the same: the first
                 greedy token each prefix of the text would get
The CI test `tests/model/test_gguf_fast_mode.py` holds the default model to bounds on these.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import set_forward_context
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_ref import TorchRefBackend
from pagedserve.model.decoder import Decoder

TEXT = Path(__file__).parent / "data" / "public_domain.txt"


@torch.no_grad()
def text_logits(model: Decoder, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """float32 logits [len(ids), vocab] of one prefill over `ids` in a scratch paged cache
    (the model's own caches, if any are bound, are put back afterwards)."""
    c = model.config
    num = len(ids)
    blocks = -(-num // block_size)
    shape = (blocks + 1, block_size, c.num_kv_heads, c.head_dim)  # block 0: the null block
    layers = model.attention_layers()
    saved = [(layer.k_cache, layer.v_cache) for layer in layers]
    dtype = model.embed_tokens.weight.dtype
    for layer in layers:
        layer.k_cache, layer.v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape,
                                                                                     dtype=dtype)
    meta = AttentionMetadata(
        num_decodes=0, num_decode_tokens=0,
        slot_mapping=torch.arange(num, dtype=torch.int64) + block_size,
        block_tables=torch.arange(1, blocks + 1, dtype=torch.int32)[None],
        seq_lens=torch.tensor([num], dtype=torch.int32),
        query_start_loc=torch.tensor([0, num], dtype=torch.int32),
        max_query_len=num, max_seq_len=num)
    try:
        with set_forward_context(meta, TorchRefBackend()):
            hidden = model(torch.tensor(ids), torch.arange(num))
        return model.compute_logits(hidden).float()
    finally:
        for layer, (k, v) in zip(layers, saved):
            layer.k_cache, layer.v_cache = k, v


def compare(reference: torch.Tensor, other: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """Quality of `other` logits against `reference` ones, both [len(ids), vocab]."""
    targets = torch.tensor(ids[1:])[:, None]
    ref, oth = F.log_softmax(reference[:-1], -1), F.log_softmax(other[:-1], -1)
    kl = (ref.exp() * (ref - oth)).sum(-1)
    return {
        "tokens": len(ids) - 1,
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "ppl_float32": math.exp(-ref.gather(1, targets).mean().item()),
        "ppl_fast": math.exp(-oth.gather(1, targets).mean().item()),
        "top1_agreement": (ref.argmax(-1) == oth.argmax(-1)).float().mean().item(),
    }


def text_ids(tokenizer) -> list[int]:
    return tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]


def measure(model_path: str | None) -> dict[str, float]:
    from pagedserve.model.loader import load_model, load_tokenizer

    exact, _, source = load_model(model_path, torch.float32, "cpu")
    ids = text_ids(load_tokenizer(source))
    reference = text_logits(exact, ids)
    del exact
    fast, _, _ = load_model(model_path, torch.float32, "cpu", quantized=True)
    return compare(reference, text_logits(fast, ids), ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file; default: SmolLM2-135M")
    parser.add_argument("--out", type=Path, default=None, help="write quality.json here")
    args = parser.parse_args()
    result = measure(args.model)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quality.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
