"""Integer weight-only checkpoints (compressed-tensors pack-quantized, GPTQ, AWQ) on the CPU,
written by benchmarks/quantize_int.py as each format's tool writes them:

- our dequantized weights equal the format's own reference bit for bit: compressed-tensors'
  decompressor; for AWQ, compressed-tensors' AutoAWQ converter and then its decompressor;
  for GPTQ (and compressed-tensors' actorder "group", whose g_idx its current decompressor
  no longer reads), AutoGPTQ's dequantization formula (scales[g_idx] * (w - (z + 1)));
- logits and greedy tokens equal transformers' on the float model built from those
  dequantized weights (float32);
- MoE experts (Mixtral, Qwen3-MoE) likewise, against the float model written from the
  formats' reference dequantization, both expert by expert (the CPU) and through the fused
  MoE kernel that unpacks them in registers (CUDA's path, under TRITON_INTERPRET=1);
- a 4-bit checkpoint loaded with CUDA's choice of matmul (torch's int4 layout alone, its
  row rule: the fused GEMM, dequantize + cuBLAS; under TRITON_INTERPRET=1) gives the CPU
  reference's logits;
- unsupported variants are refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dataclasses import replace
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen3Config,
                          Qwen3MoeConfig)

from benchmarks.quantize_int import quantize_folder
from pagedserve.model import load_model
from pagedserve.model.ops import select_ops
from tests.model.test_decoder import TINY, make_checkpoint
from tests.model.paged import PagedDriver
from tests.model.test_families import check_greedy_generation, check_paged_logits


# K is 64 (attention, gate/up) or 96 (down): group 64 leaves a part-group at the end of down
FORMATS = {
    "ct-w4-g32-sym": ("compressed-tensors", dict(bits=4, group=32)),
    "ct-w4-g64-asym-actorder": ("compressed-tensors",
                                dict(bits=4, group=64, symmetric=False, act_order=True)),
    "ct-w8-channel-asym": ("compressed-tensors", dict(bits=8, group=0, symmetric=False)),
    "gptq-w4-g32-desc_act": ("gptq", dict(bits=4, group=32, act_order=True)),
    "gptq-w8-g64-asym": ("gptq", dict(bits=8, group=64, symmetric=False)),
    "awq-w4-g32": ("awq", dict(bits=4, group=32, symmetric=False)),
}
PROJS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
         "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
         "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
         "down_proj": ("mlp.down_proj", 0)}


def qwen3(folder):
    return make_checkpoint(Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False), folder)


def quantized(tmp_path, case: str, make=qwen3, dtype=None):
    fmt, options = FORMATS[case]
    hf = make(tmp_path / "float")
    quantize_folder(tmp_path / "float", tmp_path / case, fmt, dtype=dtype, **options)
    return hf, tmp_path / case


def our_weights(model) -> dict[str, torch.Tensor]:
    """Each checkpoint projection's dequantized weight, cut out of our fused layers."""
    out = {}
    for i, layer in enumerate(model.layers):
        for proj, (path, part) in PROJS.items():
            w = layer.get_submodule(path).matmul.weight.dequantize()
            sizes = {"self_attn.qkv_proj": [64, 32, 32], "mlp.gate_up_proj": [96, 96]}.get(
                path, [w.shape[0]])
            out[f"model.layers.{i}.{path.split('.')[0]}.{proj}"] = w.split(sizes)[part]
    return out


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """AutoGPTQ's unpacking: codes along `dim`, low bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:
        codes = (words.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)
        return codes.reshape(-1, words.shape[1])
    codes = (words.unsqueeze(2) >> shifts[None, None, :]) & ((1 << bits) - 1)
    return codes.reshape(words.shape[0], -1)


def gptq_reference(t: dict, bits: int) -> torch.Tensor:
    """AutoGPTQ's dequantization: scales[g_idx] * (w - (qzeros + 1)[g_idx]), [N, K]."""
    w = unpack(t["qweight"], bits, 0)  # [K, N]
    zeros = unpack(t["qzeros"], bits, 1) + 1  # [G, N]
    g = t["g_idx"].long()
    return (t["scales"][g].float() * (w - zeros[g]).float()).to(t["scales"].dtype).t()


def ct_reference(t: dict, config: dict) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = dict(config["config_groups"]["group_0"]["weights"], actorder=None)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    return PackedQuantizationCompressor.decompress(t, scheme)["weight"]


def reference_weights(folder: Path, case: str) -> dict[str, torch.Tensor]:
    fmt, options = FORMATS[case]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    stored = load_file(folder / "model.safetensors")
    modules = {name.rsplit(".", 1)[0] for name in stored if name.endswith(
        (".qweight", ".weight_packed"))}
    out = {}
    for module in modules:
        t = {n.removeprefix(module + "."): v for n, v in stored.items()
             if n.startswith(module + ".")}
        if fmt == "gptq":
            out[module] = gptq_reference(t, options["bits"])
        elif fmt == "awq":
            from compressed_tensors.entrypoints.convert.converters.autoawq import (
                AutoAWQConverter)

            converted = AutoAWQConverter(bits=4, group_size=options["group"]).process(
                {f"{module}.{n}": v for n, v in t.items()})
            ct = {n.removeprefix(module + "."): v for n, v in converted.items()}
            out[module] = ct_reference(ct, {"config_groups": {"group_0": {"weights": {
                "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                "group_size": options["group"]}}}})
        elif options.get("act_order"):  # GPTQ's formula over compressed-tensors' tensors
            zeros = unpack(t["weight_zero_point"], 4, 0)[:t["weight_scale"].shape[0]]
            gptq = {"qweight": t["weight_packed"].t(), "qzeros": zeros.t() - 1,
                    "scales": t["weight_scale"].t(), "g_idx": t["weight_g_idx"]}
            gptq["qzeros"] = _pack_rows(gptq["qzeros"], 4)
            out[module] = gptq_reference(gptq, 4)
        else:
            out[module] = ct_reference(t, config)
    return out


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [R, C] -> words [R, C * bits / 32], low bits first (to reuse AutoGPTQ's form)."""
    per_word = 32 // bits
    words = (codes.long().view(codes.shape[0], -1, per_word)
             << (torch.arange(per_word) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("case", FORMATS)
def test_dequantized_weights_equal_the_formats_reference_bit_for_bit(case, tmp_path):
    _, folder = quantized(tmp_path, case, dtype=torch.bfloat16)
    model, _, _ = load_model(folder, None, "cpu")
    bits = FORMATS[case][1]["bits"]
    assert model.quantization == f"w{bits}a16"
    ours, ref = our_weights(model), reference_weights(folder, case)
    assert ours.keys() == ref.keys()
    for name, w in ours.items():
        assert w.dtype == torch.bfloat16 and torch.equal(w, ref[name]), name


def float_model_of(hf, model):
    """transformers' model with each projection set to our dequantized weight."""
    with torch.no_grad():
        for name, w in our_weights(model).items():
            hf.get_submodule(name).weight.copy_(w.float())
    return hf


@pytest.mark.parametrize("case,make", [
    ("ct-w4-g32-sym", qwen3),
    ("gptq-w4-g32-desc_act", lambda f: make_checkpoint(LlamaConfig(**TINY), f)),
    ("awq-w4-g32", lambda f: make_checkpoint(LlamaConfig(**TINY, tie_word_embeddings=True),
                                             f)),
])
def test_logits_and_greedy_tokens_equal_the_dequantized_float_model(case, make, tmp_path):
    hf, folder = quantized(tmp_path, case, make)
    model, config, _ = load_model(folder, torch.float32, "cpu")
    reference = float_model_of(hf, model)
    check_paged_logits(case, reference, model)
    check_greedy_generation(case, reference, model, config.max_model_len)


def moe_float_folder(source: Path, quantized: Path, case: str, folder: Path):
    """`source`'s checkpoint with every packed projection (attention and each expert)
    replaced by the format's reference dequantization of `quantized`'s: the float model our
    packed one should equal."""
    tensors = load_file(source / "model.safetensors")
    for module, w in reference_weights(quantized, case).items():
        tensors[f"{module}.weight"] = w.float()
    folder.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    save_file({n: t.contiguous() for n, t in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def mixtral(folder):
    return make_checkpoint(MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
                           folder)


def qwen3_moe(folder):
    return make_checkpoint(Qwen3MoeConfig(**TINY, head_dim=16, moe_intermediate_size=64,
                                          num_experts=4, num_experts_per_tok=2,
                                          norm_topk_prob=True), folder)


def fused_ops():
    """The CPU's ops with the fused MoE kernel (under TRITON_INTERPRET=1): CUDA's path for
    the experts."""
    from pagedserve.kernels.triton.moe import fused_moe
    from tests.kernels.test_moe_kernel import WIDE

    return replace(select_ops("cpu", torch.float32), fused_moe=partial(fused_moe, config=WIDE))


MOE = {  # model, format: each family (compressed-tensors W4 and W8, GPTQ, AWQ) once
    "mixtral-gptq-desc_act": (mixtral, "gptq-w4-g32-desc_act"),
    "mixtral-awq": (mixtral, "awq-w4-g32"),
    "qwen3moe-ct-asym-actorder": (qwen3_moe, "ct-w4-g64-asym-actorder"),
    "qwen3moe-ct-w8-channel": (qwen3_moe, "ct-w8-channel-asym"),
}


@pytest.mark.parametrize("case,experts", [
    *((case, "expert by expert") for case in MOE),
    # the interpreter's kernels are slow: one case per model (the formats meet one layout
    # before the kernel; tests/kernels/test_moe_kernel.py runs its variants)
    ("mixtral-gptq-desc_act", "fused"), ("qwen3moe-ct-w8-channel", "fused")])
def test_packed_moe_experts_give_the_dequantized_float_models_logits(case, experts, tmp_path):
    make, fmt_case = MOE[case]
    _, folder = quantized(tmp_path, fmt_case, make)
    model, config, _ = load_model(folder, torch.float32, "cpu",
                                  ops=fused_ops() if experts == "fused" else None)
    reference = moe_float_folder(tmp_path / "float", folder, fmt_case,
                                 tmp_path / "dequantized")
    check_paged_logits(case, reference, model)
    if experts != "fused":  # the interpreter's kernels are slow; the logits cover decodes
        check_greedy_generation(case, reference, model, config.max_model_len)


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "gptq", "bits": 3}, "3-bit GPTQ weights are not supported"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin' is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "exl2", "bits": 4}, "'exl2', which is not supported"),
])
def test_unsupported_variants_are_refused_by_name(tmp_path, change, message):
    make_checkpoint(LlamaConfig(**TINY), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path, None, "cpu")


def cuda_int4_layer(weight):
    """CUDA's choice at load (`int_linear.for_layer`) made on the CPU: the 4-bit weight in
    torch's int4 layout as CUDA's conversion writes it (emulated: tests/kernels/
    test_int4pack.py), with that layout's matmul."""
    from pagedserve.kernels import int4pack
    from pagedserve.kernels.triton.int_linear import int4pack_linear
    from pagedserve.kernels.weight_formats import unpack_codes
    from tests.kernels.test_int4pack import pack_reference, pairs_of

    codes = unpack_codes(weight.qweight, 4, weight.in_features)
    return int4pack_linear, int4pack.Int4Weight(
        pack_reference(pairs_of(codes)), int4pack.scales_and_offsets(weight),
        weight.group_size, weight.in_features)


def test_weights_in_torchs_int4_layout_give_the_reference_models_logits(tmp_path):
    """A W4A16 checkpoint loaded with CUDA's int matmuls (torch's int4 layout alone, through
    `int4pack_linear`; under TRITON_INTERPRET=1, float32 activations) gives the logits of the
    same checkpoint on the CPU's reference matmul (the dequantized float model's, tests
    above): a 260-row step (dequantize + cuBLAS's path), a step of a short prefill and two
    decodes, and a decode batch of three (the fused GEMM)."""
    config = {**TINY, "hidden_size": 128, "intermediate_size": 256}  # K: 128 columns a tile
    make = partial(make_checkpoint, Qwen3Config(**config, head_dim=32,
                                                tie_word_embeddings=False))
    _, folder = quantized(tmp_path, "ct-w4-g32-sym", make, dtype=torch.bfloat16)
    ops = replace(select_ops("cpu", torch.float32), int_layer=cuda_int4_layer)
    model, _, _ = load_model(folder, torch.float32, "cpu", ops=ops)
    assert not [name for name, p in model.named_parameters() if p.dtype == torch.int32]
    reference, _, _ = load_model(folder, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(3)
    prompts = {s: torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist()
               for s, n in (("a", 100), ("b", 100), ("c", 60), ("d", 20))}
    ours, theirs = PagedDriver(model, num_blocks=128), PagedDriver(reference, num_blocks=128)
    steps = [{s: prompts[s] for s in "abc"}, {"a": [5], "b": [6], "d": prompts["d"]},
             {"a": [7], "b": [8], "d": [9]}]
    for i, feeds in enumerate(steps):
        got, expected = ours.step(feeds), theirs.step(feeds)
        for seq in feeds:
            torch.testing.assert_close(got[seq], expected[seq], atol=1e-4, rtol=1e-4,
                                       msg=f"step {i} seq {seq}")
