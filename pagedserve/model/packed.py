"""How a float linear layer multiplies on the CPU: its weight prepacked for the native GEMM or
oneDNN (`PackedWeight`, `Packing`), or a GGUF's quantized blocks in the fast mode
(`QuantizedMatmul`). Which one a model's layers take is chosen once, when it loads
(`select_packing`, through `model.ops.select_ops`); the decoder's linears, its LM head and the
MoE experts alike call what they were given: `matmul(x, weight, bias)`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels.native import linear as native_linear
from pagedserve.kernels.native.quant import QuantizedLinear

# Row count oneDNN tunes a packed weight's layout for: a decode batch. Any row count works.
PACK_ROWS_HINT = 16


@dataclass(frozen=True)
class Packing:
    """A kernel on prepacked weights: `pack(weight)` lays a weight out once, `linear(x,
    packed, weight, bias)` multiplies by it."""

    pack: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                     torch.Tensor]


NATIVE = Packing(native_linear.pack,
                 lambda x, packed, weight, bias: native_linear.linear(x, packed,
                                                                      weight.shape[0], bias))
ONEDNN = Packing(lambda weight: torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT),
                 lambda x, packed, weight, bias: torch.ops.mkldnn._linear_pointwise(
                     x, packed, bias, "none", [], ""))


def select_packing(device: torch.device, dtype: torch.dtype) -> Packing | None:
    """The packed kernel for a model's float linears on `device` in `dtype`: the native one
    where the library has it for the dtype (float32; bfloat16 on AMX), else oneDNN for float32,
    else None (F.linear)."""
    if device.type != "cpu":
        return None
    if native_linear.available(dtype):
        return NATIVE
    if torch.backends.mkldnn.is_available() and dtype == torch.float32:
        return ONEDNN
    return None


class PackedWeight:
    """A layer's matmul on a prepacked copy of its float32 (or bfloat16) weight, for inference
    on the CPU.

    Why: at decode batch sizes (1 to a few dozen rows) MKL's sgemm behind `F.linear` re-lays out
    the weight on every call and reads it from DRAM before computing. The copy is packed for our
    kernel (`kernels/native/linear.c`), which streams the weight while it computes, else (no C
    compiler, no AVX2) for oneDNN (docs/benchmarks.md has the figures). Products and float32
    accumulation are the same; only the summation order differs, so results differ from
    `F.linear` in the last bits (tests hold logits to transformers' within 5e-4 and greedy
    tokens exactly). The copy costs the weight's memory once more. It is rebuilt when the weight
    is written (version counter) or replaced. A bfloat16 weight is packed for the native AMX
    kernel (bfloat16 products, float32 sums, the output rounded to bfloat16 as F.linear's).
    While autograd records, and for a weight made under inference mode (no version counter to
    watch), `F.linear` runs instead: the packed kernels have no backward.
    """

    def __init__(self, packing: Packing) -> None:
        self.packing = packing
        self._source: torch.Tensor | None = None  # the weight the copy was made from
        self._key: tuple[int, int] | None = None  # its storage and version at the time
        self._packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_grad_enabled() or weight.is_inference():
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version)
        if weight is not self._source or key != self._key:
            self._packed = self.packing.pack(weight.detach())
            self._source, self._key = weight, key
        return self.packing.linear(x, self._packed, weight, bias)


class QuantizedMatmul:
    """A layer's matmul on the fast mode's GGUF blocks (`QuantizedLinear`, int8 activations;
    not exact, see `pagedserve.kernels.native.quant`) instead of its float weight, which it
    ignores. Given to float32 CPU layers only, by the loader."""

    def __init__(self, quantized: QuantizedLinear) -> None:
        self.quantized = quantized

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.quantized(x, bias)
