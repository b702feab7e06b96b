"""TokenizerRef gives the engine core the size and EOS id transformers' tokenizer has, read
from the folder (tokenizers only) where the files allow, else through transformers."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from benchmarks.make_checkpoint import byte_level_tokenizer
from pagedserve.model.loader import default_model_path, load_tokenizer
from pagedserve.model.tokenizer_ref import TokenizerRef, as_loaded


@pytest.fixture(scope="module", params=["byte-level", "smollm2"])
def folder(request, tmp_path_factory):
    # SmolLM2's: the default GGUF's, converted once into the GGUF cache
    tokenizer = byte_level_tokenizer() if request.param == "byte-level" \
        else load_tokenizer(default_model_path())
    path = tmp_path_factory.mktemp(request.param)
    tokenizer.save_pretrained(path)
    return path


def _facts(tokenizer) -> tuple[int, int | None]:
    return len(tokenizer), tokenizer.eos_token_id


def test_a_saved_folder_gives_transformers_facts(folder):
    ref = TokenizerRef.read(folder)
    assert (len(ref), ref.eos_token_id) == _facts(AutoTokenizer.from_pretrained(folder))
    assert _facts(as_loaded(ref)) == _facts(ref)


def _edit_config(folder, tmp_path, **changes):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((folder / name).read_text())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(changes)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("changes", [
    {"eos_token": "<|not in the vocabulary|>"},  # transformers adds it: a new id, one more
    {"additional_special_tokens": ["<|extra|>"]},
    {"eos_token": None},
], ids=["new eos", "new special", "no eos"])
def test_tokens_transformers_adds_or_drops_agree(folder, tmp_path, changes):
    edited = _edit_config(folder, tmp_path, **changes)
    ref = TokenizerRef.read(edited)
    assert (len(ref), ref.eos_token_id) == _facts(AutoTokenizer.from_pretrained(edited))


def test_a_config_without_eos_agrees(folder, tmp_path):
    edited = _edit_config(folder, tmp_path)
    config = json.loads((edited / "tokenizer_config.json").read_text())
    del config["eos_token"]  # the tokenizer class's default applies
    (edited / "tokenizer_config.json").write_text(json.dumps(config))
    ref = TokenizerRef.read(edited)
    assert (len(ref), ref.eos_token_id) == _facts(AutoTokenizer.from_pretrained(edited))


def test_the_default_gguf_gives_its_loaded_tokenizer_facts():
    ref = TokenizerRef.read(default_model_path())
    assert (len(ref), ref.eos_token_id) == _facts(load_tokenizer(default_model_path()))


def test_a_model_class_fills_what_the_config_leaves_out(folder, tmp_path):
    """GemmaTokenizer's default unk and bos tokens ("<unk>", "<bos>") are in neither
    vocabulary: transformers adds them where tokenizer_config.json names none."""
    edited = _edit_config(folder, tmp_path, tokenizer_class="GemmaTokenizer")
    config = json.loads((edited / "tokenizer_config.json").read_text())
    config.pop("unk_token", None)
    config.pop("bos_token", None)
    (edited / "tokenizer_config.json").write_text(json.dumps(config))
    ref = TokenizerRef.read(edited)
    assert (len(ref), ref.eos_token_id) == _facts(AutoTokenizer.from_pretrained(edited))
