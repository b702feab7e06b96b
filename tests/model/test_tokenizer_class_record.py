"""The tokenizer of a folder loads, after the first time, through the class AutoTokenizer
chose for it (remembered in the artifact cache), without importing AutoTokenizer's
machinery, and it is the same tokenizer. Fresh interpreters, as two starts of a server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.make_checkpoint import byte_level_tokenizer

SCRIPT = """
import json, sys
from pagedserve.model.loader import load_tokenizer
tokenizer = load_tokenizer(sys.argv[1])
kind = type(tokenizer)
print(json.dumps({"class": kind.__module__ + ":" + kind.__qualname__,
                  "ids": tokenizer.encode(sys.argv[2]), "eos": tokenizer.eos_token_id,
                  "chat": tokenizer.chat_template, "size": len(tokenizer),
                  "auto": "transformers.models.auto.tokenization_auto" in sys.modules}))
"""


def _load(folder, cache) -> dict:
    env = dict(os.environ, PAGEDSERVE_CACHE=str(cache))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(folder), "Hello, wörld <|im_end|>"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_later_load_takes_the_class_autotokenizer_chose(tmp_path):
    folder = tmp_path / "tokenizer"
    byte_level_tokenizer().save_pretrained(folder)
    first, second = _load(folder, tmp_path / "cache"), _load(folder, tmp_path / "cache")
    assert first.pop("auto") and not second.pop("auto")
    assert first == second
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|im_start|>"  # a changed folder is resolved again
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    changed = _load(folder, tmp_path / "cache")
    assert changed["auto"] and changed["eos"] != first["eos"]
