"""Messages and progress bars for slow first-run work: compiling the C kernels, converting a
GGUF file. Without them a first `pagedserve chat` looks hung for many seconds.

They go to stderr only when it is a terminal, where a person is waiting; in logs, pipes and
tests the message is logged at INFO instead and no bar is drawn. Importing nothing of the
package, so the native build and the model loader may both use it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

logger = logging.getLogger("pagedserve")
T = TypeVar("T")


def notice(message: str) -> None:
    """Tell the person waiting what is being done (one line)."""
    if sys.stderr.isatty():
        print(f"pagedserve: {message}", file=sys.stderr, flush=True)
    else:
        logger.info(message)


def progress(items: Iterable[T], total: int, description: str) -> Iterator[T]:
    """`items` as they are consumed, with a bar on a terminal (removed once done)."""
    return iter(tqdm(items, total=total, desc=description, unit="tensor", leave=False,
                     disable=not sys.stderr.isatty(), file=sys.stderr))
