"""Compile the folder's C sources into one shared library on first use, and load it.

One library per instruction-set variant (`VARIANTS`): the same sources, compiled with each
variant's flags, so the kernels' `#if`s pick its instructions (AVX-VNNI / AVX512-VNNI integer
dot products) and the compiler may use them elsewhere. The best variant whose CPU flags
(/proc/cpuinfo, as the kernel enabled them) are all present is built and loaded; a CPU
without AVX2 + FMA gets none. `PAGEDSERVE_NATIVE_ISA=<variant>` caps the choice (to compare
variants, or to leave out one that misbehaves); the others still compile anywhere gcc does.

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
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pagedserve.artifacts import cache_root
from pagedserve.progress import notice

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # shared by the sources: in the hash too
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]


@dataclass(frozen=True)
class Variant:
    name: str
    cpu_flags: frozenset[str]  # as /proc/cpuinfo spells them; all are needed
    compile_flags: tuple[str, ...]


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
# In order of preference, best last.
VARIANTS = (
    Variant("avx2", frozenset({"avx2", "fma", "f16c"}), _AVX2),
    Variant("avxvnni", frozenset({"avx2", "fma", "f16c", "avx_vnni"}), (*_AVX2, "-mavxvnni")),
    Variant("avx512", frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                 "avx512_vnni", "avx512_bf16"}),
            (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16")),
)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the OS reports them (empty where it does not)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_bf16_compute(flags: frozenset[str]) -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX-512-BF16 or AMX-BF16): without it a
    bfloat16 model on the CPU converts every weight on every use and runs slower than float32."""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def select_variant(flags: frozenset[str], cap: str | None = None) -> Variant | None:
    """The best variant the flags allow, at most `cap` (a variant name); None below AVX2."""
    names = [v.name for v in VARIANTS]
    if cap is not None and cap not in names:
        raise ValueError(f"PAGEDSERVE_NATIVE_ISA={cap!r}: expected one of {names}")
    allowed = VARIANTS[: names.index(cap) + 1] if cap else VARIANTS
    usable = [v for v in allowed if v.cpu_flags <= flags]
    return usable[-1] if usable else None


def compile_variant(out_dir: Path, variant: Variant = VARIANTS[0]) -> Path:
    """The library built for `variant` in `out_dir` (reused while its sources and flags are
    unchanged). Public so that each variant can be built and checked on a CPU that runs it,
    not only the one `load` picks."""
    compiler = os.environ.get("CC", "cc")
    flags = [*FLAGS, *variant.compile_flags]
    digest = hashlib.sha256(" ".join([compiler, *flags]).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.name.encode() + source.read_bytes())
    target = out_dir / f"pagedserve-native-{variant.name}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    notice(f"compiling the native CPU kernels with {compiler} (first run only)")
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".pagedserve-native-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, *map(str, SOURCES)], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{compiler} failed: {e.stderr.strip()}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@cache
def variant() -> Variant | None:
    """The variant this process runs (None: no native kernels)."""
    if os.environ.get("PAGEDSERVE_NATIVE") == "0":
        return None
    chosen = select_variant(cpu_flags(), os.environ.get("PAGEDSERVE_NATIVE_ISA") or None)
    if chosen is None:
        logger.info("CPU without AVX2 + FMA: the native kernels are off, torch ops run instead")
    return chosen


@cache
def library() -> ctypes.CDLL | None:
    """The loaded library of `variant()`, or None (logged once) when it cannot be had."""
    chosen = variant()
    if chosen is None:
        return None
    root = cache_root()
    out_dir = root / "native" if root else Path(tempfile.mkdtemp(prefix="pagedserve-"))
    try:
        return ctypes.CDLL(str(compile_variant(out_dir, chosen)))
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
