"""Compile the folder's C sources into one shared library on first use, and load it.

The library is built with the system C compiler (`$CC`, else `cc`; about a second) into the
pagedserve cache, named by a hash of the sources and flags, so an edit rebuilds it and
concurrent builds are harmless (atomic rename). It links `libgomp.so.1`, the OpenMP runtime
torch has already loaded, so kernels and torch share one thread pool; callers pass torch's
thread count. ctypes releases the GIL during each call.

Anything that stops it (no compiler, a CPU without AVX2, a failed build, or
`PAGEDSERVE_NATIVE=0`) is logged once and `library()` returns None: callers fall back to torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from pagedserve.cache import cache_root
from pagedserve.progress import notice

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # shared by the sources: in the hash too
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def _compile(out_dir: Path) -> Path:
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256(" ".join([compiler, *FLAGS]).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.name.encode() + source.read_bytes())
    target = out_dir / f"pagedserve-native-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    notice(f"compiling the native CPU kernels with {compiler} (first run only)")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".pagedserve-native-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, SOURCES)], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{compiler} failed: {e.stderr.strip()}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (logged once) when it cannot be had."""
    if os.environ.get("PAGEDSERVE_NATIVE") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        logger.info("CPU without AVX2: the native kernels are off, torch ops run instead")
        return None
    root = cache_root()
    out_dir = root / "native" if root else Path(tempfile.mkdtemp(prefix="pagedserve-"))
    try:
        return ctypes.CDLL(str(_compile(out_dir)))
    except (OSError, RuntimeError) as e:
        logger.warning("native CPU kernels unavailable (%s): torch ops run instead", e)
        return None
    finally:
        if root is None:  # caching off: a loaded library needs no file
            shutil.rmtree(out_dir, ignore_errors=True)


def function(name: str, *argtypes, restype=None) -> ctypes._CFuncPtr | None:
    """The C function `name` with its argument and result types set, or None without the
    library. Each wrapper looks its functions up once (functools.cache) and keeps them."""
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn
