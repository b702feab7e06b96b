"""Tiny random float32 checkpoints (benchmarks/configs, two layers, an odd vocabulary) shared
by the engine-level tensor-parallel tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.make_checkpoint import make_checkpoint

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def tiny_checkpoint(root: Path, case: str) -> str:
    config = json.loads((CONFIGS / f"{case}.json").read_text())
    config.update(vocab_size=2001, num_hidden_layers=2, initializer_range=0.1)
    (root / f"{case}.json").write_text(json.dumps(config))
    make_checkpoint(root / f"{case}.json", root / case, torch.float32, seed=0,
                    tokenizer="bytes")
    return str(root / case)


@pytest.fixture(scope="package")
def llama(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory.mktemp("tp-ckpt"), "tiny-llama3")


@pytest.fixture(scope="package")
def llama_kv3(tmp_path_factory) -> str:
    """6 query heads over 3 KV heads: rank 0's query heads read KV heads 0, 0, 1 (kept as
    three local KV heads, 0 twice, so that each serves one query head), rank 1's 1, 2, 2."""
    return tiny_checkpoint(tmp_path_factory.mktemp("tp-ckpt"), "tiny-llama-kv3")


@pytest.fixture(scope="package")
def qwen3_moe(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory.mktemp("tp-ckpt"), "tiny-qwen3-moe")
