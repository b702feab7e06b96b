"""pagedserve: an LLM serving engine built around a paged KV cache.

The public names are imported lazily so that `import pagedserve.core` (pure Python) does not
pull in torch and the model code.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "pagedserve.entrypoints.llm",
    "LLMEngine": "pagedserve.engine.llm_engine",
    "SamplingParams": "pagedserve.engine.sampling_params",
    "RequestOutput": "pagedserve.engine.outputs",
    "CompletionOutput": "pagedserve.engine.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
