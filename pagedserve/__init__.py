"""pagedserve: an LLM serving engine built around a paged KV cache.

The public names are imported lazily so that `import pagedserve.kv_cache` (pure Python) does not
pull in torch and the model code.
"""

from __future__ import annotations

import importlib
import os

# Idle OpenMP threads sleep rather than spin. libgomp, which torch and the native kernels share,
# spins for about 300,000 iterations (milliseconds) after every parallel region by default: on a
# CPU shared with other processes, or one where the engine's own Python thread has work between
# regions, those spinning threads take the cores the work needs (a decode step at 2 threads ran
# several times slower than at 1 under load; see docs/benchmarks.md). libgomp reads this when
# torch first loads it, so it is set here, before any torch import; a user's own setting wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

_EXPORTS = {
    "LLM": "pagedserve.entrypoints.llm",
    "LLMEngine": "pagedserve.frontend.llm_engine",
    "SamplingParams": "pagedserve.sampling_params",
    "RequestOutput": "pagedserve.frontend.outputs",
    "CompletionOutput": "pagedserve.frontend.outputs",
    "LoRARequest": "pagedserve.messages",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
