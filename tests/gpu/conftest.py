"""Without CUDA the GPU checks are not even imported: several import the Triton kernels at
module level, and a kernel jitted outside the interpreter at collection time breaks the
interpreter tests that tests/kernels runs later in the same session.

The random Qwen3-0.6B-shaped bf16 checkpoint and its loaded weights are made once per session
and shared by every module that runs the engine on them: making and loading them is most of a
module's time, and all of tests/gpu has to run in one process.
"""

import os

import pytest
import torch

from tests.gpu.checkpoints import QWEN3_0_6B, random_checkpoint

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    """$PAGEDSERVE_GPU_CHECKPOINT, or a random checkpoint made with benchmarks/make_checkpoint.py
    (LM head untied and scaled x25 so that greedy agreement means something)."""
    path = os.environ.get("PAGEDSERVE_GPU_CHECKPOINT")
    if path:
        return path
    return random_checkpoint(tmp_path_factory.mktemp("qwen3-random"), QWEN3_0_6B, "bfloat16")


@pytest.fixture(scope="session")
def loaded(checkpoint):
    from pagedserve.config import EngineConfig
    from pagedserve.frontend.llm_engine import LoadedModel

    return LoadedModel.load(EngineConfig(model=checkpoint, device="cuda"))
