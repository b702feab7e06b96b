"""Where pagedserve keeps what it derives from its inputs: converted GGUF files, built kernels,
the tokenizer class a folder resolves to; and how an entry is written (whole, or not at all).

A module of its own, importing nothing of the package, so that anything may use it (the
native kernels' build is imported by the model, which the GGUF reader belongs to).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_root() -> Path | None:
    """`$PAGEDSERVE_CACHE`, else ~/.cache/pagedserve; `PAGEDSERVE_CACHE=0` turns caching off."""
    value = os.environ.get("PAGEDSERVE_CACHE")
    if value == "0":
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "pagedserve"


def write_cache_entry(entry: Path, fill: Callable[[Path], object]) -> None:
    """Let `fill` write into a fresh temporary folder, then rename it to `entry` in one step.

    A failure (read-only or full disk, another process renaming its copy first) only costs
    the cache: it is logged and the caller goes on with what it already has in memory.
    """
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        fill(tmp)
        os.rename(tmp, entry)
    except OSError as e:
        if entry.is_dir():  # another process wrote it first: the entry is there
            logger.debug("cache entry %s written by another process first", entry)
        else:
            logger.warning("could not write the cache entry %s: %s", entry, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
