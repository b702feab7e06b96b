"""Building the native library: named by a hash of sources and flags, reused when present,
a clear error without a compiler (which `library()` turns into the torch fallback)."""

from __future__ import annotations

import shutil

import pytest

from pagedserve.kernels.native import build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def test_builds_once_and_reuses(tmp_path, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    first = build.compile_variant(tmp_path)
    assert first.exists() and first.parent == tmp_path
    stamp = first.stat().st_mtime_ns
    assert build.compile_variant(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(RuntimeError, match="no C compiler 'no-such-compiler'"):
        build.compile_variant(tmp_path)


AVX2 = {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}


@pytest.mark.parametrize("flags,expected", [
    (set(), None),
    ({"avx", "sse4_2"}, None),
    ({"avx2", "f16c"}, None),  # no FMA
    (AVX2, "avx2"),
    (AVX2 | {"avx_vnni"}, "avxvnni"),
    (AVX2 | {"avx512f", "avx512bw", "avx512vl"}, "avx2"),  # AVX-512 without VNNI/BF16
    (AVX512, "avx512"),
    (AVX512 | {"avx_vnni", "amx_tile", "amx_int8"}, "avx512"),
])
def test_selects_the_best_variant_the_cpu_reports(flags, expected):
    chosen = build.select_variant(frozenset(flags))
    assert (chosen and chosen.name) == expected


def test_a_cap_falls_back_to_a_lower_variant():
    flags = frozenset(AVX512 | {"avx_vnni"})
    assert build.select_variant(flags, "avxvnni").name == "avxvnni"
    assert build.select_variant(flags, "avx2").name == "avx2"
    assert build.select_variant(frozenset(AVX2), "avx512").name == "avx2"
    with pytest.raises(ValueError, match="PAGEDSERVE_NATIVE_ISA='sse'"):
        build.select_variant(flags, "sse")


def test_a_cpu_without_avx2_gets_no_library(monkeypatch):
    """The torch fallback: `library()` is None, so every wrapper reports unavailable."""
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    build.variant.cache_clear()
    build.library.cache_clear()
    try:
        assert build.variant() is None and build.library() is None
    finally:
        build.variant.cache_clear()
        build.library.cache_clear()


@pytest.mark.parametrize("variant", build.VARIANTS, ids=lambda v: v.name)
def test_every_variant_compiles(tmp_path, variant):
    """Also those this CPU cannot run: they must be ready for the CPUs that report them."""
    library = build.compile_variant(tmp_path, variant)
    assert library.exists() and variant.name in library.name
