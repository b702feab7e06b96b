"""Tiny random float32 checkpoints (benchmarks/configs, two layers, an odd vocabulary) shared
by the engine-level tensor-parallel tests."""

from __future__ import annotations

import pytest

from tests.distributed.harness import tiny_checkpoint


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
