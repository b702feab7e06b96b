"""Every kernel of pagedserve, in one place: `triton/` (GPU kernels, and the CPU under
TRITON_INTERPRET=1 in tests) and `native/` (C for the CPU engine, called through ctypes).

Which implementation runs is chosen once, when an engine loads, by the caller's layer
(`model.ops.select_ops`, `attention.selector`, the sampler's kernels; docs/architecture.md,
"Dispatch"), among these and the eager torch references; the kernels themselves know nothing
of the engine. Importing this package imports no kernel.
"""
