"""Run every kernel under the Triton interpreter: it must be set before triton jit-decorates
the kernels, i.e. before any of pagedserve.kernels.triton is imported."""

import os

os.environ["TRITON_INTERPRET"] = "1"
