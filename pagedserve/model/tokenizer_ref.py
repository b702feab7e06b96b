"""TokenizerRef: a tokenizer named by where it loads from, with what the engine core needs of it.

Why: the engine core does not tokenize (the API process does); of its tokenizer it needs only
the number of ids (`len`, which sizes the grammar bitmask) and the end-of-sequence id (a stop
token). Loading a transformers tokenizer imports transformers, which took seconds of the
core's start-up, so these two facts are read from the folder's tokenizer.json with the
`tokenizers` library (Rust, a fast import) and tokenizer_config.json, where that gives
exactly what transformers would: an explicit `eos_token` (and bos, unk and pad for a model's
own tokenizer class, which has defaults for them), and every special or added token it names
already in tokenizer.json under the same id (otherwise transformers adds tokens, and this
falls back to loading the tokenizer through it). A GGUF's tokenizer is its converted
folder in the GGUF cache (`model/gguf.py`); before the first conversion it is loaded whole.
The full tokenizer is loaded only where a grammar needs it (`as_loaded`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
_TOKEN_LISTS = ("additional_special_tokens", "extra_special_tokens")
# the classes with no special tokens of their own: a model's class (GemmaTokenizer, ...) fills
# those tokenizer_config.json leaves out with its defaults, which may be new tokens
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
_DEFAULTED_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class TokenizerRef:
    source: str  # a folder or a .gguf file (`loader.tokenizer_source`)
    size: int  # len(tokenizer): its ids, added tokens included
    eos_token_id: int | None

    def __len__(self) -> int:
        return self.size

    def load(self) -> Any:
        """The transformers tokenizer itself."""
        from pagedserve.model.loader import load_tokenizer

        return load_tokenizer(self.source)

    @classmethod
    def read(cls, source: str | Path) -> TokenizerRef:
        """The facts without transformers where the files allow it (see the module
        docstring), else from the tokenizer loaded through it."""
        path = Path(source)
        folder: Path | None = path
        if path.suffix == ".gguf":
            from pagedserve.model.gguf import cache_entry

            folder = cache_entry(path, "tokenizer")
        facts = _folder_facts(folder) if folder is not None and folder.is_dir() else None
        if facts is None:
            from pagedserve.model.loader import load_tokenizer

            tokenizer = load_tokenizer(source)
            facts = len(tokenizer), tokenizer.eos_token_id
        return cls(str(source), *facts)


def as_loaded(tokenizer: Any) -> Any:
    """A transformers tokenizer: `tokenizer` itself, or the one a TokenizerRef names."""
    return tokenizer.load() if isinstance(tokenizer, TokenizerRef) else tokenizer


def _folder_facts(folder: Path) -> tuple[int, int | None] | None:
    """(len, eos id) as transformers would give them, or None where only it can tell."""
    tokenizer_file, config_file = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if not (tokenizer_file.is_file() and config_file.is_file()) or \
            (folder / "special_tokens_map.json").exists():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    generic = config.get("tokenizer_class") in _GENERIC_CLASSES
    required = ("eos_token",) if generic else _DEFAULTED_TOKENS
    if not all(key in config for key in required):
        return None  # the tokenizer class's default applies
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception:  # noqa: BLE001 - any file it cannot parse is transformers' to judge
        return None
    added = {int(i): _content(t) for i, t in (config.get("added_tokens_decoder") or {}).items()}
    if any(tokenizer.token_to_id(text) != i for i, text in added.items()):
        return None
    named = [_content(config.get(key)) for key in _NAMED_TOKENS]
    named += [_content(t) for key in _TOKEN_LISTS for t in _as_list(config.get(key))]
    if any(text is not None and tokenizer.token_to_id(text) is None for text in named):
        return None  # transformers would add it: another id and another length
    eos = _content(config["eos_token"])
    return (tokenizer.get_vocab_size(with_added_tokens=True),
            None if eos is None else tokenizer.token_to_id(eos))


def _content(token: Any) -> str | None:
    """A token as tokenizer_config.json spells it: a string or an AddedToken's dict."""
    return token.get("content") if isinstance(token, dict) else token


def _as_list(tokens: Any) -> list:
    if isinstance(tokens, dict):  # extra_special_tokens may name them
        return list(tokens.values())
    return list(tokens or [])
