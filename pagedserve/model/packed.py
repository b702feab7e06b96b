"""PackedWeight: a CPU linear layer's weight, prepacked for the native GEMM (or oneDNN), used
by the decoder's linears and the MoE experts alike."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.native import linear as native_linear
from pagedserve.kernels.native import quant as native_quant
from pagedserve.kernels.native.quant import QuantizedLinear

# Row count oneDNN tunes a packed weight's layout for: a decode batch. Any row count works.
PACK_ROWS_HINT = 16


class PackedWeight:
    """A prepacked copy of a float32 (or bfloat16) weight, used for inference on the CPU.

    Why: at decode batch sizes (1 to a few dozen rows) MKL's sgemm behind `F.linear` re-lays out
    the weight on every call and reads it from DRAM before computing. The copy is packed for our
    AVX2 kernel (`kernels/native/linear.c`), which streams the weight while it computes, else
    (no C compiler, no AVX2) for oneDNN. On the 2-core dev box one decode step's 120 layer GEMMs
    + LM head at batch 16 take ~110 ms with `F.linear`, ~65 ms with oneDNN and ~37 ms with the
    kernel (docs/benchmarks.md). Products and float32 accumulation are the same; only the
    summation order differs, so results differ from `F.linear` in the last bits (tests hold
    logits to transformers' within 5e-4 and greedy tokens exactly). The copy costs the weight's
    memory once more. It is rebuilt when the weight is written (version counter) or replaced;
    anything else (GPU, other dtypes, autograd, weights made under inference mode) takes
    `F.linear`. A bfloat16 weight (`--dtype bfloat16`) is packed for the native AMX kernel where
    `native_linear.available(torch.bfloat16)` (bfloat16 products, float32 sums, the output
    rounded to bfloat16 as F.linear's; ~1.7x oneDNN's `F.linear` in a decode step), else it too
    takes `F.linear`. In the fast mode a GGUF's quantized blocks (`quantized`) take the place of
    both (int8 activations; not exact, see `pagedserve.kernels.native.quant`).
    """

    def __init__(self) -> None:
        self._source: torch.Tensor | None = None  # the weight the copy was made from
        self._key: tuple[int, int] | None = None  # its storage and version at the time
        self._packed: torch.Tensor | None = None
        # The fast mode's GGUF blocks (set by the loader): used instead of the float weight
        # for float32 inference on the CPU when the quantized kernel is built.
        self.quantized: QuantizedLinear | None = None

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.quantized is not None and x.dtype == torch.float32 and x.is_cpu and (
                not torch.is_grad_enabled() and native_quant.available()):
            return self.quantized(x, bias)
        if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != weight.dtype or (
                weight.is_inference()):  # (an inference tensor has no version counter)
            return F.linear(x, weight, bias)
        native = native_linear.available(weight.dtype)  # (a GPU process never asks)
        if not (native or (_ONEDNN and weight.dtype == torch.float32)):
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version)
        if weight is not self._source or key != self._key:
            self._packed = (native_linear.pack(weight.detach()) if native else
                            torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                    PACK_ROWS_HINT))
            self._source, self._key = weight, key
        if native:
            return native_linear.linear(x, self._packed, weight.shape[0], bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")


_ONEDNN = torch.backends.mkldnn.is_available()
