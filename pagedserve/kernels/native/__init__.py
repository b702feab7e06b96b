"""Native CPU kernels: C with AVX2/FMA intrinsics and OpenMP, for the float32 CPU engine.

Why C: on a CPU the decode step is a few hundred small operations, and torch's kernels lose
to their own overhead there (the GEMMs at decode batch sizes, the attention over a handful of
cached tokens, the elementwise ops around them). Every `*.c` file in this folder is compiled
into one shared library on first use (`build.py`) and called through ctypes; each Python
module next to it wraps one C file and checks its inputs. torch's eager ops remain the
reference the tests hold these kernels to, and the fallback when the library cannot be built.
"""
