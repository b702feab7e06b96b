"""LoRA adapters through the live server: `--lora-modules`, `model` naming an adapter, /v1/models
listing them with their parent, loading, using, unloading (refused while a request runs under
the adapter) and reloading at runtime, the refusals (unknown adapter 404, bad adapter 400 with
nothing loaded), and the per-adapter request counts in /metrics."""

from __future__ import annotations

import httpx
import pytest

from tests.lora_adapters import base_checkpoint, make_adapters
from tests.server.conftest import start_server, stop_server

pytest.importorskip("peft")

BASE = "tiny-base"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = base_checkpoint(root, "tiny-llama3")
    make_adapters(base, root)
    return base, root


@pytest.fixture(scope="module")
def server(folders):
    base, root = folders
    srv = start_server("--model", str(base), "--served-model-name", BASE, "--enable-lora",
                       "--max-loras", "2", "--max-lora-rank", "8", "--block-size", "4",
                       "--lora-modules", f"a={root / 'all-r8'}",
                       "--allow-runtime-lora-updating")
    yield srv
    stop_server(srv)


def complete(server, model: str, max_tokens: int = 6) -> httpx.Response:
    return httpx.post(server.base_url + "/completions", timeout=120, json={
        "model": model, "prompt": [5, 77, 200, 13, 9, 250, 31, 64, 101], "temperature": 0,
        "max_tokens": max_tokens, "ignore_eos": True})


def tokens(response: httpx.Response) -> str:
    """The completion's text (byte-level tokens: the text is the tokens)."""
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def models(server) -> dict[str, dict]:
    return {card["id"]: card for card in httpx.get(server.base_url + "/models").json()["data"]}


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def test_adapters_listed_and_selected_by_model(server, folders):
    listed = models(server)
    assert listed[BASE]["parent"] is None
    assert listed["a"]["parent"] == BASE and listed["a"]["root"].endswith("all-r8")
    answer_base, answer_a = complete(server, BASE), complete(server, "a")
    assert answer_base.json()["model"] == BASE and answer_a.json()["model"] == "a"
    base, under_a = tokens(answer_base), tokens(answer_a)
    assert under_a != base
    assert tokens(complete(server, "a")) == under_a
    missing = complete(server, "nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    counts = server.metrics()
    assert counts["pagedserve_lora_requests_total{lora_name=a}"] >= 2


def test_load_use_unload_reload(server, folders):
    _, root = folders
    path = str(root / "qv-r4-rslora")
    assert post(server, "/load_lora_adapter", lora_name="b", lora_path=path).status_code == 200
    assert models(server)["b"]["parent"] == BASE
    first = tokens(complete(server, "b"))
    assert first != tokens(complete(server, BASE))
    taken = post(server, "/load_lora_adapter", lora_name="b", lora_path=path)
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"

    with httpx.stream("POST", server.base_url + "/completions", timeout=120, json={
            "model": "b", "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # running now
        busy = post(server, "/unload_lora_adapter", lora_name="b")
        assert busy.status_code == 409 and busy.json()["error"]["param"] == "lora_name"
        assert "b" in models(server)
        for _ in lines:  # let it finish
            pass
    assert post(server, "/unload_lora_adapter", lora_name="b").status_code == 200
    assert "b" not in models(server)
    assert complete(server, "b").status_code == 404
    assert post(server, "/unload_lora_adapter", lora_name="b").status_code == 404

    assert post(server, "/load_lora_adapter", lora_name="b", lora_path=path).status_code == 200
    assert tokens(complete(server, "b")) == first
    assert server.wait_idle()["pagedserve_kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("case", ["missing", "rank", "not-peft"])
def test_bad_adapters_are_refused_with_nothing_loaded(server, folders, tmp_path, case):
    _, root = folders
    path = {"missing": tmp_path / "nowhere", "rank": root / "mlp-o-r16",  # rank 16 > 8
            "not-peft": folders[0]}[case]
    refused = post(server, "/load_lora_adapter", lora_name="bad", lora_path=str(path))
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "lora_path"
    assert {"missing": "adapter_config", "rank": "max_lora_rank",
            "not-peft": "adapter_config"}[case] in error["message"]
    assert "bad" not in models(server)
    assert complete(server, "bad").status_code == 404
