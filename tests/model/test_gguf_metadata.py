"""GGUF metadata -> ModelConfig where the metadata is implicit (what llama.cpp's runtime assumes
for Gemma and Phi-3 files), and the architectures and options we cannot run, refused by name.

The files here hold metadata and an embedding only: `read_config` never needs the weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter

from pagedserve.model import load_model
from pagedserve.model.gguf import read_config

BASE = {"block_count": 2, "context_length": 128, "embedding_length": 64,
        "feed_forward_length": 96, "attention.head_count": 4, "attention.head_count_kv": 2,
        "attention.key_length": 16}


def metadata_gguf(path, arch: str, keys: dict, tensors: tuple[str, ...] = ()):
    """A GGUF of `arch` with BASE's shape, `keys` (`<arch>.` names) added or overriding."""
    writer = GGUFWriter(str(path), arch)
    for name, value in {**BASE, **keys}.items():
        key = f"{arch}.{name}"
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    for name in tensors:
        writer.add_tensor(name, np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def config_of(tmp_path, arch: str, keys: dict, tensors: tuple[str, ...] = ()):
    path = metadata_gguf(tmp_path / f"{arch}.gguf", arch, keys, tensors)
    return read_config(GGUFReader(path), path)


def windows(config) -> list[int | None]:
    return [config.layer_window(i) for i in range(config.num_layers)]


def test_gemma2_pattern_and_27b_score_scale(tmp_path):
    """Gemma 2 alternates local and global layers; the 27B shape (46 layers) scales scores by
    (hidden / heads) ** -0.5 = 144 ** -0.5, not head_dim ** -0.5, as llama.cpp does."""
    config = config_of(tmp_path, "gemma2", {
        "block_count": 46, "embedding_length": 4608, "attention.head_count": 32,
        "attention.head_count_kv": 16, "attention.key_length": 128,
        "attention.sliding_window": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0})
    assert windows(config) == [4096, None] * 23
    assert config.scale == pytest.approx(144**-0.5)
    assert (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    assert config.norm_unit_offset and config.sandwich_norms and config.hidden_act == "gelu_tanh"
    small = config_of(tmp_path, "gemma2", {"block_count": 26, "attention.sliding_window": 4096})
    assert small.scale == pytest.approx(16**-0.5)


def test_gemma3_pattern_local_base_and_no_window(tmp_path):
    config = config_of(tmp_path, "gemma3", {"block_count": 8, "attention.sliding_window": 512,
                                            "rope.freq_base": 1e6})
    assert windows(config) == [512] * 5 + [None] + [512] * 2
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 10000.0)
    stated = config_of(tmp_path, "gemma3", {"attention.sliding_window": 512,
                                            "attention.sliding_window_pattern": [False, True],
                                            "rope.freq_base_swa": 100.0})
    assert windows(stated) == [None, 512] and stated.local_rope_theta == 100.0
    # the converter writes no window for a Gemma 3 whose layers are all global
    global_only = config_of(tmp_path, "gemma3", {})
    assert windows(global_only) == [None, None] and global_only.local_rope_theta is None


def test_window_zero_is_none_and_qwen_windows_are_ignored(tmp_path):
    assert windows(config_of(tmp_path, "phi3", {"attention.sliding_window": 0})) == [None] * 2
    assert windows(config_of(tmp_path, "llama", {"attention.sliding_window": 5})) == [5] * 2
    assert windows(config_of(tmp_path, "qwen2", {"attention.sliding_window": 5})) == [None] * 2


def test_moe_routing_from_metadata(tmp_path):
    moe = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32}
    qwen = config_of(tmp_path, "qwen3moe", moe)
    assert (qwen.family, qwen.num_experts, qwen.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert qwen.moe_intermediate_size == 32 and qwen.norm_topk_prob  # llama.cpp renormalises
    assert not config_of(tmp_path, "qwen3moe", {**moe, "expert_weights_norm": False}).norm_topk_prob
    mixtral = config_of(tmp_path, "llama", {"expert_count": 8, "expert_used_count": 2})
    assert mixtral.family == "mixtral" and mixtral.moe_intermediate_size == 96


@pytest.mark.parametrize("arch,keys,tensors,message", [
    ("gemma", {}, (), "unsupported GGUF architecture 'gemma'"),
    ("qwen2moe", {}, (), "unsupported GGUF architecture 'qwen2moe'"),
    ("gemma2", {}, (), "Gemma 2 model needs gemma2.attention.sliding_window"),
    ("llama", {"rope.scaling.type": "xpos"}, (), "unsupported rope scaling type 'xpos'"),
    ("llama", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
               "rope.scaling.yarn_log_multiplier": 0.1}, (),
     "rope.scaling.yarn_log_multiplier = 0.1"),
    ("phi3", {"rope.scaling.type": "longrope"}, (), "longrope scaling without its factor"),
    ("llama", {"rope.dimension_count": 8}, (), "partial rotary"),
    ("llama", {"attention.key_length": 32}, ("rope_freqs.weight",),
     "rope_freqs with 8 factors for head_dim 32"),
    ("qwen3moe", {"expert_count": 4, "expert_used_count": 2, "expert_shared_count": 1}, (),
     "expert_shared_count = 1 is not supported"),
    ("llama", {"expert_count": 4, "expert_used_count": 2, "expert_gating_func": 2}, (),
     "expert_gating_func = 2 is not supported"),
    ("qwen3moe", {"expert_count": 4, "expert_used_count": 2}, ("blk.1.ffn_up.weight",),
     "dense layers among the MoE layers"),
    ("gemma3", {"attention.sliding_window": 4, "attention.sliding_window_pattern": [True]}, (),
     "1 entries for 2 layers"),
])
def test_unsupported_gguf_is_refused_by_name(tmp_path, monkeypatch, arch, keys, tensors,
                                             message):
    monkeypatch.setenv("PAGEDSERVE_CACHE", "0")
    path = metadata_gguf(tmp_path / "model.gguf", arch, keys, tensors)
    with pytest.raises(ValueError, match=message):
        load_model(path, torch.float32, "cpu")
