"""Run every kernel under the Triton interpreter: it must be set before triton jit-decorates
the kernels, i.e. before pagedserve.attention.kernels is imported."""

import os

os.environ["TRITON_INTERPRET"] = "1"
