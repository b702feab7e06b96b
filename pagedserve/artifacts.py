"""Where pagedserve keeps what it derives from its inputs: converted GGUF files, built kernels.

A module of its own, importing nothing of the package, so that anything may use it (the
native kernels' build is imported by the model, which the GGUF reader belongs to).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path | None:
    """`$PAGEDSERVE_CACHE`, else ~/.cache/pagedserve; `PAGEDSERVE_CACHE=0` turns caching off."""
    value = os.environ.get("PAGEDSERVE_CACHE")
    if value == "0":
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "pagedserve"
