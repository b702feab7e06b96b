"""A GGUF model's linear layers kept in the file's blocks (on CUDA: `Ops.gguf_linear`).

Why: dequantized to bf16 at load, a 4-bit file takes about four times its size in GPU memory,
and a decode step reads four times the bytes. So the projections stored in a type of
`kernels.gguf_format.BLOCKS` stay as their blocks (uint8 rows, unchanged) and multiply through
the kernels of `kernels/triton/int_linear.py` (the format: `kernels/gguf_format.py`); a layer
whose float weight would never be read gets none (`drop_float`).

A fused layer (q/k/v, gate/up) is kept when every one of its checkpoint tensors is of a kept
type; its shards may differ in type (a Q4_K_M file stores some layers' v in Q6_K and q, k in
Q4_K): each run of one type is one launch, the outputs side by side. An MoE layer's experts
(the file's 3-D `ffn_{gate,up,down}_exps`, [E, rows, row bytes]) are kept when all three are
of kept types (and a tensor-parallel rank's slice of down falls on block boundaries) and the
model has a fused MoE kernel (`Ops.fused_moe`): each projection becomes
a `weight_formats.Stacked` the kernel unpacks in registers (`moe.QuantizedExperts`); gate and
up may differ in type. Anything else (other types, the embedding, routers) is dequantized at
load as before, and the loader logs which types that hit.

Tensor parallelism takes this rank's rows of a column-parallel weight (whole rows of blocks),
and of a row-parallel one (o_proj, down_proj: a range of input features) the bytes of its
blocks, which works when the range starts and ends on a block boundary; else a clear error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.kernels.gguf_format import BLOCKS, GgufWeight, row_bytes
from pagedserve.kernels.weight_formats import stacked
from pagedserve.model import parallel
from pagedserve.model.moe import QuantizedExperts

# an expert's projection, as `gguf._expert_names` names each expert's slice of a stacked one
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
# the HF names of the weights our `Linear` layers (and the untied LM head) multiply by
_LINEAR = re.compile(r"(\.self_attn\.(q|k|v|qkv|o)_proj|\.mlp\.(gate|up|down|gate_up)_proj)"
                     r"\.weight$|^lm_head\.weight$")

GgufLinear = Callable[[Tensor, GgufWeight, "Tensor | None"], Tensor]  # x, weight, bias -> y


@dataclass(frozen=True)
class GgufBlocks:
    """One checkpoint tensor in its GGUF blocks: uint8 [out features, row bytes] of `qtype`,
    each row `in_features` weights."""

    qtype: int
    blocks: Tensor
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's [out, in] (not the blocks' bytes)."""
        return self.blocks.shape[0], self.in_features

    def take(self, dim: int, rows: list[int]) -> GgufBlocks:
        """This rank's slice (`parallel.checkpoint_rows`): output rows (-1: a zero row, which
        every type decodes to zeros) or a range of input features on block boundaries."""
        if dim == 0:
            index = torch.tensor([max(r, 0) for r in rows])
            blocks = self.blocks.index_select(0, index)
            blocks[torch.tensor([r < 0 for r in rows])] = 0
            return GgufBlocks(self.qtype, blocks, self.in_features)
        weights, size = BLOCKS[self.qtype]
        lo, hi = rows[0], rows[-1] + 1
        if rows != list(range(lo, hi)) or lo % weights or hi % weights:
            raise ValueError(f"tensor parallelism splits this weight's input features at "
                             f"{lo}..{hi}, not on the boundaries of its GGUF blocks of "
                             f"{weights} weights: dequantize the file or change the TP size")
        return GgufBlocks(self.qtype, self.blocks[:, lo // weights * size:hi // weights * size],
                          hi - lo)


def is_linear_weight(hf_name: str) -> bool:
    return _LINEAR.search(hf_name.removeprefix("model.")) is not None


class GgufMatmul:
    """A layer's matmul on its GGUF blocks (it ignores the float weight it is passed, which
    the layer does not have): one `linear` launch per run of shards of one type."""

    def __init__(self, linear: GgufLinear, shards: list[GgufBlocks]) -> None:
        self.linear = linear
        runs: list[list[GgufBlocks]] = []
        for shard in shards:
            if runs and runs[-1][0].qtype == shard.qtype:
                runs[-1].append(shard)
            else:
                runs.append([shard])
        self.parts = [GgufWeight(torch.cat([s.blocks for s in run]).contiguous(), run[0].qtype,
                                 run[0].in_features) for run in runs]

    def __call__(self, x: Tensor, weight: Tensor | None, bias: Tensor | None = None) -> Tensor:
        if len(self.parts) == 1:
            return self.linear(x, self.parts[0], bias)
        y = torch.cat([self.linear(x, part, None) for part in self.parts], -1)
        return y if bias is None else y.add_(bias)


def kept_targets(shard_range: Callable, num_shards: Callable,
                 types: dict[str, int]) -> dict[str, set[str]]:
    """Our parameter name -> the HF names filling it, for each linear weight whose every
    shard is stored in a kept type. `types`: HF name -> GGML type of the file's 2-D tensors;
    shard_range / num_shards: the model's (`Decoder`)."""
    targets: dict[str, set[str]] = {}
    refused = set()
    for name, qtype in types.items():
        if is_linear_weight(name):
            target = shard_range(name.removeprefix("model."))[0]
            targets.setdefault(target, set()).add(name)
            if qtype not in BLOCKS:
                refused.add(target)
    return {t: names for t, names in targets.items()
            if t not in refused and len(names) == num_shards(t)}


def drop_float(model: torch.nn.Module, targets: dict[str, set[str]]) -> None:
    """Take the float weight off each kept layer (on the meta device, before the model is
    materialised: it never takes memory)."""
    for target in targets:
        model.get_submodule(target.removesuffix(".weight")).register_parameter("weight", None)


def split_blocks(weights: Iterator[tuple[str, object]], kept: dict[str, GgufBlocks],
                 device: torch.device) -> Iterator[tuple[str, Tensor]]:
    """Pass the float tensors through; put each GgufBlocks into `kept` by HF name, on
    `device`."""
    for name, tensor in weights:
        if isinstance(tensor, GgufBlocks):
            kept[name] = GgufBlocks(tensor.qtype, tensor.blocks.to(device), tensor.in_features)
        else:
            yield name, tensor


def attach(model: torch.nn.Module, linear: GgufLinear, targets: dict[str, set[str]],
           kept: dict[str, GgufBlocks]) -> None:
    """Give each kept layer its `GgufMatmul` (the LM head: the model's `lm_head_matmul`),
    its shards in fused order, checked against the layer's shape."""
    for target, names in targets.items():
        order = {model.shard_range(n.removeprefix("model."))[1]: n for n in names}
        shards = [kept.pop(order[i]) for i in sorted(order)]
        module = model.get_submodule(target.removesuffix(".weight"))
        shape = (sum(s.blocks.shape[0] for s in shards), shards[0].in_features)
        if shape != (module.out_features, module.in_features) or any(
                s.in_features != shape[1] or s.blocks.shape[1] != row_bytes(s.qtype, shape[1])
                for s in shards):
            raise ValueError(f"GGUF blocks of {target} make a {shape} weight, expected "
                             f"{(module.out_features, module.in_features)}")
        matmul = GgufMatmul(linear, shards)
        if target == "lm_head.weight":
            model.lm_head_matmul = matmul
        else:
            module.matmul = matmul


# An MoE layer's kept experts: projection ("gate", "up", "down") -> each expert's HF name
ExpertNames = dict[str, list[str]]


def kept_experts(shard_range: Callable, types: dict[str, int], config,
                 tp: parallel.TensorParallel | None = None) -> dict[str, ExpertNames]:
    """MoE module ("layers.N.mlp") -> its experts' HF names, for each MoE layer whose three
    expert projections are all stored in kept types, sliced by tensor parallelism on block
    boundaries (the others are dequantized: a slice off them would be an error).
    `types`: each expert projection's HF name -> GGML type (`gguf.expert_types`)."""
    layers: dict[str, dict[str, dict[int, str]]] = {}
    refused = set()
    for name, qtype in types.items():
        match = _EXPERT.match(name)
        target = shard_range(name.removeprefix("model."))[0]
        module = target.rsplit(".", 1)[0]
        layers.setdefault(module, {}).setdefault(match[2], {})[int(match[1])] = name
        if qtype not in BLOCKS or not _whole_blocks(name, qtype, config, tp):
            refused.add(module)
    return {module: {proj: [names[e] for e in sorted(names)] for proj, names in projs.items()}
            for module, projs in layers.items() if module not in refused and len(projs) == 3}


def _whole_blocks(name: str, qtype: int, config, tp) -> bool:
    """Whether this rank's slice of a weight cuts its input features (a row-parallel
    layer's) on block boundaries; output rows always are."""
    rows = parallel.checkpoint_rows(name.removeprefix("model."), config, tp)
    if rows is None or rows[0] == 0:
        return True
    weights = BLOCKS[qtype][0]
    return rows[1][0] % weights == 0 and (rows[1][-1] + 1) % weights == 0


def drop_float_experts(model: torch.nn.Module, layers: dict[str, ExpertNames]) -> None:
    """`drop_float` for the kept MoE layers' stacked w13 and w2."""
    for module in layers:
        moe = model.get_submodule(module)
        moe.register_parameter("w13", None)
        moe.register_parameter("w2", None)


def attach_experts(model: torch.nn.Module, fused_moe: Callable,
                   layers: dict[str, ExpertNames], kept: dict[str, GgufBlocks]) -> None:
    """Give each kept MoE layer its `QuantizedExperts`: each projection's experts' blocks
    (this rank's slices) stacked into one tensor, checked against the layer's shape."""
    config = model.config
    hidden, inter = config.hidden_size, parallel.local_moe_intermediate(config)
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    for module, projections in layers.items():
        operands = []
        for proj in ("gate", "up", "down"):
            shards = [kept.pop(name) for name in projections[proj]]
            if len(shards) != config.num_experts or any(
                    s.shape != shapes[proj] or s.qtype != shards[0].qtype for s in shards):
                raise ValueError(f"GGUF blocks of {module}'s {proj} experts make "
                                 f"{[s.shape for s in shards[:1]]} x {len(shards)}, expected "
                                 f"{shapes[proj]} x {config.num_experts}")
            blocks = torch.stack([s.blocks for s in shards])
            operands.append(stacked(GgufWeight(b, shards[0].qtype, shards[0].in_features)
                                    for b in blocks))
        model.get_submodule(module).experts = QuantizedExperts(fused_moe, *operands)
