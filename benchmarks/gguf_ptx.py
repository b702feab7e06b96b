"""The one-row GGUF GEMV kernels compiled for sm_90 on the CPU (no GPU needed): the width of
their global loads, registers and spills, and the SASS instructions of the main loop per
weight, for the kernel `int_linear` takes for one row (`gguf_gemv`) and the general one it
replaced for those types (`int_linear._gemv_kernel` over `gguf_dequant`); for Q4_K and Q6_K
also the int8-activation kernels (`gguf_dp4a`: its row quantization and GEMVs, with the
count of dp4a instructions in their PTX).

    PYTHONPATH=. python benchmarks/gguf_ptx.py [--types Q4_K,Q6_K] [--dtype bf16]

Why: at batch 1 the loop must spend fewer instructions on a weight than its bytes take to
arrive (on an H100 about 5 a weight for Q4_K's 4.5 bits), and that is readable from the SASS
before any device time is spent. Uses the ptxas and cuobjdump that ship with Triton.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedserve.kernels.triton import gguf_dp4a, gguf_gemv, int_linear
from pagedserve.kernels.weight_formats import WeightFormat

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, signature: dict, constexprs: dict, aligned: set, num_warps: int):
    """triton.compile for sm_90: pointers (and the `aligned` ints) specialized as divisible
    by 16, as a launch on real tensors would."""
    names = list(signature) + list(constexprs)
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in aligned}
    src = ASTSource(fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=1))


def loop_counts(sass: str) -> collections.Counter:
    """Opcode counts of the longest backward-branch loop in a SASS listing."""
    ins = [(int(a, 16), t.strip()) for a, t in
           re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    index = {a: i for i, (a, _) in enumerate(ins)}
    best: list = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            body = ins[index[int(m.group(1), 16)]:i + 1]
            best = body if len(body) > len(best) else best
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                               for _, t in best)


def report(name: str, kernel, weights_per_thread: int) -> None:
    cubin = Path("/tmp") / f"gguf_ptx_{name.replace(' ', '_')}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True,
                           text=True).stdout
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True,
                          text=True).stdout
    ops = loop_counts(sass)
    loads = collections.Counter(re.findall(r"ld\.global[.\w:]*", kernel.asm["ptx"]))
    total = sum(ops.values())
    print(f"{name}: {total} loop instructions / {weights_per_thread} weights a thread = "
          f"{total / weights_per_thread:.2f} a weight; registers {regs.group(1)}, stack "
          f"{regs.group(2)} bytes")
    print("   loads:", dict(loads))
    print("   loop:", dict(ops.most_common(12)))
    print("   between threads in the loop:", {op: ops[op] for op in ("BAR", "LDS", "STS", "SHFL")})
    dp4a = len(re.findall(r"dp4a\.[su]32\.s32", kernel.asm["ptx"]))
    if dp4a:
        print(f"   dp4a in the PTX: {dp4a}; IDP.4A in the loop: {ops['IDP']}")


def report_dp4a(name: str, dt: str) -> None:
    """`gguf_dp4a`'s kernels for `name` (Q4_K or Q6_K): the row's quantization, the GEMV."""
    qtype = int(WeightFormat[f"GGUF_{name}"])
    quant = compile_kernel(gguf_dp4a._quantize_kernel,
                           dict(x_ptr=f"*{dt}", codes_ptr="*i8", scales_ptr="*fp32",
                                sums_ptr="*i32", n_blocks="i32"),
                           dict(BLOCKS=gguf_dp4a.QUANT_BLOCKS), set(), 4)
    report("gguf_dp4a._quantize_kernel", quant, gguf_dp4a.QUANT_BLOCKS * 32 // 128)
    q4_k = qtype == WeightFormat.GGUF_Q4_K
    cfg = gguf_dp4a.Q4_K_ONE_ROW if q4_k else gguf_dp4a.Q6_K_ONE_ROW
    stride = "row_words" if q4_k else "row_halves"
    signature = dict(xq_ptr="*i8", xd_ptr="*fp32", xs_ptr="*i32", w_ptr="*u8",
                     bias_ptr=f"*{dt}", y_ptr=f"*{dt}", part_ptr="*fp32", arrivals_ptr="*i32",
                     N="i32", blocks_per_row="i32", blocks_per_split="i32", **{stride: "i32"})
    constexprs = dict(HAS_BIAS=False, BLOCK_N=cfg.block_n, SB=cfg.block_k // 256, SPLIT_K=2,
                      EVICT="evict_first")
    fn = gguf_dp4a._q4k_kernel if q4_k else gguf_dp4a._q6k_kernel
    kernel = compile_kernel(fn, signature, constexprs, {"row_words"} if q4_k else set(),
                            cfg.num_warps)
    report(f"{name} gguf_dp4a", kernel, cfg.block_n * cfg.block_k // (32 * cfg.num_warps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = parser.parse_args()
    dt = args.dtype
    for name in args.types.split(","):
        qtype = int(WeightFormat[f"GGUF_{name}"])
        old = compile_kernel(
            int_linear._gemv_kernel,
            dict(x_ptr=f"*{dt}", y_ptr=f"*{dt}", bias_ptr=f"*{dt}", data_ptr="*u8",
                 scales_ptr="*u8", zeros_ptr="*u8", g_idx_ptr="*u8", data_stride="i32",
                 scales_stride="i32", N="i32", K="i32", stride_x="i32", stride_y="i32"),
            dict(HAS_BIAS=False, FORMAT=qtype, BITS=0, GROUP=1, HAS_ZEROS=False,
                 HAS_G_IDX=False, BLOCK_N=int_linear.DEFAULT.gemv_block_n,
                 BLOCK_K=int_linear.DEFAULT.gemv_block_k),
            {"data_stride"}, int_linear.DEFAULT.gemv_warps)
        d = int_linear.DEFAULT
        report(f"{name} int_linear._gemv_kernel", old,
               d.gemv_block_n * d.gemv_block_k // (32 * d.gemv_warps))
        q6_k = qtype == WeightFormat.GGUF_Q6_K
        block32 = name in ("Q4_0", "Q4_1", "Q8_0")
        cfg = (gguf_gemv.Q6_K_ONE_ROW if q6_k else gguf_gemv.BLOCK32_ONE_ROW if block32
               else gguf_gemv.ONE_ROW)
        signature = dict(x_ptr=f"*{dt}", w_ptr="*u8", bias_ptr=f"*{dt}", y_ptr=f"*{dt}",
                         part_ptr="*fp32", arrivals_ptr="*i32", N="i32", blocks_per_row="i32",
                         blocks_per_split="i32", row_stride="i32")
        constexprs = dict(HAS_BIAS=False, BLOCK_N=cfg.block_n, SB=cfg.block_k // 256,
                          SPLIT_K=2, EVICT="evict_first")
        if block32:
            signature["row_halves"] = signature.pop("row_stride")
            fn, aligned = gguf_gemv._block32_kernel, set()
            constexprs = dict(HAS_BIAS=False, QTYPE=qtype, BLOCK_N=cfg.block_n,
                              B=cfg.block_k // 32, SPLIT_K=2, EVICT="evict_first")
        elif q6_k:
            signature["row_halves"] = signature.pop("row_stride")
            fn, aligned = gguf_gemv._q6k_kernel, set()
            constexprs["HW"] = gguf_gemv.Q6_K_HALFWORDS
        else:
            signature["row_words"] = signature.pop("row_stride")
            fn, aligned = gguf_gemv._kquant_kernel, {"row_words"}
            constexprs = dict(HAS_BIAS=False, QTYPE=qtype, **{k: v for k, v in
                                                              constexprs.items()
                                                              if k != "HAS_BIAS"})
        new = compile_kernel(fn, signature, constexprs, aligned, cfg.num_warps)
        report(f"{name} gguf_gemv", new,
               cfg.block_n * cfg.block_k // (32 * cfg.num_warps))
        if qtype in gguf_dp4a.TYPES and dt != "fp32":
            report_dp4a(name, dt)


if __name__ == "__main__":
    main()
