"""GrammarCache: every constraint compiled once for the served tokenizer.

Compiling turns a schema into a grammar and precomputes, per grammar state, which of the
vocabulary's tokens can follow: milliseconds to tens of milliseconds, far more than a step's
mask. Requests repeating a schema (the common case: one extraction pipeline, one tool set)
share the compiled grammar, which is read-only; each request gets its own matcher over it.

JSON is compiled without free whitespace (`any_whitespace=False`): the output is compact JSON
(", " and ": " separators). Small models given the choice tend to emit whitespace until
max_tokens and never close the object; compact JSON is still JSON.
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import TYPE_CHECKING, Any

from pagedserve.model.tokenizer_ref import as_loaded
from pagedserve.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

_MAX_CACHED = 256  # distinct grammars kept; the oldest compiled is dropped first
# xgrammar's messages start with a time and the C++ source line that raised them
_NATIVE_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\] [^\s:]+\.(?:cc|cpp|h|hpp):\d+: ")


def grammar_vocab_size(tokenizer: Any, vocab_size: int) -> int:
    """The ids a grammar's token table and bitmask rows cover: the model's logits width
    `vocab_size`, or, where the LM head is wider than the tokenizer by more than a 32-bit
    word, the tokenizer's ids and at least one padding id, rounded up to a word. xgrammar
    takes every id past the tokenizer for a special token and scans the list of them at
    each accepted token and each row it fills: SmolLM2's tokenizer under Qwen3's
    151,936-row head has 102,784, which made both several times slower (docs/benchmarks.md,
    "The grammar's host work per step"). The last id of a narrower row
    is padding, never allowed by a grammar, so `apply_token_bitmask` extends it to the ids
    past the row: masked under a grammar, allowed in a free row (all ones)."""
    words = (len(tokenizer) + 1 + 31) // 32
    return min(vocab_size, words * 32)


class GrammarCache:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """`tokenizer`: a transformers tokenizer, or the engine core's TokenizerRef (loaded
        here: a grammar needs the whole vocabulary). `vocab_size`: the model's logits width,
        which may exceed the tokenizer's (padding rows); the extra ids are never allowed. The
        token table covers `grammar_vocab_size` ids (`self.vocab_size`)."""
        tokenizer = as_loaded(tokenizer)
        # imported with the first cache, not with this module: the API process imports this
        # module at start-up, and xgrammar brings transformers' generation code with it
        import xgrammar as xgr

        self.vocab_size = vocab_size = grammar_vocab_size(tokenizer, vocab_size)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False,
                                             max_threads=min(8, os.cpu_count() or 1))
        self._compiled: dict[tuple[str, str], xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()  # compiled from the API process and the core alike

    def get(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar; ValueError naming the problem when the spec is invalid, in
        the compiler's words without its source locations (a client reads them)."""
        key = params.key()
        with self._lock:
            compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(*key)
            with self._lock:
                if len(self._compiled) >= _MAX_CACHED:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[key] = compiled
        return compiled

    def peek(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar | None:
        """The compiled grammar if it is cached, else None (never compiles)."""
        with self._lock:
            return self._compiled.get(params.key())

    def _compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}',
                                                          any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            if kind == "choice":
                literals = (json.dumps(c, ensure_ascii=False) for c in json.loads(spec))
                return self._compiler.compile_grammar("root ::= " + " | ".join(literals))
            return self._compiler.compile_grammar(spec)
        except (RuntimeError, ValueError) as exc:
            reason = _NATIVE_PREFIX.sub("", str(exc)).strip()
            raise ValueError(f"invalid {kind} for structured outputs: {reason}") from exc
