"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks top_k of num_experts per token.

Routing follows transformers op for op, so the same logits pick the same experts, ties
included: softmax over the router logits in float32, `torch.topk` (which breaks ties the same
way wherever the inputs are equal), then the chosen weights are renormalised to sum to 1 when
the model says so (Mixtral always, Qwen3-MoE with `norm_topk_prob`); Qwen3-MoE rounds them to
the activation dtype, Mixtral keeps them in float32.

The experts' weights are stacked, `w13` [E, 2I, H] (gate rows first, then up) and `w2`
[E, H, I], so one kernel launch can reach all of them. On CUDA the fused Triton kernels
(`kernels/triton/moe.py`) do gate/up and down as one grouped GEMM launch each over the tokens sorted
by expert; elsewhere each expert that received tokens runs its two matmuls on just those
tokens (through a `PackedWeight`, the native kernel on the CPU), accumulated in expert order
as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedserve.model import parallel
from pagedserve.model.config import ModelConfig
from pagedserve.model.packed import PackedWeight


def route(logits: Tensor, top_k: int, renormalize: bool,
          weights_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (weights [T, top_k], expert ids [T, top_k] int64).

    weights_dtype None keeps the weights in float32."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if weights_dtype is None else weights.to(weights_dtype)), ids


class SparseMoE(nn.Module):
    """The MLP of an MoE layer: router `gate` and the stacked experts."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if parallel.get_tp().size > 1:
            raise ValueError("tensor parallelism does not shard the experts of an MoE model yet")
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.round_weights = config.family != "mixtral"  # Qwen3-MoE rounds them
        self.gate = nn.Linear(h, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self._packed: list | None = None  # per expert (w13 view, w2 view, PackedWeights)

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize,
                             x.dtype if self.round_weights else None)
        if x.is_cuda:
            from pagedserve.kernels.triton.moe import fused_moe

            return fused_moe(x, self.w13, self.w2, weights, ids)
        return self._per_expert(x, weights, ids)

    def _per_expert(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """Each expert with tokens: its matmuls on those tokens only, scaled by their routing
        weight and added into the output in expert order."""
        out = torch.zeros_like(x)
        if self._packed is None or self._packed[0][0].data_ptr() != self.w13.data_ptr():
            self._packed = [(self.w13[e], self.w2[e], PackedWeight(), PackedWeight())
                            for e in range(self.w13.shape[0])]
        counts = torch.bincount(ids.flatten(), minlength=self.w13.shape[0]).tolist()
        order = ids.flatten().argsort(stable=True)
        pairs = order.split(counts)
        for e, pair in enumerate(pairs):
            if pair.numel() == 0:
                continue
            tokens, slot = pair // self.top_k, pair % self.top_k
            w13, w2, packed13, packed2 = self._packed[e]
            gate, up = packed13.linear(x[tokens], w13).chunk(2, dim=-1)
            y = packed2.linear(F.silu(gate) * up, w2)
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
        return out
