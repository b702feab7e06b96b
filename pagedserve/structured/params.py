"""StructuredOutputsParams: what a request's output must match, as one SamplingParams field.

Exactly one constraint is set. The API server maps OpenAI's `response_format` and our
`structured_outputs` request field onto it; the offline API takes it directly. It is plain
data (strings, a list, a bool) so it travels with SamplingParams to the engine core.

`starts_after` is where the constraint starts: a reasoning model whose output begins inside
its think block must think freely first, so the grammar holds only from the token after the
block's end marker (the first time the output writes it; the tokens before are not fed to
the grammar), as vLLM applies a grammar after the reasoning ends.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (object or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF in xgrammar's (llama.cpp GBNF) dialect, root rule `root`
    # the output is free until it has written these token ids (a think block's end): the
    # constraint holds from the token after them. Not part of the grammar (`key`).
    starts_after: list[int] | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, "
                             f"choice, grammar; got {given or 'none'}")
        if self.choice is not None and (not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of "
                             "non-empty strings")
        if self.starts_after is not None and not (
                self.starts_after and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in self.starts_after)):
            raise ValueError("structured outputs: starts_after must be a non-empty list of "
                             "token ids")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured outputs: json is not valid JSON: {exc}") from None

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, spec): equal constraints get equal keys, so a grammar compiles once. Key
        order is kept: properties are generated in the order the schema declares them."""
        kind = self.kind
        if kind == "json":
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, _json.dumps(schema)
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, _json.dumps(self.choice)
        return kind, getattr(self, kind)
