"""Reasoning ("thinking") text split from the answer: `reasoning_content` beside `content`.

Reasoning models write their thoughts in a block, `<think> ... </think>`, before the answer.
Where that block starts is not always in the output: DeepSeek-R1's template and Qwen3's
thinking-only templates end the prompt with `<think>`, so the output begins inside the block;
Qwen3 with `enable_thinking: false` ends the prompt with an empty, closed block, so the output
is all answer; Qwen3's hybrid template with thinking on leaves the block to the model, which
opens it with its first tokens. The parser therefore looks at the tail of the prompt as well
as at the output (`for_prompt`), instead of guessing from the output alone.

A grammar (structured outputs, a forced tool call) holds only after the block, as vLLM's does.
Where the prompt leaves the block to the model, the server first opens it in the prompt
(`open_block`: the tokens such a model writes first anyway), so the output starts inside the
block and the grammar waits for its end, instead of depending on the model choosing to think:
a grammar never left unapplied because the block was never opened.

Two parsers (vLLM's names):
- `qwen3`: the output is reasoning only inside a block, opened by the prompt or by a `<think>`
  at the very start of the output; otherwise it is all content.
- `deepseek_r1`: the output starts inside the block whatever the prompt says (R1 may leave its
  `<think>` out), and a block never closed means the whole output was reasoning.

The split trims the whitespace around the reasoning and before the answer (the model writes
`</think>\\n\\n`), and the streamed form gives exactly the same text, delta by delta: it holds
back what may still be the start of a marker or trailing whitespace, so no delta is taken back.

Use: `get_reasoning_parser(name).for_prompt(tokenizer, prompt_token_ids)` gives a
`PromptReasoning`; its `split(text)` splits a finished output, its `stream()` a streamed one fed
with text deltas.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

REASONING_PARSERS = ("qwen3", "deepseek_r1")
_PROMPT_TAIL_TOKENS = 16  # enough to see the generation prompt's `<think>` / `</think>`


@dataclass(frozen=True)
class Split:
    """Reasoning and content text; None where there is none (as the response fields are)."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True)
class ReasoningParser:
    """One reasoning format: its markers, and whether an output starts inside the block
    whatever the prompt says."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    always_starts_inside: bool = False
    opener: str = "<think>\n"  # how the model opens a block (and a thinking prompt ends)

    def opens_block(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` leaves a block open for the output."""
        if self.always_starts_inside:
            return True
        return prompt_tail.rfind(self.start) > prompt_tail.rfind(self.end)

    def for_prompt(self, tokenizer: Any, prompt_token_ids: list[int]) -> PromptReasoning:
        tail = tokenizer.decode(prompt_token_ids[-_PROMPT_TAIL_TOKENS:])
        return PromptReasoning(self, self.opens_block(tail))

    def open_block(self, tokenizer: Any, prompt_token_ids: list[int]) -> list[int]:
        """The prompt with a block opened at its end, where it leaves the block to the model
        (no marker in its tail: neither opened nor closed); else the prompt as it is."""
        tail = tokenizer.decode(prompt_token_ids[-_PROMPT_TAIL_TOKENS:])
        if self.always_starts_inside or self.start in tail or self.end in tail:
            return prompt_token_ids
        return prompt_token_ids + list(tokenizer.encode(self.opener, add_special_tokens=False))

    def end_token_ids(self, tokenizer: Any) -> list[int]:
        """The tokens that close the block (what a thinking budget forces)."""
        return list(tokenizer.encode(self.end, add_special_tokens=False))

    def start_token_ids(self, tokenizer: Any) -> list[int]:
        return list(tokenizer.encode(self.start, add_special_tokens=False))


@dataclass(frozen=True)
class PromptReasoning:
    """A parser bound to one prompt: whether the output starts inside the block."""

    parser: ReasoningParser
    starts_inside: bool

    def split(self, text: str) -> Split:
        """A finished output's reasoning and content."""
        start, end = self.parser.start, self.parser.end
        inside = self.starts_inside
        body = text
        if text.lstrip().startswith(start):
            inside, body = True, text.lstrip()[len(start):]
        if not inside:
            return Split(None, text or None)
        cut = body.find(end)
        if cut < 0:
            return Split(body.strip() or None, None)
        return Split(body[:cut].strip() or None, body[cut + len(end):].lstrip() or None)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.parser, self.starts_inside)

    def count_tokens(self, text: str, token_ids: list[int], tokenizer: Any) -> int:
        """How many of an output's tokens are its think block: through the end marker, or
        all of them when the block never closes; none when there is no reasoning. The marker
        is found as its tokens; a model that spelled it in other tokens is counted by
        encoding the text up to the marker."""
        if self.split(text).reasoning is None:
            return 0
        end_ids = self.parser.end_token_ids(tokenizer)
        for i in range(len(token_ids) - len(end_ids) + 1):
            if token_ids[i:i + len(end_ids)] == end_ids:
                return i + len(end_ids)
        cut = text.find(self.parser.end)
        if cut < 0:
            return len(token_ids)
        head = text[:cut + len(self.parser.end)]
        return min(len(tokenizer.encode(head, add_special_tokens=False)), len(token_ids))


class ReasoningStream:
    """A streamed output split as it comes: `feed(delta)` and, at the end, `finish()` each
    give the (reasoning, content) text to send now ("" when none). Their concatenation equals
    `PromptReasoning.split` of the whole text."""

    def __init__(self, parser: ReasoningParser, starts_inside: bool) -> None:
        self.parser = parser
        self._state = "head"  # head -> reasoning -> content; head: a `<think>` may start
        self._inside_at_head = starts_inside
        self._held = ""  # text received and not yet sent
        self._reasoning_started = False  # reasoning text sent (leading whitespace dropped)
        self._content_started = False

    def feed(self, delta: str) -> Split:
        self._held += delta
        return self._advance(final=False)

    def finish(self) -> Split:
        return self._advance(final=True)

    def _advance(self, final: bool) -> Split:
        reasoning, content = "", ""
        if self._state == "head":
            self._head(final)
        if self._state == "reasoning":
            reasoning = self._reasoning(final)
        if self._state == "content":
            content = self._content()
        return Split(reasoning, content)

    def _head(self, final: bool) -> None:
        start = self.parser.start
        head = self._held.lstrip()
        if head.startswith(start):
            self._held, self._state = head[len(start):], "reasoning"
        elif start.startswith(head) and not final:
            return  # may still become `<think>`
        elif self._inside_at_head:
            self._state = "reasoning"
        else:
            self._state, self._content_started = "content", True  # no block: kept verbatim

    def _reasoning(self, final: bool) -> str:
        end = self.parser.end
        cut = self._held.find(end)
        if cut >= 0:
            text, self._held = self._held[:cut].rstrip(), self._held[cut + len(end):]
            self._state = "content"
            return self._reasoning_text(text)
        if final:
            text, self._held = self._held.rstrip(), ""
            return self._reasoning_text(text)
        keep = _partial_marker(self._held, end)
        text = self._held[:len(self._held) - keep]
        stripped = text.rstrip()  # trailing whitespace waits: it may be the last before `</think>`
        self._held = self._held[len(stripped):]
        return self._reasoning_text(stripped)

    def _reasoning_text(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        return text

    def _content(self) -> str:
        text, self._held = self._held, ""
        if not self._content_started:
            text = text.lstrip()
            self._content_started = bool(text)
        return text


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


_PARSERS = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", always_starts_inside=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; one of "
                         f"{', '.join(REASONING_PARSERS)}") from None


def parser_for_template(chat_template: str | None) -> str | None:
    """The reasoning parser a chat template calls for, when it says so unambiguously: None
    for a template without think markers, and None with a log line for one that has them but
    belongs to no known family (then `--reasoning-parser` is needed)."""
    template = chat_template or ""
    if "<think>" not in template or "</think>" not in template:
        return None
    if "<｜Assistant｜>" in template:
        return "deepseek_r1"
    if "<|im_start|>" in template:
        return "qwen3"
    logger.warning("the chat template writes <think> blocks but matches no known reasoning "
                   "format; reasoning stays in `content` unless --reasoning-parser is given "
                   "(%s)", ", ".join(REASONING_PARSERS))
    return None
