"""The fused MoE kernels (`pagedserve.kernels.triton.moe`) under TRITON_INTERPRET=1 (conftest)
against a dense reference: every token through each of its experts, weighted and summed.
Expert counts 8 and 128, top-k 1, 2 and 8, experts that receive no token, ragged tiles; experts
kept quantized (int formats, GGUF blocks) against the same reference on their dequantized
weights (`weight_formats`' torch reference)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from pagedserve.kernels.gguf_format import GgufWeight
from pagedserve.kernels.triton.moe import BLOCK_M, MoeConfig, fused_moe, group_by_expert
from pagedserve.kernels.weight_formats import IntWeight, stacked
from pagedserve.model.moe import route
from tests.kernels.test_gguf_kernel import random_blocks
from tests.kernels.test_int_linear import random_weight
from tests.kernels.test_kernels import fresh_seed

HIDDEN, INTER = 32, 48


def dense_reference(x, w13, w2, weights, ids):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("num_experts,top_k,num_tokens", [
    (8, 1, 5), (8, 2, 19), (8, 8, 7), (128, 8, 9), (128, 2, 3)])
def test_fused_moe_matches_dense(num_experts, top_k, num_tokens):
    gen = torch.Generator().manual_seed(num_experts * 100 + top_k * 10 + num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) * 0.2
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) * 0.2
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = route(logits, top_k, renormalize=True, weights_dtype=None)
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    assert (counts == 0).any() or num_experts * 2 <= top_k * num_tokens
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), dense_reference(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


def test_empty_experts_get_no_tile():
    ids = torch.tensor([[3, 0], [3, 5], [0, 3]])
    order, tile_expert, tile_start, tile_end = group_by_expert(ids, 8, block_m=2)
    used = tile_expert >= 0
    # experts 0 (2 pairs), 3 (3 pairs: 2 tiles), 5 (1 pair); the rest none
    assert tile_expert[used].tolist() == [0, 3, 3, 5]
    assert tile_start[used].tolist() == [0, 2, 4, 5] and tile_end[used].tolist() == [2, 5, 5, 6]
    assert [int(ids.flatten()[p]) for p in order.tolist()] == [0, 0, 3, 3, 3, 5]


def test_routing_ties_follow_topk():
    """Equal probabilities: the same experts as torch.topk picks (transformers' call)."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0]])
    weights, ids = route(logits, 2, renormalize=False, weights_dtype=torch.bfloat16)
    ref_w, ref_ids = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), 2, -1)
    assert torch.equal(ids, ref_ids) and weights.dtype == torch.bfloat16
    torch.testing.assert_close(weights, ref_w.to(torch.bfloat16))


# -- experts kept quantized: the same kernels unpacking each expert's tiles ----------------


def stacked_int(num_experts, n, k, bits, group, zeros, g_idx, gen, rows=None):
    """`Stacked` int experts [E, n, k] over stacked tensors (rows: a range of them, as the
    loader cuts gate and up out of w13)."""
    experts = [random_weight(n, k, bits, group, zeros, g_idx, torch.float32, gen)
               for _ in range(num_experts)]
    stack = {f: None if getattr(experts[0], f) is None
             else torch.stack([getattr(w, f) for w in experts])
             for f in ("qweight", "scales", "zeros", "g_idx")}
    lo, hi = rows or (0, n)
    return stacked(IntWeight(stack["qweight"][e, lo:hi], stack["scales"][e, lo:hi],
                             None if zeros is False else stack["zeros"][e, lo:hi],
                             None if g_idx is False else stack["g_idx"][e], bits, group, k)
                   for e in range(num_experts))


def stacked_gguf(num_experts, n, k, qtype, rng):
    blocks = torch.from_numpy(np.stack([random_blocks(qtype, n, k, rng)
                                        for _ in range(num_experts)]))
    return stacked(GgufWeight(blocks[e], qtype, k) for e in range(num_experts))


def dequantized(experts, dtype=torch.float32):
    """A `Stacked`'s experts [E, N, K] by each one's torch reference (`dequantize`)."""
    return torch.stack([w.dequantize(dtype) for w in experts.experts])


# the GEMV with wide tiles: fewer programs for the interpreter (the model tests take it too)
WIDE = MoeConfig(int_block_n=64, block_n=64)
# the three kernel paths packed experts take, each forced by its thresholds
PATHS = {"gemv": replace(WIDE, gemv_max_tokens=1 << 20),
         "grouped": MoeConfig(gemv_max_tokens=0, dequant_min_tokens=1 << 20),
         "dequant": MoeConfig(gemv_max_tokens=0, dequant_min_tokens=1)}


def check_packed(gate, up, down, num_tokens, top_k, seed, config=PATHS["grouped"]):
    gen = torch.Generator().manual_seed(seed)
    num_experts, _, hidden = gate.shape
    x = torch.randn(num_tokens, hidden, generator=gen) * 0.1
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 0] += 8.0  # every token (but a 1e-8 chance): two tiles (ragged), the last none
    logits[:, -1] -= 20.0
    weights, ids = route(logits, top_k, renormalize=True, weights_dtype=None)
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    assert counts[-1] == 0 and counts.max() > BLOCK_M and counts.max() % BLOCK_M
    out = fused_moe(x, (gate, up), down, weights, ids, config)
    w13 = torch.cat([dequantized(gate), dequantized(up)], 1)
    expected = dense_reference(x, w13, dequantized(down), weights, ids)
    # float32 sums in another order; the random weights' magnitudes vary by format
    scale = float(expected.abs().max())
    torch.testing.assert_close(out.double(), expected, atol=1e-5 * max(scale, 1.0),
                               rtol=1e-5)


INT_CASES = {  # bits, group of w13 (K = HIDDEN), of w2 (K = INTER), zeros, g_idx
    "4-bit g32 sym": (4, 32, 32, False, False),  # w2: one group and a half per tile
    "4-bit g128 zeros": (4, 128, 128, True, False),  # a group past the tile (and K)
    "4-bit per-channel g_idx": (4, 32, 16, True, True),
    "8-bit channel zeros": (8, HIDDEN, INTER, True, False),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", INT_CASES.values(), ids=INT_CASES.keys())
def test_packed_int_experts_match_their_dequantized_weights(case, path):
    bits, group13, group2, zeros, g_idx = case
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    e = 6
    gate = stacked_int(e, 2 * INTER, HIDDEN, bits, group13, zeros, g_idx, gen, (0, INTER))
    up = stacked_int(e, 2 * INTER, HIDDEN, bits, group13, zeros, g_idx, gen,
                     (INTER, 2 * INTER))
    down = stacked_int(e, HIDDEN, INTER, bits, group2, zeros, g_idx, gen)
    check_packed(gate, up, down, num_tokens=23, top_k=2, seed=seed, config=PATHS[path])


@pytest.mark.parametrize("path", PATHS)
def test_gguf_experts_in_different_block_types(path):
    """Gate and up in different types (a GGUF may), down in a third; K of 256."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    e, hidden, inter = 3, 256, 96
    gate = stacked_gguf(e, inter, hidden, int(T.Q4_K), rng)
    up = stacked_gguf(e, inter, hidden, int(T.Q8_0), rng)
    down = stacked_gguf(e, hidden, inter, int(T.Q4_1), rng)
    check_packed(gate, up, down, num_tokens=17, top_k=2, seed=seed, config=PATHS[path])
    gate = stacked_gguf(e, 256, hidden, int(T.Q5_K), rng)
    up = stacked_gguf(e, 256, hidden, int(T.Q5_K), rng)
    down = stacked_gguf(e, hidden, 256, int(T.Q6_K), rng)
    check_packed(gate, up, down, num_tokens=17, top_k=1, seed=seed, config=PATHS[path])
