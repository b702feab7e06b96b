"""Triton kernels and their launchers: `attention/` (store-KV, paged decode and prefill,
block copies), `sampling` and `filtered_sampling` (the sampler's fused draws), `model_ops`
(the decoder's fused elementwise ops), `fp8_linear` (FP8 activation quantization and
weight-only GEMVs), `moe` (the fused MoE GEMMs); and what several of them share: `pdl`
(programmatic dependent launch), `arrivals` (last-program counters), `e4m3` (FP8 reads and
rounding), `precision` (tl.dot's input precision), `gumbel` (Philox Gumbel noise and the
argmax order of the samplers).

Importing this package compiles and imports nothing. Each kernel is jitted when its module is
imported, and triton reads TRITON_INTERPRET then: on a CPU the kernels run only if it was set
to 1 before (tests/kernels/conftest.py does; so `get_attention_backend("triton", "cpu")`).
"""
