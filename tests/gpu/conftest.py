"""Without CUDA the GPU checks are not even imported: several import the Triton kernels at
module level, and a kernel jitted outside the interpreter at collection time breaks the
interpreter tests that tests/kernels runs later in the same session."""

import torch

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]
