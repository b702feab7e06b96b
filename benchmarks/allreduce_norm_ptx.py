"""The one-shot fused all-reduce + add + RMSNorm (kernels/triton/allreduce_norm.py) compiled
for sm_90 on the CPU (no GPU needed), reading the peers' rows and pushing its own: the global
memory instructions of its PTX, counted, and the order of the first stores, the barrier's
release and acquire, and the first loads after it.

    PYTHONPATH=. python benchmarks/allreduce_norm_ptx.py

Why: what the pushing variant relies on can be read before any device time is spent: its
stores to the peers are 16-byte vectors (`st.global.v4`), a CTA barrier (`bar.sync`) stands
between them and the flag's release at system scope (`red...sys.release`), the acquire is at
system scope too, and the rows pushed to it are read after another CTA barrier from L2
(`ld.global.cg`). Whether the GPU honours that order is the GPU tests' to show.
"""

from __future__ import annotations

import collections
import re

import triton.language as tl

from pagedserve.kernels.triton import pdl

pdl._ENABLED = tl.constexpr(True)  # as on an H100: the PDL wait compiled in

from benchmarks.gguf_ptx import compile_kernel  # noqa: E402
from pagedserve.kernels.triton import allreduce_norm  # noqa: E402

SIGNATURE = dict(buffers_ptr="*i64", signals_ptr="*i64", res_ptr="*bf16", w_ptr="*bf16",
                 out_ptr="*bf16", arrivals_ptr="*i32", rank="i32", buffer_offset="i32",
                 part_stride="i32", signal_offset="i32", num_rows="i32", stride_res="i32",
                 stride_out="i32", eps="fp32")
# the ints a launch specializes as divisible by 16 (offsets into 16-byte aligned buffers)
ALIGNED = {"buffer_offset", "part_stride", "signal_offset", "stride_res", "stride_out"}
MEMORY_OP = re.compile(r"\b(?:ld\.global|st\.global|red\.global|atom|bar\.sync|fence|membar)"
                       r"[.\w:]*")


def compile_one(world: int, n: int, push: bool):
    """The kernel for a Llama-3-8B decode token (one row of `n` bf16) at `world` ranks, split
    over programs as `programs_per_row` picks for one row."""
    split = allreduce_norm.programs_per_row(1, n, world)
    slice_size = n // split
    return split, compile_kernel(
        allreduce_norm._all_reduce_add_rms_norm_kernel, SIGNATURE,
        dict(N=n, BLOCK=n, SPLIT=split, SLICE=slice_size, SLICE_BLOCK=slice_size, WORLD=world,
             PUSH=push), ALIGNED, allreduce_norm.norm_warps(n))


def main() -> None:
    for world in (2, 4):
        for push in (False, True):
            split, kernel = compile_one(world, 4096, push)
            ops = MEMORY_OP.findall(kernel.asm["ptx"])
            print(f"WORLD={world} SPLIT={split} {'push' if push else 'pull'}:")
            for op, count in sorted(collections.Counter(ops).items()):
                print(f"  {count:3d} {op}")
            print("  in order: " + " ".join(ops[:14]) + " ...")


if __name__ == "__main__":
    main()
