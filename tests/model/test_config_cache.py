"""ModelConfig.from_hf_folder keeps what it read in the artifact cache: a second start-up reads
it back without importing transformers, and any change to the folder's files is read anew."""

import json
import os
import subprocess
import sys
from pathlib import Path

from pagedserve.model.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "benchmarks" / "configs" / "qwen3-0.6b.json"


def folder_with(tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    config = json.loads(CONFIG.read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def read_in_a_fresh_process(folder: Path, cache: Path) -> dict:
    code = ("import json, sys; from pagedserve.model.config import ModelConfig; "
            f"c = ModelConfig.from_hf_folder({str(folder)!r}); "
            "print(json.dumps({'layers': c.num_layers, 'eos': c.eos_token_ids, "
            "'transformers': 'transformers' in sys.modules}))")
    env = {**os.environ, "PAGEDSERVE_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_read_comes_from_the_cache_without_transformers(tmp_path):
    folder, cache = folder_with(tmp_path), tmp_path / "cache"
    first = read_in_a_fresh_process(folder, cache)
    second = read_in_a_fresh_process(folder, cache)
    assert first["transformers"] and not second["transformers"]
    assert first["layers"] == second["layers"] == json.loads(CONFIG.read_text())[
        "num_hidden_layers"]


def test_the_cached_config_equals_the_read_one_and_follows_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    folder = folder_with(tmp_path)
    read = ModelConfig.from_hf_folder(folder)
    assert ModelConfig.from_hf_folder(folder) == read
    folder_with(tmp_path, num_hidden_layers=3)
    assert ModelConfig.from_hf_folder(folder).num_layers == 3
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ModelConfig.from_hf_folder(folder).eos_token_ids == [7, 9]

