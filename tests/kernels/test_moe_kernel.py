"""The fused MoE kernels (`pagedserve.kernels.triton.moe`) under TRITON_INTERPRET=1 (conftest)
against a dense reference: every token through each of its experts, weighted and summed.
Expert counts 8 and 128, top-k 1, 2 and 8, experts that receive no token, ragged tiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.triton.moe import fused_moe, group_by_expert
from pagedserve.model.moe import route

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
