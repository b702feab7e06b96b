"""A bounded schemathesis run over the server's own /openapi.json (issue 29): every operation,
its coverage and fuzzing phases, with two checks: no 5xx, and every status the server sends
is one the document declares for that operation.

Its own server: max_model_len 64, so that the valid requests schemathesis makes (any
max_tokens the document allows) stay short on a CPU; an API key, so the auth layer is in the
path of every request. The run stops after `MAX_TIME_S` whatever it has covered (about 3,600
cases on the dev box in 45 s).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import start_server, stop_server

MAX_TIME_S = 40
KEY = "st-key"


@pytest.fixture(scope="module")
def fuzzed():
    srv = start_server("--max-model-len", "64", "--api-key", KEY, "--request-timeout", "30")
    yield srv
    stop_server(srv)


def _schemathesis() -> str:
    found = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("schemathesis is not installed (pip install -e '.[test]')")
    return found


def test_openapi_document_holds_under_schemathesis(fuzzed, tmp_path):
    run = subprocess.run(
        [_schemathesis(), "run", fuzzed.url + "/openapi.json", "--header",
         f"Authorization: Bearer {KEY}", "--checks", "not_a_server_error,status_code_conformance",
         "--phases", "coverage,fuzzing", "--max-time", str(MAX_TIME_S), "--max-examples", "50",
         "--request-timeout", "60", "--generation-database", "none", "--no-color",
         "--max-failures", "10", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=MAX_TIME_S * 6,
        cwd=tmp_path)  # its crash cache (.schemathesis/) stays out of the checkout
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-20000:]
    assert "12 selected / 12 total" in output, output[-5000:]
    assert " failed" not in output.split("SUMMARY")[-1], output[-5000:]
    assert fuzzed.proc.poll() is None  # still serving
    m = fuzzed.wait_idle()
    assert m["pagedserve_kv_cache_usage_perc"] == 0.0
