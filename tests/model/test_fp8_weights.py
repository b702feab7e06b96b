"""FP8 weights on the CPU: the quantization math, the reference product, online
quantization at load and FP8 checkpoints in the compressed-tensors layout (written here)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from pagedserve.kernels.fp8_format import FP8_DTYPE
from pagedserve.model import fp8, load_model
from tests.model.paged import PagedDriver
from tests.model.test_decoder import TINY, make_checkpoint

DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_quantize_rows_maps_each_row_max_to_448_and_rounds_to_nearest():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=gen) * torch.logspace(-4, 3, 6)[:, None]
    x[5] = 0
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (6,)
    assert torch.equal(q[:5].float().abs().amax(1), torch.full((5,), 448.0))
    assert not q[5].float().any() and scale[5] > 0  # an all-zero row stays zero, finite
    back = q.float() * scale[:, None]
    # e4m3 keeps 3 mantissa bits: within half a unit, 1/16 of the value (or of 2^-6 x scale)
    assert ((back - x).abs() <= torch.maximum(x.abs(), 2 ** -6 * scale[:, None]) / 16).all()


def test_reference_linear_is_the_product_of_the_dequantized_operands():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 32, generator=gen)
    w = torch.randn(24, 32, generator=gen) * 0.1
    bias = torch.randn(24, generator=gen)
    w_q, w_scale = fp8.quantize_rows(w)
    y = fp8.reference_linear(x, w_q, w_scale, bias)
    assert y.shape == (3, 5, 24)
    x_q, x_scale = fp8.quantize_rows(x.reshape(15, 32))
    expected = ((x_q.double() * x_scale[:, None].double())
                @ (w_q.double() * w_scale[:, None].double()).T + bias.double())
    torch.testing.assert_close(y.reshape(15, 24).double(), expected, rtol=1e-5, atol=1e-5)
    exact = x @ w.T + bias  # and FP8's error stays small against the float product
    assert (y - exact).norm() / exact.norm() < 0.05


def qwen3(folder):
    config = Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False)
    return make_checkpoint(config, folder)


def prompt_logits(model) -> torch.Tensor:
    driver = PagedDriver(model)
    return driver.step({"a": list(range(3, 40))})["a"]


def test_online_quantization_quantizes_each_projection_per_output_row(tmp_path):
    hf = qwen3(tmp_path)
    model, _, _ = load_model(tmp_path, torch.float32, "cpu", quantization="fp8")
    assert model.quantization == "fp8"
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    hf_attn, hf_mlp = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
    fused = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight])
    for linear, source in ((attn.qkv_proj, fused), (mlp.down_proj, hf_mlp.down_proj.weight)):
        q, scale = fp8.quantize_rows(source.detach())
        assert linear.weight.dtype == FP8_DTYPE
        assert torch.equal(linear.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(linear.weight_scale, scale)
    assert model.lm_head.weight.dtype == torch.float32  # the LM head stays in the model dtype
    assert model.embed_tokens.weight.dtype == torch.float32
    reference, _, _ = load_model(tmp_path, torch.float32, "cpu")
    assert reference.quantization is None
    got, want = prompt_logits(model), prompt_logits(reference)
    # 3 mantissa bits per operand through 8 products of a random model: 0.18 here; a wrong
    # scale or shard would be off by O(1)
    assert (got - want).norm() / want.norm() < 0.3


def write_compressed_tensors(hf, folder, per_tensor: str = "o_proj") -> None:
    """hf's weights as llm-compressor saves an FP8 model: dense projections in e4m3 with
    weight_scale per output channel ([out, 1]; `per_tensor` projections per tensor, [1]),
    KV cache scales per layer, the rest in bf16."""
    tensors = {}
    for name, param in hf.state_dict().items():
        proj = name.split(".")[-2]
        if proj in DENSE and name.endswith(".weight"):
            w = param.float()
            if proj == per_tensor:
                scale = w.abs().max() / 448
                tensors[name] = (w / scale).clamp(-448, 448).to(FP8_DTYPE)
                tensors[name + "_scale"] = scale.reshape(1)
            else:
                q, scale = fp8.quantize_rows(w)
                tensors[name], tensors[name + "_scale"] = q, scale[:, None]
            tensors[name.removesuffix("weight") + "input_scale"] = torch.ones(1)  # unused
        else:
            tensors[name] = param.to(torch.bfloat16)
    for i in range(hf.config.num_hidden_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + i)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "dynamic": True}}},
        "ignore": ["lm_head"], "kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                   "strategy": "tensor"}}
    (folder / "config.json").write_text(json.dumps(config))


def test_compressed_tensors_checkpoint_loads_as_written(tmp_path):
    hf = qwen3(tmp_path)
    write_compressed_tensors(hf, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    model, config, _ = load_model(tmp_path, None, "cpu")  # the checkpoint says FP8
    assert model.quantization == "fp8" and config.dtype == torch.bfloat16
    attn = model.layers[0].self_attn
    p = "model.layers.0.self_attn."
    fused = torch.cat([stored[p + f"{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(attn.qkv_proj.weight.view(torch.uint8), fused.view(torch.uint8))
    assert torch.equal(attn.qkv_proj.weight_scale,
                       torch.cat([stored[p + f"{n}_proj.weight_scale"][:, 0] for n in "qkv"]))
    # a per-tensor scale covers every row of its projection
    assert torch.equal(attn.o_proj.weight_scale,
                       stored[p + "o_proj.weight_scale"].expand(attn.o_proj.weight.shape[0]))
    assert attn.checkpoint_kv_scales["k_scale"] == 0.5
    assert model.layers[1].self_attn.checkpoint_kv_scales["v_scale"] == 0.25


def test_fp8_checkpoint_and_online_quantization_give_the_same_model(tmp_path):
    """Per-channel scales from the same float32 weights: the same bytes, the same logits."""
    source, quantized = tmp_path / "float32", tmp_path / "fp8"
    hf = qwen3(source)
    hf.save_pretrained(quantized)
    write_compressed_tensors(hf, quantized, per_tensor="none")
    online, _, _ = load_model(source, torch.bfloat16, "cpu", quantization="fp8")
    loaded, _, _ = load_model(quantized, None, "cpu")
    for a, b in zip(online.dense_linears(), loaded.dense_linears()):
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
        assert torch.equal(a.weight_scale, b.weight_scale)
    assert torch.equal(prompt_logits(online), prompt_logits(loaded))


@pytest.mark.parametrize("change,message", [
    ({"strategy": "block"}, "per-channel or per-tensor"),
    ({"num_bits": 4, "type": "int"}, "format 'float-quantized' with weights 'int'"),
])
def test_other_quantized_checkpoints_are_refused(tmp_path, change, message):
    hf = qwen3(tmp_path)
    write_compressed_tensors(hf, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path, None, "cpu")


def test_a_weight_scale_of_the_wrong_size_is_refused(tmp_path):
    hf = qwen3(tmp_path)
    write_compressed_tensors(hf, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight_scale"
    stored[name] = stored[name][:3]
    save_file(stored, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="per output channel"):
        load_model(tmp_path, None, "cpu")
