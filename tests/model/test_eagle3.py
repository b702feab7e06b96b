"""EAGLE-3 on the decoder: the target's captured residual streams are transformers' hidden
states of those layers, and a head in the published layout (tests/spec/heads.py) computes,
through the paged cache, what a dense reference written from the layout computes: fc over
the three streams, attention over concat(norm(embedding), hidden_norm(state)), the fused
state as the residual, the final norm, lm_head over the draft vocabulary and d2t (read from
a pytorch_model.bin, as the EAGLE authors ship heads)."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from pagedserve.attention.backend import set_forward_context
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_ref import TorchRefBackend
from pagedserve.model import load_model
from pagedserve.model.eagle3 import load_eagle3
from pagedserve.model.ops import select_ops
from tests.model.test_decoder import TINY, make_checkpoint
from tests.spec.heads import write_eagle3_head

T = 6  # one sequence, one prefill


def one_sequence(layers, block_size: int = 4) -> AttentionMetadata:
    """Caches for `layers` and the metadata of a T-token prefill over blocks 1, 2."""
    for layer in layers:
        shape = (3, block_size, layer.num_kv_heads, layer.head_dim)
        layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
    return AttentionMetadata(
        num_decodes=0, num_decode_tokens=0, slot_mapping=torch.arange(T) + block_size,
        block_tables=torch.tensor([[1, 2]], dtype=torch.int32),
        seq_lens=torch.tensor([T], dtype=torch.int32),
        query_start_loc=torch.tensor([0, T], dtype=torch.int32), max_query_len=T,
        max_seq_len=T)


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta=10000.0):
    """Llama's rotate-half RoPE at positions 0..T-1; x [T, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = torch.outer(torch.arange(T).float(), inv)
    cos = torch.cat([angles.cos()] * 2, -1)[:, None]
    sin = torch.cat([angles.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


def reference(w: dict, ids: torch.Tensor, streams: torch.Tensor, embed: torch.Tensor,
              heads: int = 4, kv_heads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's final-normed rows and greedy target ids, from the layout's formula."""
    fused = streams @ w["fc.weight"].T
    x = torch.cat([rms(embed[ids], w["midlayer.input_layernorm.weight"]),
                   rms(fused, w["midlayer.hidden_norm.weight"])], -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(T, heads, -1)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(T, kv_heads, -1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(T, kv_heads, -1)
    q, k = rope(q), rope(k)
    k, v = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1)
    residual = fused + out @ w["midlayer.self_attn.o_proj.weight"].T
    h = rms(residual, w["midlayer.post_attention_layernorm.weight"])
    gate, up = (h @ w[f"midlayer.mlp.{name}_proj.weight"].T for name in ("gate", "up"))
    mlp = (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    normed = rms(residual + mlp, w["norm.weight"])
    best = (normed @ w["lm_head.weight"].T).argmax(-1)
    return normed, best + w["d2t"][best]


@torch.no_grad()
def test_captured_streams_and_a_head_match_their_references(tmp_path):
    hf = make_checkpoint(LlamaConfig(**TINY, tie_word_embeddings=False), tmp_path / "target")
    model, config, _ = load_model(tmp_path / "target", torch.float32, "cpu")
    ids = torch.randint(0, TINY["vocab_size"], (T,), generator=torch.Generator().manual_seed(2))
    expected = hf(ids[None], output_hidden_states=True).hidden_states
    backend = TorchRefBackend()
    with set_forward_context(one_sequence(model.attention_layers()), backend):
        _, streams = model.forward_capturing(ids, torch.arange(T), (0, 1, 1))
    for i, layer in enumerate((0, 1, 1)):  # the residual stream entering each layer
        torch.testing.assert_close(streams[:, i * 64:(i + 1) * 64], expected[layer][0])

    target = json.loads((tmp_path / "target" / "config.json").read_text())
    folder = write_eagle3_head(tmp_path / "head", target, [0, 0, 1], 100, head_dim=16,
                               rms_norm_eps=1e-6)
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    # the EAGLE authors' heads ship a pytorch_model.bin
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    head, capture = load_eagle3(folder, config, model.embed_tokens, torch.float32,
                                torch.device("cpu"), select_ops("cpu", torch.float32))
    assert capture == (1, 1, 2)  # the ids name layer outputs: the stream entering id + 1
    with set_forward_context(one_sequence(head.attention_layers()), backend):
        normed, _ = head(ids, torch.arange(T), streams)
    want, tokens = reference(weights, ids, streams, model.embed_tokens.weight)
    torch.testing.assert_close(normed, want)
    assert torch.equal(head.draft_tokens(normed), tokens)
