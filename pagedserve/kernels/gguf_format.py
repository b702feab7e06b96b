"""The GGUF block types the GPU keeps quantized (`kernels/triton/gguf_linear.py`) and their
block sizes. Here, at the bottom of the tree and without triton or the `gguf` package, so the
loader can tell which of a file's tensors stay in blocks on any machine."""

from __future__ import annotations

# GGML type ids, as `gguf.GGMLQuantizationType` numbers them
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
# type -> (weights per block, bytes per block)
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144),
          Q5_K: (256, 176), Q6_K: (256, 210)}


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of k weights in `qtype`'s blocks."""
    weights, size = BLOCKS[qtype]
    if k % weights:
        raise ValueError(f"GGUF type {qtype}: K = {k} is not a multiple of its {weights}-weight "
                         "blocks")
    return k // weights * size
