"""The K/V store that rotates (`attention/store_kv.rotate_store_kv_`) compiled for sm_90 on the
CPU (no GPU needed), beside the two kernels it replaces (`model_ops.rotate_qk_`, `store_kv`):
registers, spills, and whether its q/k norm sums in the layout `rotate_qk_`'s does.

    PYTHONPATH=. python benchmarks/rotate_store_ptx.py

Why: the fused kernel must write the bits of the two it replaces. They share their arithmetic
(`model_ops.rotated_heads`) and tiles, but the compiler picks each tile's layout from the
loads and stores around it, and a row's float32 sum of squares adds up in the order that
layout gives (elements a thread holds, then lanes). A 16-byte store of 16 FP8 values once
pulled the tile into a layout of 16 elements a thread where `rotate_qk_` has 8: the norm could
then differ in its last bit. This prints the reduce's layout in both and exits non-zero where
they differ or a kernel spills. Uses the ptxas and cuobjdump that ship with Triton.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tempfile

import triton
import triton.language as tl

from benchmarks.gguf_ptx import BIN, compile_kernel
from pagedserve.kernels.triton import model_ops, pdl

pdl._ENABLED = tl.constexpr(True)  # as on the H100: the kernels start with griddepcontrol
store_kv = importlib.import_module("pagedserve.kernels.triton.attention.store_kv")

# (name, q heads, KV heads, head_dim, q/k norm) of one rank
SHAPES = (("llama-3-8b tp2", 16, 4, 128, False), ("llama-3-8b tp1", 32, 8, 128, False),
          ("qwen3-0.6b", 16, 8, 128, True), ("qwen3 tp1 two tiles", 24, 8, 128, True),
          ("d64 gqa8", 8, 1, 64, True))
FP8 = "fp8e4nv"


def usage(kernel) -> tuple[int, int]:
    """(registers, stack bytes) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([BIN / "cuobjdump", "-res-usage", f.name], capture_output=True,
                             text=True).stdout
    regs = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return int(regs.group(1)), int(regs.group(2))


def reduce_layout(kernel) -> str:
    """The layout of the q/k norm's sum-of-squares operand ('' without a norm)."""
    ttgir = kernel.asm["ttgir"]
    used = re.search(r'"tt\.reduce".*?\(tensor<[^,]+, (#\w+)>\)', ttgir, re.S)
    if used is None:
        return ""
    return re.search(rf"^{used.group(1)} = (.*)$", ttgir, re.M).group(1)


def fused(dt: str, cache: str, hq: int, hkv: int, d: int, norm: bool):
    half_pad, block_h = model_ops.rotation_tile(hq + hkv, d)
    sig = dict(qkv_ptr=f"*{dt}", pos_ptr="*i64", cos_ptr=f"*{dt}", sin_ptr=f"*{dt}",
               q_w_ptr=f"*{dt}", k_w_ptr=f"*{dt}", k_cache_ptr=f"*{cache}",
               v_cache_ptr=f"*{cache}", slot_ptr="*i64", k_scale_ptr="*fp32",
               v_scale_ptr="*fp32", stride_tok="i32", eps="fp32")
    constexprs = dict(NUM_Q=hq, NUM_KV=hkv, HEAD_DIM=d, HALF_PAD=half_pad, BLOCK_H=block_h,
                      BLOCK_V=triton.next_power_of_2(hkv * d), HAS_NORM=norm, FP8=cache == FP8)
    return compile_kernel(store_kv._rotate_store_kv_kernel, sig, constexprs, {"stride_tok"},
                          model_ops.ROTATION_WARPS)


def rotate(dt: str, hq: int, hkv: int, d: int, norm: bool):
    half_pad, block_h = model_ops.rotation_tile(hq + hkv, d)
    sig = dict(qkv_ptr=f"*{dt}", pos_ptr="*i64", cos_ptr=f"*{dt}", sin_ptr=f"*{dt}",
               q_w_ptr=f"*{dt}", k_w_ptr=f"*{dt}", stride_tok="i32", eps="fp32")
    constexprs = dict(NUM_Q=hq, NUM_ROT=hq + hkv, HEAD_DIM=d, HALF_PAD=half_pad,
                      BLOCK_H=block_h, HAS_NORM=norm)
    return compile_kernel(model_ops._rotate_qk_kernel, sig, constexprs, {"stride_tok"},
                          model_ops.ROTATION_WARPS)


def store(dt: str, cache: str, hkv: int, d: int):
    sig = dict(k_ptr=f"*{dt}", v_ptr=f"*{dt}", k_cache_ptr=f"*{cache}",
               v_cache_ptr=f"*{cache}", slot_ptr="*i64", k_scale_ptr="*fp32",
               v_scale_ptr="*fp32", stride_k="i32", stride_v="i32")
    constexprs = dict(ROW=hkv * d, BLOCK=triton.next_power_of_2(hkv * d), HEAD_DIM=d,
                      FP8=cache == FP8)
    return compile_kernel(store_kv._store_kv_kernel, sig, constexprs, {"stride_k", "stride_v"},
                          4)


def main() -> int:
    bad = 0
    for name, hq, hkv, d, norm in SHAPES:
        for dt in ("bf16", "fp16", "fp32"):
            alone = rotate(dt, hq, hkv, d, norm)
            for cache in (dt, FP8):
                kernel = fused(dt, cache, hq, hkv, d, norm)
                regs, stack = usage(kernel)
                s_regs, s_stack = usage(store(dt, cache, hkv, d))
                r_regs, r_stack = usage(alone)
                same = reduce_layout(kernel) == reduce_layout(alone)
                bad += stack > 0 or not same
                print(f"{name} {dt} cache {cache}: fused {regs} registers, stack {stack}; "
                      f"rotate_qk_ {r_regs}/{r_stack}, store_kv {s_regs}/{s_stack}; "
                      f"norm layout {'as rotate_qk_' if same else 'DIFFERS'}"
                      + (f" ({reduce_layout(kernel)})" if norm else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
