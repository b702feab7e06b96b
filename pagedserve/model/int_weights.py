"""Integer weight-only checkpoints (W4A16, W8A16): compressed-tensors `pack-quantized`, GPTQ
and AWQ, read from the checkpoint's own `quantization_config`, kept packed on the device.

Why kept packed: a decode step reads every weight once, so 4-bit weights cost about a
quarter of bf16's bytes per step. The three families store the same thing (integer codes,
a scale and a zero point per group of input columns, sometimes a column order) in three
packings; each is converted once, tensor by tensor as it is read, to the one layout the
kernels read (`kernels/weight_formats.IntWeight`: codes along K in int32 words, [N, G]
scales and zeros, g_idx), so the kernels, the reference and tensor parallelism see one
format:

- compressed-tensors `pack-quantized`: `weight_packed` [N, K/8] is that layout already
  (signed codes stored + 2^(bits-1)); `weight_scale` [N, G]; `weight_zero_point` packed
  along N ([N/8, G], also offset) when asymmetric; `weight_g_idx` with actorder "group".
- GPTQ (AutoGPTQ / GPTQModel): `qweight` [K/8, N] packed along K (its transpose is the
  layout), `qzeros` [G, N/8] packed along N, stored minus one in the original format
  (`checkpoint_format` "gptq"; "gptq_v2" stores them as they are), `scales` [G, N], `g_idx`
  [K] (used with `desc_act`).
- AWQ GEMM: `qweight` [K, N/8] packed along N in AWQ's interleaved order (nibble i of a word
  holds column 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]), `qzeros` [G, N/8] likewise, `scales` [G, N].

Which layers are quantized is what the checkpoint holds: a layer whose tensors come packed
is made packed (so an ignored LM head, or an embedding, stays as the checkpoint has it). A
fused layer's parts (q/k/v, gate/up) must agree. MoE experts (Mixtral, Qwen3-MoE) are packed
per expert in stacked parameters ([E, ...] first) and run by the fused MoE kernel, which
unpacks them in registers (`moe.QuantizedExperts`, where the model's `Ops` has one: CUDA), or
else expert by expert (`moe.PackedExperts`). Variants the kernels do not read (3-bit, 2-bit,
GPTQ's marlin / bitblas layouts, AWQ's GEMV / exllama / marlin versions, activation
quantization) are refused by name at load.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from pagedserve.kernels.weight_formats import (IntWeight, Stacked, pack_codes, stacked,
                                               unpack_codes)
from pagedserve.model import parallel

BITS = (4, 8)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of each nibble of a word, within its 8
# our parameter names: the layout `IntWeight` holds
PARAMS = ("qweight", "scales", "zeros", "g_idx")
# checkpoint tensor suffix -> our parameter, per family
_NAMES = {
    "compressed-tensors": {"weight_packed": "qweight", "weight_scale": "scales",
                           "weight_zero_point": "zeros", "weight_g_idx": "g_idx"},
    "gptq": {"qweight": "qweight", "scales": "scales", "qzeros": "zeros", "g_idx": "g_idx"},
    "awq": {"qweight": "qweight", "scales": "scales", "qzeros": "zeros"},
}


@dataclass(frozen=True)
class IntScheme:
    """A checkpoint's integer weight-only quantization, as the loader needs it."""

    method: str  # "compressed-tensors" | "gptq" | "awq"
    bits: int
    group_size: int  # columns per scale; 0: one scale per output channel
    symmetric: bool  # no zero points stored (compressed-tensors only)
    act_order: bool  # columns grouped by g_idx
    zero_offset: int = 0  # added to stored zero points (GPTQ's original format: 1)

    @property
    def name(self) -> str:
        return f"w{self.bits}a16"

    def param_of(self, suffix: str) -> str | None:
        """Our parameter for a checkpoint tensor's last name part; None: not a packed one."""
        name = _NAMES[self.method].get(suffix)
        if name == "g_idx" and not self.act_order:
            return "skip"  # stored, but k // group_size by construction
        return name

    def skipped(self, suffix: str) -> bool:
        return self.method == "compressed-tensors" and suffix == "weight_shape"


def scheme_from_config(raw: dict, where: str) -> IntScheme:
    """The scheme of a `quantization_config` that is not FP8; a ValueError naming what is
    not supported otherwise."""
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw, where)
    if method == "gptq":
        return _gptq(raw, where)
    if method == "awq":
        return _awq(raw, where)
    raise ValueError(f"{where} is quantized with {method!r}, which is not supported: "
                     "compressed-tensors (FP8, W4A16/W8A16 pack-quantized), GPTQ and AWQ "
                     "(4 or 8 bits) are")


def _bits(bits, method: str, where: str) -> int:
    if bits not in BITS:
        raise ValueError(f"{where}: {bits}-bit {method} weights are not supported (4 or 8 "
                         "bits are)")
    return bits


def _compressed_tensors(raw: dict, where: str) -> IntScheme:
    groups = list((raw.get("config_groups") or {}).values())
    if not groups:
        raise ValueError(f"{where}: a compressed-tensors config without config_groups")
    schemes = set()
    for group in groups:
        w = group.get("weights") or {}
        fmt = group.get("format") or raw.get("format")
        if group.get("input_activations") or fmt != "pack-quantized" or w.get("type") != "int":
            raise ValueError(
                f"{where}: compressed-tensors format {fmt!r} with weights {w.get('type')!r} "
                f"and input activations {group.get('input_activations')!r} is not supported "
                "(weight-only int 'pack-quantized' and FP8 are)")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"{where}: int weight strategy {strategy!r} is not supported "
                             "(group and channel are)")
        schemes.add((_bits(w.get("num_bits"), "compressed-tensors", where),
                     w.get("group_size") or 0 if strategy == "group" else 0,
                     bool(w.get("symmetric", True)),
                     w.get("actorder") in ("group", True)))  # True: older configs' "group"
    if len(schemes) > 1:
        raise ValueError(f"{where}: several int weight schemes in one model {sorted(schemes)} "
                         "are not supported")
    bits, group, symmetric, act_order = schemes.pop()
    return IntScheme("compressed-tensors", bits, group, symmetric, act_order)


def _gptq(raw: dict, where: str) -> IntScheme:
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported ('gptq' "
                         "and 'gptq_v2' are)")
    group = raw.get("group_size", 128)
    return IntScheme("gptq", _bits(raw.get("bits"), "GPTQ", where),
                     0 if group in (-1, None) else group, False, bool(raw.get("desc_act")),
                     zero_offset=1 if fmt == "gptq" else 0)


def _awq(raw: dict, where: str) -> IntScheme:
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{where}: AWQ version {version!r} is not supported ('gemm' is)")
    if raw.get("zero_point") is False:
        raise ValueError(f"{where}: AWQ without zero points is not supported")
    group = raw.get("q_group_size", raw.get("group_size", 128))
    bits = raw.get("w_bit", raw.get("bits"))
    if bits != 4:
        raise ValueError(f"{where}: {bits}-bit AWQ weights are not supported (4 bits are)")
    return IntScheme("awq", bits,
                     0 if group in (-1, None) else group, False, False)


def read_scheme(folder: Path) -> IntScheme | None:
    config = folder / "config.json"
    raw = json.loads(config.read_text()).get("quantization_config") if config.exists() else None
    return scheme_from_config(raw, str(folder)) if raw else None


# -- the checkpoint's tensors in our layout ---------------------------------------------


def _awq_codes(words: Tensor, bits: int) -> Tensor:
    """AWQ words [R, C/8] -> codes [R, C] in column order."""
    nibbles = unpack_codes(words, bits, words.shape[1] * (32 // bits))
    nibbles = nibbles.view(words.shape[0], -1, 32 // bits)
    inverse = torch.tensor(AWQ_ORDER).argsort()
    return nibbles[:, :, inverse].reshape(words.shape[0], -1)


def convert(scheme: IntScheme, param: str, tensor: Tensor) -> Tensor:
    """A checkpoint tensor as our parameter `param` (`IntWeight`'s layout, [N, ...] first;
    zero points may keep padding rows past N, which the loader drops)."""
    bits = scheme.bits
    if param == "g_idx":
        return tensor.to(torch.int32)
    if scheme.method == "compressed-tensors":
        if param == "zeros":  # packed along N
            return unpack_codes(tensor.t().contiguous(), bits, tensor.shape[0] * 32 // bits).t()
        return tensor
    if param == "scales":
        return tensor.t()
    if scheme.method == "gptq":
        if param == "qweight":
            return tensor.t().contiguous()
        return (unpack_codes(tensor, bits, tensor.shape[1] * 32 // bits) + scheme.zero_offset).t()
    # awq
    codes = _awq_codes(tensor, bits)
    return pack_codes(codes.t(), bits) if param == "qweight" else codes.t()


def take_shard(param: str, tensor: Tensor, rows: tuple[int, list[int]] | None,
               scheme: IntScheme, act_order: bool) -> Tensor:
    """This rank's part of our parameter `param` (in our layout), given the rows of the
    float weight [N, K] the rank keeps (`parallel.checkpoint_rows`): output rows
    (column-parallel, the vocabulary) are rows of every tensor but g_idx; input columns
    (row-parallel) are whole words of qweight, the columns' g_idx and, without g_idx,
    whole groups of scales and zeros (with g_idx a column may take any group: all kept; the
    loader gives a rank whose columns cut a group such a g_idx, `splits_groups`; MoE experts
    split so are refused)."""
    if rows is None:
        return tensor
    dim, index = rows
    if dim == 0:
        return tensor if param == "g_idx" else parallel.take_rows(tensor, 0, index)
    lo, hi = index[0], index[-1] + 1  # a rank's input columns are one range
    if param == "g_idx":
        return tensor[lo:hi]
    unit = 32 // scheme.bits if param == "qweight" else scheme.group_size
    if param != "qweight" and (act_order or unit == 0):
        return tensor
    if lo % unit or (hi - lo) % unit:
        what = "packed words" if param == "qweight" else "quantization groups"
        raise ValueError(f"tensor parallelism splits the input columns at {lo}, which is not "
                         f"a boundary of the {what} ({unit} columns): use fewer ranks")
    return tensor[:, lo // unit:hi // unit]


# -- the model's layers -------------------------------------------------------------------


def to_int(linear: nn.Module, scheme: IntScheme, act_order: bool, full_k: int,
           derived_order: bool = False) -> None:
    """Replace a linear layer's float weight by (uninitialised) packed parameters on the
    weight's device (meta while the model is built): qweight, scales, zeros (unless
    symmetric), g_idx (with act_order). `full_k`: the unsharded layer's input columns (a
    row-parallel rank keeps every group when g_idx may point anywhere). `derived_order`: a
    row-parallel rank whose columns cut a quantization group (`splits_groups`) keeps every
    group too, and its columns' groups as a g_idx buffer the loader fills (the checkpoint has
    none to load)."""
    n, k = linear.weight.shape
    dtype, device = linear.weight.dtype, linear.weight.device
    groups = 1 if scheme.group_size == 0 else -(-(full_k if act_order or derived_order else k)
                                                // scheme.group_size)

    def param(shape, dt):
        return nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False)

    linear.weight = None
    linear.qweight = param((n, -(-k * scheme.bits // 32)), torch.int32)
    linear.scales = param((n, groups), dtype)
    if not scheme.symmetric:
        linear.zeros = param((n, groups), dtype)
    if act_order:
        linear.g_idx = param((k,), torch.int32)
    elif derived_order:
        linear.register_buffer("g_idx", torch.empty(k, dtype=torch.int32, device=device),
                               persistent=False)
    linear.in_features_packed = k


def splits_groups(scheme: IntScheme, columns: list[int] | None) -> bool:
    """Whether a row-parallel rank's input `columns` (one range; None: all of them) start or
    end inside a quantization group. Such a rank keeps every group and a g_idx of its own
    columns (`to_int`'s derived_order) rather than a slice of whole groups."""
    if columns is None or scheme.group_size == 0:
        return False
    lo, hi = columns[0], columns[-1] + 1
    return bool(lo % scheme.group_size or (hi - lo) % scheme.group_size)


def to_int_experts(moe: nn.Module, scheme: IntScheme, act_order: bool, full_k2: int) -> None:
    """`to_int` for an MoE layer's stacked experts: w13 [E, 2I, H] and w2 [E, H, I] become
    w13_qweight, w13_scales, ... with the expert first (g_idx [E, K]: one order each).
    `full_k2`: w2's unsharded input columns."""
    for base, full_k in (("w13", None), ("w2", full_k2)):
        weight = getattr(moe, base)
        e, n, k = weight.shape
        groups = 1 if scheme.group_size == 0 else -(-((full_k or k) if act_order else k)
                                                    // scheme.group_size)

        def param(shape, dt):
            return nn.Parameter(torch.empty(shape, dtype=dt, device=weight.device),
                                requires_grad=False)

        setattr(moe, base, None)
        setattr(moe, f"{base}_qweight", param((e, n, -(-k * scheme.bits // 32)), torch.int32))
        setattr(moe, f"{base}_scales", param((e, n, groups), weight.dtype))
        if not scheme.symmetric:
            setattr(moe, f"{base}_zeros", param((e, n, groups), weight.dtype))
        if act_order:
            setattr(moe, f"{base}_g_idx", param((e, k), torch.int32))
        setattr(moe, f"{base}_in_features", k)


def drop_packed(module: nn.Module, prefix: str = "") -> None:
    """Free a layer's packed parameters (`prefix`: an MoE layer's "w13_" or "w2_") once its
    matmul holds the weight in another form (the CPU's native blocks, `model.int_native`)."""
    for name in PARAMS:
        if getattr(module, prefix + name, None) is not None:
            setattr(module, prefix + name, None)


def expert_weights(moe: nn.Module, scheme: IntScheme, base: str,
                   rows: tuple[int, int] | None = None) -> list[IntWeight]:
    """Each expert's `IntWeight` of `base` ("w13" or "w2"), over the loaded parameters
    (`rows`: only output rows lo:hi, views, as the fused kernel takes gate and up)."""
    qweight = getattr(moe, f"{base}_qweight")
    k = getattr(moe, f"{base}_in_features")
    zeros, g_idx = getattr(moe, f"{base}_zeros", None), getattr(moe, f"{base}_g_idx", None)
    lo, hi = rows or (0, qweight.shape[1])
    return [IntWeight(qweight[e, lo:hi], getattr(moe, f"{base}_scales")[e, lo:hi],
                      None if zeros is None else zeros[e, lo:hi],
                      None if g_idx is None else g_idx[e],
                      scheme.bits, scheme.group_size or k, k)
            for e in range(qweight.shape[0])]


def stacked_experts(moe: nn.Module, scheme: IntScheme) -> tuple[Stacked, Stacked, Stacked]:
    """The experts' gate, up and down projections as the fused MoE kernel takes them."""
    inter = moe.w13_qweight.shape[1] // 2
    return (stacked(expert_weights(moe, scheme, "w13", (0, inter))),
            stacked(expert_weights(moe, scheme, "w13", (inter, 2 * inter))),
            stacked(expert_weights(moe, scheme, "w2")))


def int_weight(linear: nn.Module, scheme: IntScheme) -> IntWeight:
    """The layer's `IntWeight`, over its loaded parameters."""
    k = linear.in_features_packed
    return IntWeight(linear.qweight, linear.scales, getattr(linear, "zeros", None),
                     getattr(linear, "g_idx", None), scheme.bits, scheme.group_size or k, k)


class IntMatmul:
    """A packed layer's matmul: the model's int linear on its weight (`Ops.int_linear` on an
    `IntWeight`, or what `Ops.int_layer` chose for it at load); the float `weight` argument
    (None) is ignored."""

    def __init__(self, linear, weight) -> None:
        self.linear, self.weight = linear, weight

    def __call__(self, x: Tensor, weight: Tensor | None, bias: Tensor | None = None) -> Tensor:
        return self.linear(x, self.weight, bias)


def reference_linear(x: Tensor, weight: IntWeight, bias: Tensor | None = None) -> Tensor:
    """x @ the dequantized weight^T (+ bias), in x's dtype: the CPU's int matmul."""
    return torch.nn.functional.linear(x, weight.dequantize(x.dtype), bias)


_SUFFIX = re.compile(r"^(.*)\.([^.]+)$")


def packed_modules(names, scheme: IntScheme) -> dict[str, bool]:
    """Checkpoint module names (no `model.` prefix) whose weights come packed -> whether
    they carry a column order (g_idx)."""
    modules: dict[str, bool] = {}
    for name in names:
        module, suffix = _SUFFIX.match(name.removeprefix("model.")).groups()
        param = scheme.param_of(suffix)
        if param == "qweight":
            modules.setdefault(module, False)
        elif param == "g_idx":
            modules[module] = True
    return modules
