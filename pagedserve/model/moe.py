"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks top_k of num_experts per token.

Routing follows transformers op for op, so the same logits pick the same experts, ties
included: softmax over the router logits in float32, `torch.topk` (which breaks ties the same
way wherever the inputs are equal), then the chosen weights are renormalised to sum to 1 when
the model says so (Mixtral always, Qwen3-MoE with `norm_topk_prob`); Qwen3-MoE rounds them to
the activation dtype, Mixtral keeps them in float32.

The experts' weights are stacked, `w13` [E, 2I, H] (gate rows first, then up) and `w2`
[E, H, I], so one kernel launch can reach all of them. On CUDA the fused Triton kernels
(`kernels/triton/moe.py`) do gate/up and down as one grouped GEMM launch each over the tokens
sorted by expert (experts kept quantized too: `QuantizedExperts`); elsewhere each expert that
received tokens runs its two matmuls on just those tokens (`ExpertByExpert`, through the
model's float matmul: the native kernel on the CPU),
accumulated in expert order as transformers does. Under tensor parallelism each rank runs
every expert on its slice of the intermediate features, the router whole, and the partial
outputs are added by one all-reduce. Which of the two is the model's `Ops`'
choice (`model.ops.select_ops`), made when it loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedserve.model import parallel
from pagedserve.model.config import ModelConfig
from pagedserve.model.ops import Matmul, Ops


def route(logits: Tensor, top_k: int, renormalize: bool,
          weights_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (weights [T, top_k], expert ids [T, top_k] int64).

    weights_dtype None keeps the weights in float32."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if weights_dtype is None else weights.to(weights_dtype)), ids


class ExpertByExpert:
    """The experts without a fused kernel: each expert with tokens runs its matmuls on those
    tokens only, scaled by their routing weight and added into the output in expert order.
    Each expert's two weights get a matmul of their own (`Ops.matmul`: a packed copy each on
    the CPU), kept with the views they were made for."""

    def __init__(self, ops: Ops) -> None:
        self.ops = ops
        self._experts: list[tuple[Tensor, Tensor, Matmul, Matmul]] | None = None

    def _matmuls(self, w13: Tensor, w2: Tensor) -> list[tuple[Tensor, Tensor, Matmul, Matmul]]:
        if self._experts is None or self._experts[0][0].data_ptr() != w13.data_ptr():
            self._experts = [(w13[e], w2[e], self.ops.matmul(), self.ops.matmul())
                             for e in range(w13.shape[0])]
        return self._experts

    def __call__(self, x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor,
                 ids: Tensor) -> Tensor:
        return run_experts(x, self._matmuls(w13, w2), weights, ids)


def run_experts(x: Tensor, experts: list[tuple], weights: Tensor, ids: Tensor) -> Tensor:
    """Each expert (w13_e, w2_e, matmul13, matmul2) with tokens on those tokens, scaled by
    their routing weight and added into the output in expert order."""
    out = torch.zeros_like(x)
    top_k = ids.shape[1]
    counts = torch.bincount(ids.flatten(), minlength=len(experts)).tolist()
    order = ids.flatten().argsort(stable=True)
    for (w13_e, w2_e, matmul13, matmul2), pair in zip(experts, order.split(counts)):
        if pair.numel() == 0:
            continue
        tokens, slot = pair // top_k, pair % top_k
        gate, up = matmul13(x[tokens], w13_e, None).chunk(2, dim=-1)
        y = matmul2(F.silu(gate) * up, w2_e, None)
        out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
    return out


class PackedExperts:
    """Experts whose weights a checkpoint holds packed (`int_weights`): expert by expert,
    each matmul on its expert's packed weight (`int_weights.IntMatmul`); the stacked float
    weights the layer passes are None."""

    def __init__(self, matmuls: list[tuple[Matmul, Matmul]]) -> None:
        self.experts = [(None, None, m13, m2) for m13, m2 in matmuls]

    def __call__(self, x: Tensor, w13: None, w2: None, weights: Tensor, ids: Tensor) -> Tensor:
        return run_experts(x, self.experts, weights, ids)


class QuantizedExperts:
    """Experts whose weights stay quantized (an integer checkpoint's, a GGUF's blocks), run by
    the fused kernel (`Ops.fused_moe`), which unpacks each tile in registers: gate, up and
    down are each a `weight_formats.Stacked`; the stacked float weights the layer passes are
    None."""

    def __init__(self, fused_moe, gate, up, down) -> None:
        self.fused_moe, self.gate_up, self.down = fused_moe, (gate, up), down

    def __call__(self, x: Tensor, w13: None, w2: None, weights: Tensor, ids: Tensor) -> Tensor:
        return self.fused_moe(x, self.gate_up, self.down, weights, ids)


class SparseMoE(nn.Module):
    """The MLP of an MoE layer: router `gate` and the stacked experts, run by the model's
    fused kernel or `ExpertByExpert`."""

    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        # every expert, over this rank's slice of its intermediate features (see `parallel`)
        e, h, i = config.num_experts, config.hidden_size, parallel.local_moe_intermediate(config)
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.round_weights = config.family != "mixtral"  # Qwen3-MoE rounds them
        self.gate = nn.Linear(h, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self.experts = ops.fused_moe or ExpertByExpert(ops)

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize,
                             x.dtype if self.round_weights else None)
        # the ranks' partial sums of each expert's down projection, added
        return parallel.all_reduce_(self.experts(x, self.w13, self.w2, weights, ids))
