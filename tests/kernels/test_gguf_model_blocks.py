"""A GGUF model whose linears keep their blocks (the CUDA path, here with the Triton kernels
under TRITON_INTERPRET=1) against the float model the same file loads as on the CPU (the
`gguf` package's dequantization): the same logits over a prefill (the tiled kernel) and decode
steps (the one-row kernel). The file mixes every kept type, a fused q/k/v whose shards differ in
type, and a layer whose v is stored in a type without a kernel (its q/k/v are dequantized at
load, and the log says so). Likewise a tiny Mixtral and Qwen3-MoE whose experts keep their
blocks in one layer (the fused MoE kernel unpacking them) and are dequantized in the other."""

import logging
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from transformers import AutoConfig, LlamaConfig, MixtralConfig, Qwen3MoeConfig

from benchmarks.gguf_quantize import quantize
from pagedserve.kernels.triton import int_linear
from pagedserve.kernels.triton.moe import fused_moe
from pagedserve.model import load_model
from pagedserve.model.ops import TORCH_OPS
from tests.model.gguf_files import gguf_tensors, write_metadata
from tests.model.paged import PagedDriver
from tests.kernels.test_moe_kernel import WIDE
from tests.model.test_decoder import make_checkpoint
from safetensors.torch import load_file

# K-quants need K a multiple of 256
CONFIG = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-5, tie_word_embeddings=False)
TYPES = {"blk.0.attn_q.weight": T.Q4_K, "blk.0.attn_k.weight": T.Q4_K,
         "blk.0.attn_v.weight": T.Q6_K, "blk.0.attn_output.weight": T.Q4_0,
         "blk.0.ffn_gate.weight": T.Q4_1, "blk.0.ffn_up.weight": T.Q4_1,
         "blk.0.ffn_down.weight": T.Q5_K,
         "blk.1.attn_q.weight": T.Q8_0, "blk.1.attn_k.weight": T.Q8_0,
         "blk.1.attn_v.weight": T.F16,  # no kernel: the whole q/k/v dequantized
         "blk.1.attn_output.weight": T.Q6_K, "blk.1.ffn_gate.weight": T.Q5_K,
         "blk.1.ffn_up.weight": T.Q5_K, "blk.1.ffn_down.weight": T.Q4_K,
         "output.weight": T.Q6_K, "token_embd.weight": T.Q8_0}
# few, large tiles: the interpreter's time goes by the program
TILES = int_linear.IntLinearConfig(gemv_block_n=512, gemv_block_k=256, gemm_block_m=16,
                                   gemm_block_n=512, gemm_block_k=256)


@pytest.fixture(autouse=True)
def _no_gguf_cache(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", "0")


def write_quantized_gguf(folder, path):
    make_checkpoint(LlamaConfig(**CONFIG), folder)
    config = AutoConfig.from_pretrained(folder)
    writer = GGUFWriter(str(path), "llama")
    write_metadata(writer, config, "llama")
    for name, tensor in gguf_tensors(load_file(folder / "model.safetensors"), config, "llama"):
        x = np.ascontiguousarray(tensor.numpy())
        qtype = TYPES.get(name)
        if qtype is None:
            writer.add_tensor(name, x)
        elif qtype == T.F16:
            writer.add_tensor(name, x.astype(np.float16))
        else:
            blocks = quantize(x, qtype)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_blocks_model_matches_dequantized_model(tmp_path, caplog):
    path = write_quantized_gguf(tmp_path, tmp_path / "model.gguf")
    reference, _, _ = load_model(path, torch.float32, "cpu", ops=TORCH_OPS)
    with caplog.at_level(logging.INFO, logger="pagedserve.model.gguf"):
        blocks, _, _ = load_model(path, torch.float32, "cpu",
                                  ops=replace(TORCH_OPS, gguf_linear=partial(int_linear.linear,
                                                                       config=TILES)))
    assert "dequantized at load" in caplog.text and "1 of F16" in caplog.text
    # only the float weights that are read stay: layer 1's q/k/v, not layer 0's
    names = {name for name, _ in blocks.named_parameters()}
    assert "layers.1.self_attn.qkv_proj.weight" in names
    assert not {"layers.0.self_attn.qkv_proj.weight", "layers.0.mlp.down_proj.weight",
                "lm_head.weight"} & names
    prompt = torch.randint(0, CONFIG["vocab_size"], (7,),
                           generator=torch.Generator().manual_seed(3)).tolist()
    drivers = [PagedDriver(model, block_size=4) for model in (reference, blocks)]
    feeds = [prompt, [5], [17]]  # a prefill, then decode steps
    with torch.no_grad():
        for feed in feeds:
            expected, ours = (d.step({"a": feed})["a"] for d in drivers)
            torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


# -- MoE experts kept in their blocks: the fused MoE kernel unpacks them -------------------

MOE_CONFIG = dict(CONFIG, intermediate_size=64, num_hidden_layers=2)
# layer 0 keeps its experts' blocks (gate and up of different types); layer 1's down is in a
# type without a kernel, so all its experts are dequantized (and logged)
MOE_TYPES = {"blk.0.ffn_gate_exps.weight": T.Q4_K, "blk.0.ffn_up_exps.weight": T.Q6_K,
             "blk.0.ffn_down_exps.weight": T.Q8_0, "blk.1.ffn_gate_exps.weight": T.Q5_K,
             "blk.1.ffn_up_exps.weight": T.Q5_K, "blk.1.ffn_down_exps.weight": T.F16}
MOE_MODELS = {
    "mixtral": ("llama", lambda: MixtralConfig(**MOE_CONFIG, num_local_experts=4,
                                              num_experts_per_tok=2)),
    "qwen3moe": ("qwen3moe", lambda: Qwen3MoeConfig(**MOE_CONFIG, moe_intermediate_size=64,
                                                   num_experts=4, num_experts_per_tok=2,
                                                   norm_topk_prob=True)),
}


def write_moe_gguf(case, folder, path):
    arch, make = MOE_MODELS[case]
    make_checkpoint(make(), folder)
    config = AutoConfig.from_pretrained(folder)
    writer = GGUFWriter(str(path), arch)
    write_metadata(writer, config, arch)
    for name, tensor in gguf_tensors(load_file(folder / "model.safetensors"), config, arch):
        x = np.ascontiguousarray(tensor.numpy())
        qtype = MOE_TYPES.get(name)
        if qtype is None:
            writer.add_tensor(name, x)
        elif qtype == T.F16:
            writer.add_tensor(name, x.astype(np.float16))
        else:  # [E, rows, K] -> [E, rows, row bytes]
            blocks = quantize(x.reshape(-1, x.shape[-1]), qtype).reshape(*x.shape[:2], -1)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("case", MOE_MODELS)
def test_moe_experts_in_blocks_match_dequantized_model(case, tmp_path, caplog):
    path = write_moe_gguf(case, tmp_path, tmp_path / "model.gguf")
    reference, _, _ = load_model(path, torch.float32, "cpu", ops=TORCH_OPS)
    with caplog.at_level(logging.INFO, logger="pagedserve.model.gguf"):
        blocks, _, _ = load_model(path, torch.float32, "cpu", ops=replace(
            TORCH_OPS, gguf_linear=partial(int_linear.linear, config=TILES),
            fused_moe=partial(fused_moe, config=WIDE)))
    assert "1 of F16 (MoE experts)" in caplog.text and "2 of Q5_K (MoE experts)" in caplog.text
    # layer 0's experts take no float memory; layer 1's are floats
    names = {name for name, _ in blocks.named_parameters()}
    assert {"layers.1.mlp.w13", "layers.1.mlp.w2"} <= names
    assert not {"layers.0.mlp.w13", "layers.0.mlp.w2"} & names
    prompt = torch.randint(0, CONFIG["vocab_size"], (9,),
                           generator=torch.Generator().manual_seed(4)).tolist()
    drivers = [PagedDriver(model, block_size=4) for model in (reference, blocks)]
    with torch.no_grad():
        for feed in [prompt, [5], [17]]:  # a prefill, then decode steps
            expected, ours = (d.step({"a": feed})["a"] for d in drivers)
            torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_experts_sliced_off_their_block_boundaries_are_not_kept(tmp_path):
    """Under tensor parallelism a rank's slice of down's input features must fall on block
    boundaries; an MoE layer where it would not is dequantized instead (TP 4: 16 of 64)."""
    from pagedserve.model import gguf_weights, parallel
    from pagedserve.model.loader import read_model_config

    config = read_model_config(write_moe_gguf("qwen3moe", tmp_path, tmp_path / "m.gguf"))
    types = {f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight": int(qtype)
             for layer, down in ((0, T.Q8_0), (1, T.F16)) for e in range(4)
             for proj, qtype in (("gate", T.Q4_K), ("up", T.Q4_K), ("down", down))}

    def module(name):
        return name.split(".experts.")[0] + ".w13", 0, None

    for size, kept in ((1, {"layers.0.mlp"}), (2, {"layers.0.mlp"}), (4, set())):
        for rank in range(size):
            tp = parallel.TensorParallel(rank=rank, size=size)
            layers = gguf_weights.kept_experts(module, types, config, tp)
            assert set(layers) == kept, (size, rank)
    names = gguf_weights.kept_experts(module, types, config)["layers.0.mlp"]
    assert names["down"] == [f"model.layers.0.mlp.experts.{e}.down_proj.weight"
                             for e in range(4)]
