"""Building the native library: named by a hash of sources and flags, reused when present,
a clear error without a compiler (which `library()` turns into the torch fallback)."""

from __future__ import annotations

import shutil

import pytest

from pagedserve.native import build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def test_builds_once_and_reuses(tmp_path, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    first = build._compile(tmp_path)
    assert first.exists() and first.parent == tmp_path
    stamp = first.stat().st_mtime_ns
    assert build._compile(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(RuntimeError, match="no C compiler 'no-such-compiler'"):
        build._compile(tmp_path)
