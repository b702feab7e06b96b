"""Random weights for a config-only folder (load_format dummy): drawn like an initialiser's
N(0, 0.02), different from row to row and tensor to tensor, norms at 1, the same on every
call (tensor parallelism's equality with one rank is tests/distributed's)."""

from __future__ import annotations

import torch

from pagedserve.model import dummy
from pagedserve.model.config import ModelConfig

CONFIG = ModelConfig(family="qwen3", vocab_size=3000, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     rms_norm_eps=1e-6, rope_theta=1e4, max_model_len=64,
                     tie_word_embeddings=True, qk_norm=True)


def weights() -> dict[str, torch.Tensor]:
    return dict(dummy.dummy_weights(CONFIG, torch.float32, torch.device("cpu")))


def test_dummy_weights_look_initialised_and_repeat():
    first, second = weights(), weights()
    assert first.keys() == set(name for name, _ in dummy.tensor_shapes(CONFIG))
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
            continue
        assert abs(tensor.std().item() - dummy.INIT_STD) < 0.2 * dummy.INIT_STD, name
        assert len({tuple(row.tolist()) for row in tensor}) == tensor.shape[0], name
    gate, up = first["layers.0.mlp.gate_proj.weight"], first["layers.0.mlp.up_proj.weight"]
    assert not torch.equal(gate, up)
    embed = first["embed_tokens.weight"]
    assert abs(torch.corrcoef(embed[:2])[0, 1].item()) < 0.2  # neighbouring rows unrelated
