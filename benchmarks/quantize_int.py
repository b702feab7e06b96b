"""Round-to-nearest integer quantization of a float Hugging Face folder, written as each
format's own tool writes it: compressed-tensors `pack-quantized` (llm-compressor's W4A16 /
W8A16), GPTQ (AutoGPTQ's original `checkpoint_format` "gptq") and AWQ (AutoAWQ's GEMM).

Why round to nearest: tests and benchmarks need checkpoints of each layout with known bytes,
and the layout (packing, zero points' storage, g_idx) is what a loader gets wrong; the
calibration (GPTQ's error feedback, AWQ's scale search) only changes which codes are chosen.
`act_order` permutes the columns (a seeded random order, where GPTQ sorts by the Hessian's
diagonal; the same for projections of one input, as GPTQ's) and groups them in that order,
which is what g_idx then records.

Every linear projection of the decoder layers is quantized; the embedding, the LM head and
MoE routers are left as they are (the tools' defaults).

    python benchmarks/quantize_int.py SRC DST --format gptq --bits 4 --group-size 128
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

FORMATS = ("compressed-tensors", "gptq", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_LINEAR = re.compile(r"^model\.layers\.\d+\..*(proj|w1|w2|w3)\.weight$")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [R, C] -> int32 [R, C * bits / 32], low bits first along C (the order
    compressed-tensors' pack_to_int32 and AutoGPTQ's pack both use)."""
    per_word = 32 // bits
    r, c = codes.shape
    padded = torch.zeros(r, -(-c // per_word) * per_word, dtype=torch.int64)
    padded[:, :c] = codes.long()
    words = (padded.view(r, -1, per_word) << (torch.arange(per_word) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize(w: torch.Tensor, bits: int, group: int, symmetric: bool, order: torch.Tensor,
             min_zero: int = 0):
    """w [N, K] -> (unsigned codes [N, K], scales [N, G] float32, zeros [N, G] int64,
    g_idx [K]): columns taken in `order`, `group` at a time (group 0: all of them)."""
    n, k = w.shape
    group = group or k
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    groups = int(g_idx.max()) + 1
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups, dtype=torch.int64)
    top = (1 << bits) - 1
    for g in range(groups):
        cols = w[:, g_idx == g].float()
        if symmetric:
            scales[:, g] = cols.abs().amax(1).clamp(min=1e-8) / ((top - 1) / 2)
            zeros[:, g] = 1 << (bits - 1)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[:, g] = ((hi - lo) / top).clamp(min=1e-8)
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(min_zero, top).long()
    s, z = scales[:, g_idx.long()], zeros[:, g_idx.long()]
    codes = (torch.round(w.float() / s) + z).clamp(0, top).long()
    return codes, scales, zeros, g_idx


def _compressed_tensors(name, codes, scales, zeros, g_idx, bits, symmetric, act_order, dtype):
    m = name.removesuffix(".weight")
    out = {f"{m}.weight_packed": pack(codes, bits), f"{m}.weight_scale": scales.to(dtype),
           f"{m}.weight_shape": torch.tensor(codes.shape)}
    if not symmetric:  # packed along N, offset like the codes
        out[f"{m}.weight_zero_point"] = pack(zeros.t(), bits).t().contiguous()
    if act_order:
        out[f"{m}.weight_g_idx"] = g_idx
    return out


def _gptq(name, codes, scales, zeros, g_idx, bits, symmetric, act_order, dtype):
    m = name.removesuffix(".weight")
    return {f"{m}.qweight": pack(codes, bits).t().contiguous(),
            f"{m}.qzeros": pack((zeros - 1).t(), bits),  # the original format stores z - 1
            f"{m}.scales": scales.t().to(dtype).contiguous(), f"{m}.g_idx": g_idx}


def _awq(name, codes, scales, zeros, g_idx, bits, symmetric, act_order, dtype):
    m = name.removesuffix(".weight")

    def interleave(x):  # [R, C] -> nibble i of word j holds column 8j + AWQ_ORDER[i]
        return x.reshape(x.shape[0], -1, 8)[:, :, list(AWQ_ORDER)].reshape(x.shape[0], -1)

    return {f"{m}.qweight": pack(interleave(codes.t().contiguous()), bits),
            f"{m}.qzeros": pack(interleave(zeros.t().contiguous()), bits),
            f"{m}.scales": scales.t().to(dtype).contiguous()}


def quantization_config(fmt: str, bits: int, group: int, symmetric: bool,
                        act_order: bool) -> dict:
    if fmt == "compressed-tensors":
        weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
                   "strategy": "group" if group else "channel",
                   "group_size": group or None, "actorder": "group" if act_order else None,
                   "dynamic": False, "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "quantization_status": "compressed", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": None,
                                              "format": "pack-quantized"}}}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group or -1,
                "desc_act": act_order, "sym": symmetric, "checkpoint_format": "gptq",
                "true_sequential": True, "lm_head": False}
    return {"quant_method": "awq", "bits": bits, "group_size": group or -1,
            "zero_point": True, "version": "gemm", "modules_to_not_convert": None}


WRITERS = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq}


def quantize_folder(src: Path, dst: Path, fmt: str, bits: int = 4, group: int = 128,
                    symmetric: bool = True, act_order: bool = False, seed: int = 0,
                    dtype: torch.dtype | None = None) -> None:
    """Write `src` (a float safetensors folder) quantized in format `fmt` to `dst`."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}")
    if fmt == "awq" and (bits != 4 or symmetric or act_order):
        raise ValueError("AWQ GEMM checkpoints are 4-bit, with zero points, in column order")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    gen = torch.Generator().manual_seed(seed)
    out, orders = {}, {}
    for file in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if not _LINEAR.match(name) or ".mlp.gate.weight" in name:
                out[name] = tensor if dtype is None else tensor.to(dtype)
                continue
            k = tensor.shape[1]
            # projections of the same input share one order, as GPTQ's (one Hessian) do
            key = re.sub(r"(q|k|v)_proj|(gate|up)_proj|w1|w3", "in", name)
            if key not in orders:
                orders[key] = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
            order = orders[key]
            # GPTQ's original format stores z - 1: zero points of 0 cannot be written
            parts = quantize(tensor, bits, group, symmetric, order,
                             min_zero=1 if fmt == "gptq" else 0)
            out.update(WRITERS[fmt](name, *parts, bits, symmetric, act_order,
                                    dtype or tensor.dtype))
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, bits, group, symmetric, act_order)
    if dtype is not None:
        config.pop("torch_dtype", None)
        config["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--format", choices=FORMATS, default="compressed-tensors")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--group-size", type=int, default=128, help="0: one scale per channel")
    p.add_argument("--asymmetric", action="store_true")
    p.add_argument("--act-order", action="store_true")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default=None)
    a = p.parse_args()
    quantize_folder(a.src, a.dst, a.format, a.bits, a.group_size, not a.asymmetric,
                    a.act_order, dtype=getattr(torch, a.dtype) if a.dtype else None)


if __name__ == "__main__":
    main()
