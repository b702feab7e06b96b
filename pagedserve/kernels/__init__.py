"""Every kernel of pagedserve, in one place: `triton/` (GPU kernels, and the CPU under
TRITON_INTERPRET=1 in tests) and `native/` (C for the CPU engine, called through ctypes).

The callers (the attention backends, the decoder's ops, the sampler) choose among these and
the eager torch references; the kernels themselves know nothing of the engine. Importing this
package imports no kernel.
"""
