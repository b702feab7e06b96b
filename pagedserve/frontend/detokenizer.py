"""Incremental detokenization and stop strings.

Decoding each new token on its own breaks multi-byte characters and the tokenizer's
spacing rules, and re-decoding the whole output every step costs O(n^2). Instead each
request keeps a small window: `prefix_offset..read_offset` are tokens already turned into
text, decoded again only as context; the new text is what decoding the window up to the
newest token adds. A trailing U+FFFD means an unfinished UTF-8 sequence, so we wait.

With special tokens kept (`skip_special_tokens=False`) and `spaces_between_special_tokens`
(vLLM's and transformers' default), each added token is set off from the text around it by a
space, as transformers' slow tokenizers decode; fast tokenizers ignore that option, so the
window is decoded in runs split at the added tokens and joined with spaces.

Stop strings are searched only in the region the new text could complete, and the last
(longest stop - 1) characters are held back from streaming until the request finishes, so
a streamed delta is never contradicted by a later truncation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output token

Decode = Callable[[list[int], bool], str]  # (token ids, skip_special_tokens) -> text


def decode_function(tokenizer) -> Decode:
    """`tokenizer.decode`, or where transformers only forwards the call to its Rust tokenizer
    (a fast tokenizer without space clean-up), that tokenizer's decode called directly. The
    wrapper's argument conversion costs more than the decode itself, and a streamed request
    decodes twice per token: in the server, on the event loop, for every stream."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    prompt_token_ids: list[int]
    stop_strings: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.token_ids: list[int] = self.prompt_token_ids[-_CONTEXT_TOKENS:]
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        self.num_streamed_chars = 0
        self._holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        self._decode = decode_function(self.tokenizer)
        if not self.skip_special_tokens and self.spaces_between_special_tokens:
            self._decode = _spaced_decode(self._decode, _added_token_ids(self.tokenizer))

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string that matched (text is truncated there) or None."""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            previous_len = len(self.output_text)
            self.output_text += self._decode_new()
            stop = self._find_stop(previous_len)
            if stop is not None:
                return stop
        return None

    def update_at_once(self, new_token_ids: list[int]) -> None:
        """The text `update` would build token by token, from two decode calls instead of two
        per token; for requests without stop strings whose caller only reads the final text
        (offline generation: at large batch, decoding every token was a large part of every
        step; docs/benchmarks.md, "Host-side costs behind the engine's choices").
        A trailing unfinished UTF-8 sequence is left out, as `update` holds it back."""
        decode, skip = self._decode, self.skip_special_tokens
        context = self.token_ids[self.prefix_offset:self.read_offset]
        prefix_text = decode(context, skip)
        full_text = decode(context + new_token_ids, skip)
        self.token_ids, self.prefix_offset, self.read_offset = [], 0, 0  # all of it is text
        self.output_text += full_text[len(prefix_text):].rstrip("\ufffd")

    def _decode_new(self) -> str:
        decode, skip = self._decode, self.skip_special_tokens
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset], skip)
        full_text = decode(self.token_ids[self.prefix_offset:], skip)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        # the window moves on: the tokens before it are text and never decoded again, so
        # they are dropped (the window holds a few tokens, not the whole output)
        del self.token_ids[:self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self.token_ids)
        return full_text[len(prefix_text):]

    def _find_stop(self, previous_len: int) -> str | None:
        """Earliest stop string that the text added since `previous_len` completes."""
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            index = self.output_text.find(stop, max(0, previous_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet streamed; while running, keep back what might begin a stop string."""
        end = len(self.output_text) if finished else max(
            self.num_streamed_chars, len(self.output_text) - self._holdback)
        delta = self.output_text[self.num_streamed_chars:end]
        self.num_streamed_chars = end
        return delta


def _added_token_ids(tokenizer) -> frozenset[int]:
    return frozenset(tokenizer.get_added_vocab().values())


def _spaced_decode(decode: Decode, added: frozenset[int]) -> Decode:
    """`decode` with each added token decoded on its own, set off by spaces."""
    def spaced(ids: list[int], skip: bool) -> str:
        pieces, run = [], []
        for token_id in ids:
            if token_id in added:
                if run:
                    pieces.append(decode(run, skip))
                    run = []
                pieces.append(decode([token_id], skip))
            else:
                run.append(token_id)
        if run:
            pieces.append(decode(run, skip))
        return " ".join(pieces)

    return spaced
