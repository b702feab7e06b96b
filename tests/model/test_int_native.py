"""Integer checkpoints on the CPU's native int8-activation kernels (model/int_native.py).

- A packed weight converted to the kernels' blocks holds the checkpoint's weights exactly
  ((code - zero) * scale, compared in float64), in group order where g_idx reorders the
  columns; weights the blocks cannot hold exactly are refused with the reason.
- The matmul on those blocks equals the float64 product of the int8-quantized activations
  with the dequantized weight (tight: float32 sums only), as the GGUF blocks' kernel test
  holds it.
- Loaded in the fast mode (dense models, and Mixtral's experts), a checkpoint's logits are
  those of the float model on the dequantized weights whose linears' inputs are
  int8-quantized as the kernels do it (float64), and within that rounding of the float
  model itself, whose greedy tokens they give; a layer that does not fit keeps the exact
  reference, with a log line.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig, Qwen3Config

from benchmarks.quantize_int import quantize_folder
from pagedserve.kernels.native import quant
from pagedserve.kernels.weight_formats import IntWeight, groups_of, pack_codes, unpack_codes
from pagedserve.model import load_model
from pagedserve.model.decoder import Linear
from pagedserve.model.moe import SparseMoE
from pagedserve.model.int_native import NoFit, native_matmul, to_blocks
from pagedserve.model.int_weights import IntMatmul
from pagedserve.model.ops import select_ops
from pagedserve.model.packed import QuantizedMatmul
from tests.model.paged import PagedDriver
from tests.model.test_decoder import TINY, make_checkpoint

pytestmark = pytest.mark.skipif(not quant.available(), reason="native kernels unavailable")


def int_weight(n: int, k: int, bits: int, group: int, *, zeros: bool = False,
               g_idx: str | None = None, scale_dtype=torch.float16, seed: int = 0) -> IntWeight:
    """A random packed weight. g_idx "desc_act": each group's columns scattered (GPTQ's
    desc_act, each group `group` columns); "uneven": any column any group (what a
    tensor-parallel rank keeps of desc_act groups)."""
    gen = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    groups = -(-k // group)
    codes = torch.randint(0, top + 1, (n, k), generator=gen)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).to(scale_dtype).float()
    z = torch.randint(0, top + 1, (n, groups), generator=gen).float() if zeros else None
    idx = None
    if g_idx == "desc_act":
        idx = torch.empty(k, dtype=torch.int32)
        idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // group).to(torch.int32)
    elif g_idx == "uneven":
        idx = torch.randint(0, groups, (k,), generator=gen, dtype=torch.int32)
    return IntWeight(pack_codes(codes, bits), scales, z, idx, bits, group, k)


def exact_weight(w: IntWeight) -> torch.Tensor:
    """(code - zero) * scale in float64: the checkpoint's weight before any rounding."""
    g = groups_of(w)
    codes = unpack_codes(w.qweight, w.bits, w.in_features).double()
    zeros = w.zeros.double()[:, g] if w.zeros is not None else float(1 << (w.bits - 1))
    return (codes - zeros) * w.scales.double()[:, g]


def blocks_weight(w: IntWeight) -> torch.Tensor:
    """The converted blocks' weight (scale * q + min) in float64, in the checkpoint's
    columns (the padding columns dropped)."""
    blocks = to_blocks(w)
    b = blocks.weight
    wide = quant.QuantizedWeight(b.kind, b.qs, b.scales.double(),
                                 None if b.mins is None else b.mins.double()).dequantize()
    if blocks.columns is None:
        return wide
    out = torch.empty(wide.shape[0], w.in_features + 1, dtype=wide.dtype)
    out[:, blocks.columns] = wide
    return out[:, :-1]


FITS = {
    "w4-g32-sym-f32": dict(bits=4, group=32, scale_dtype=torch.float32),
    "w4-g64-asym": dict(bits=4, group=64, zeros=True),
    "w4-g128-asym-bf16": dict(bits=4, group=128, zeros=True, scale_dtype=torch.bfloat16),
    "w4-channel": dict(bits=4, group=160),
    "w4-g16": dict(bits=4, group=16, zeros=True),
    "w4-g32-desc_act": dict(bits=4, group=32, zeros=True, g_idx="desc_act"),
    "w4-g32-uneven": dict(bits=4, group=32, g_idx="uneven"),
    "w8-g16-sym": dict(bits=8, group=16, scale_dtype=torch.float32),
    "w8-g48-uneven": dict(bits=8, group=48, g_idx="uneven"),
}


@pytest.mark.parametrize("k", [160, 72])
@pytest.mark.parametrize("case", FITS)
def test_blocks_hold_the_checkpoints_weights_exactly(case, k):
    w = int_weight(24, k, **FITS[case])
    blocks = to_blocks(w)
    assert torch.equal(blocks_weight(w), exact_weight(w))
    # the checkpoint's own columns where they are whole blocks of one group each
    assert (blocks.columns is None) == (k == 160 and case in (
        "w4-g32-sym-f32", "w4-g64-asym", "w4-g128-asym-bf16", "w4-channel", "w8-g16-sym"))


@pytest.mark.parametrize("options,reason", [
    (dict(bits=4, group=32, zeros=True, scale_dtype=torch.float32), "not a float32"),
    (dict(bits=8, group=32, zeros=True), "outside int8"),
])
def test_weights_the_blocks_cannot_hold_are_refused_with_the_reason(options, reason):
    with pytest.raises(NoFit, match=reason):
        to_blocks(int_weight(16, 64, **options))


@pytest.mark.parametrize("case", ["w4-g64-asym", "w4-g32-desc_act", "w4-g32-uneven",
                                  "w8-g48-uneven"])
@pytest.mark.parametrize("rows", [1, 5])
def test_matmul_is_the_quantized_activations_times_the_weight(case, rows):
    w = int_weight(40, 168, **FITS[case], seed=rows)
    x = torch.randn(rows, 168, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(40)
    out = native_matmul(w)(x, None, bias).double()
    want, scale = int8_product(x, w)
    want, scale = want + bias.double(), scale + bias.abs().double()
    assert ((out - want).abs() <= 1e-5 * scale + 1e-6).all()


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x float32 [T, K] as the kernel quantizes it, dequantized in float64: per 32 columns
    d = max|x| / 127, q = round-half-even(x * (127 / max|x|)) in float32."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv).double() * (amax / 127).double()).view(x.shape)


def int8_product(x: torch.Tensor, w: IntWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' arithmetic in float64: x [T, K] laid out as the blocks take it and
    int8-quantized per 32 columns, times the exact weight; and the sum of the products'
    magnitudes (the bound's scale)."""
    columns = to_blocks(w).columns
    weight = exact_weight(w)
    if columns is not None:
        x = torch.nn.functional.pad(x, (0, 1))[:, columns]
        weight = torch.nn.functional.pad(weight, (0, 1))[:, columns]
    xq = quantize_rows(x.contiguous())
    return xq @ weight.T, xq.abs() @ weight.abs().T


def int8_activations_linear(x: torch.Tensor, weight: IntWeight,
                            bias: torch.Tensor | None) -> torch.Tensor:
    """`Ops.int_linear` as the kernels compute it, in float64 (`int8_product`)."""
    y = int8_product(x.reshape(-1, x.shape[-1]), weight)[0]
    y = y if bias is None else y + bias.double()
    return y.float().view(*x.shape[:-1], -1)


def llama(folder):
    return make_checkpoint(LlamaConfig(**TINY), folder)


def qwen3(folder):
    return make_checkpoint(Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False), folder)


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    driver = PagedDriver(model, block_size=4)
    logits, tokens = driver.step({"s": prompt})["s"][-1:], []
    for _ in range(steps):
        tokens.append(int(logits[0].argmax()))
        logits = driver.step({"s": tokens[-1:]})["s"]
    return tokens


def mixtral(folder):
    return make_checkpoint(MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
                           folder)


def packed_matmuls(model) -> list:
    """The matmul of every layer and expert the checkpoint holds packed."""
    matmuls = [m.matmul for m in model.modules() if isinstance(m, Linear) and m.weight is None]
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        matmuls += [mm for _, _, m13, m2 in moe.experts.experts for mm in (m13, m2)]
    return matmuls


PACKED = ("qweight", "scales", "zeros", "g_idx")  # a packed layer's parameters
# (checkpoint, format, options)
NATIVE = {
    "ct-w4-g32-sym": (qwen3, "compressed-tensors", dict(bits=4, group=32)),
    "gptq-w4-g32-desc_act": (llama, "gptq", dict(bits=4, group=32, act_order=True)),
    "awq-w4-g32-bf16": (llama, "awq", dict(bits=4, group=32, symmetric=False,
                                          dtype=torch.bfloat16)),
    "ct-w8-channel": (qwen3, "compressed-tensors", dict(bits=8, group=0)),
    "mixtral-gptq-w4-g32-desc_act": (mixtral, "gptq", dict(bits=4, group=32, act_order=True)),
}


@pytest.mark.parametrize("case", NATIVE)
def test_fast_mode_logits_and_greedy_tokens_follow_the_dequantized_model(case, tmp_path):
    make, fmt, options = NATIVE[case]
    make(tmp_path / "float")
    quantize_folder(tmp_path / "float", tmp_path / case, fmt, **options)
    exact, _, _ = load_model(tmp_path / case, torch.float32, "cpu")  # the reference path
    fast, _, _ = load_model(tmp_path / case, torch.float32, "cpu", quantized=True)
    matmuls = packed_matmuls(fast)
    # q/k/v, o, gate/up and down, or q/k/v, o and each of 4 experts' w13 and w2
    assert len(matmuls) == (10 if case.startswith("mixtral") else 4) * TINY["num_hidden_layers"]
    assert all(isinstance(m, QuantizedMatmul) for m in matmuls)
    # the blocks are the weights now: none of the packed tensors is kept beside them
    assert any(n.endswith(PACKED) for n, _ in exact.named_parameters())
    assert not any(n.endswith(PACKED) for n, _ in fast.named_parameters())
    prompt = torch.randint(0, TINY["vocab_size"], (13,),
                           generator=torch.Generator().manual_seed(2)).tolist()
    want = PagedDriver(exact).step({"s": prompt})["s"]
    got = PagedDriver(fast).step({"s": prompt})["s"]
    rounded, _, _ = load_model(tmp_path / case, torch.float32, "cpu", ops=replace(
        select_ops("cpu", torch.float32), int_linear=int8_activations_linear))
    sim = PagedDriver(rounded).step({"s": prompt})["s"]
    top = want.abs().max()
    # the kernels' own arithmetic: float32 sums against float64 (an activation whose
    # rounding that flips moves a logit by ~1e-3 of the largest)
    assert (got - sim).abs().max() < 2e-3 * top
    # the activations' int8 rounding (a wrong nibble, scale or column order is of the
    # logits' own size)
    assert (got - want).abs().max() < 0.05 * top
    assert greedy(fast, prompt, 8) == greedy(exact, prompt, 8)


def test_a_layer_that_does_not_fit_keeps_the_exact_reference(tmp_path, caplog):
    """Asymmetric float32 scales: zero x scale is no float32, so no q4 min holds it."""
    llama(tmp_path / "float")
    quantize_folder(tmp_path / "float", tmp_path / "awq", "awq", bits=4, group=32,
                    symmetric=False)
    exact, _, _ = load_model(tmp_path / "awq", torch.float32, "cpu")
    with caplog.at_level(logging.INFO, logger="pagedserve.model.int_native"):
        fast, _, _ = load_model(tmp_path / "awq", torch.float32, "cpu", quantized=True)
    assert "8 layers keep the reference (dequantizing) matmul: zero point x scale" in caplog.text
    matmuls = packed_matmuls(fast)
    assert matmuls and all(isinstance(m, IntMatmul) for m in matmuls)
    assert any(n.endswith(PACKED) for n, _ in fast.named_parameters())
    prompt = list(range(3, 16))
    assert torch.equal(PagedDriver(fast).step({"s": prompt})["s"],
                       PagedDriver(exact).step({"s": prompt})["s"])
