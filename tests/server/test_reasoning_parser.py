"""The reasoning parsers on recorded and synthetic outputs: the split of a finished output, the
streamed split fed in arbitrary pieces (it must add up to the same text), and the choice of a
parser from a chat template."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.make_checkpoint import byte_level_tokenizer
from pagedserve.entrypoints.server.reasoning import (PromptReasoning, Split, get_reasoning_parser,
                                                     parser_for_template)

QWEN3 = get_reasoning_parser("qwen3")
R1 = get_reasoning_parser("deepseek_r1")

# Qwen3-0.6B's answer to "What is 2+2?", thinking on (recorded)
QWEN3_OUTPUT = ("<think>\nOkay, the user is asking what 2+2 is. That's basic addition.\n"
                "</think>\n\n2 + 2 equals **4**.")


def _stream(bound: PromptReasoning, pieces: list[str]) -> Split:
    stream = bound.stream()
    parts = [stream.feed(p) for p in pieces] + [stream.finish()]
    reasoning = "".join(p.reasoning for p in parts)
    content = "".join(p.content for p in parts)
    return Split(reasoning or None, content or None)


@pytest.mark.parametrize("bound, text, expected", [
    (PromptReasoning(QWEN3, False), QWEN3_OUTPUT,
     Split("Okay, the user is asking what 2+2 is. That's basic addition.",
           "2 + 2 equals **4**.")),
    # thinking off: the prompt closed the block, the output is all content, verbatim
    (PromptReasoning(QWEN3, False), "\n2 + 2 = 4 <think>", Split(None, "\n2 + 2 = 4 <think>")),
    # the prompt opened the block (Qwen3 thinking templates, R1)
    (PromptReasoning(QWEN3, True), "adding.\n</think>\n\n4", Split("adding.", "4")),
    # cut off while thinking
    (PromptReasoning(QWEN3, False), "<think>\nstill going", Split("still going", None)),
    (PromptReasoning(R1, True), "no end marker at all", Split("no end marker at all", None)),
    # a tool call after the reasoning stays in the content for the tool parser
    (PromptReasoning(QWEN3, False),
     '<think>I should call it.</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n'
     '</tool_call>',
     Split("I should call it.", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')),
    (PromptReasoning(QWEN3, False), "", Split(None, None)),
    (PromptReasoning(QWEN3, False), "<think></think>", Split(None, None)),
])
def test_split_and_stream(bound: PromptReasoning, text: str, expected: Split) -> None:
    assert bound.split(text) == expected
    assert _stream(bound, list(text)) == expected  # one character at a time
    assert _stream(bound, [text]) == expected


def test_stream_sends_reasoning_before_the_block_closes() -> None:
    stream = PromptReasoning(QWEN3, False).stream()
    assert stream.feed("<thi") == Split("", "")  # may be the marker: held
    assert stream.feed("nk>\nLet me ") == Split("Let me", "")
    assert stream.feed("think.</th") == Split(" think.", "")
    assert stream.feed("ink>\n\nHi") == Split("", "Hi")
    assert stream.finish() == Split("", "")


def test_the_prompt_decides_where_the_output_starts() -> None:
    assert QWEN3.opens_block("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opens_block("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not QWEN3.opens_block("<|im_start|>assistant\n")
    assert R1.opens_block("<｜Assistant｜>")


def test_the_server_opens_a_block_left_to_the_model() -> None:
    """Only a prompt whose tail shows no block (thinking on, Qwen3's hybrid template) gets the
    opening; one that opened or closed a block, and R1's, are left as they are."""
    tokenizer = byte_level_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])

    def opened(parser, prompt: str) -> str:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        return tokenizer.decode(parser.open_block(tokenizer, ids))

    header = "<|im_start|>assistant\n"
    assert opened(QWEN3, header) == header + "<think>\n"
    for prompt in (header + "<think>\n", header + "<think>\n\n</think>\n\n"):
        assert opened(QWEN3, prompt) == prompt
    assert opened(R1, "<｜Assistant｜>") == "<｜Assistant｜>"


_PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "\n", " ", "a",
                           "b c", "<th", "nk>", "\n\n"])


@settings(max_examples=300, deadline=None)
@given(text=st.lists(_PIECES, max_size=12).map("".join), cuts=st.lists(st.integers(0, 60)),
       inside=st.booleans(), parser=st.sampled_from([QWEN3, R1]))
def test_streamed_split_equals_the_whole_split(text: str, cuts: list[int], inside: bool,
                                               parser) -> None:
    bound = PromptReasoning(parser, inside or parser is R1)
    points = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(points, points[1:])]
    assert _stream(bound, pieces) == bound.split(text)


QWEN3_TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                  "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
                  "{%- if enable_thinking is defined and enable_thinking is false %}"
                  "<think>\n\n</think>\n\n{%- endif %}{%- endif %}")
R1_TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
               "{% else %}<｜Assistant｜>{{ m.content.split('</think>')[-1] }}<｜end▁of▁sentence｜>"
               "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n"
               "{% endif %}")


def test_parser_from_template(caplog: pytest.LogCaptureFixture) -> None:
    assert parser_for_template(QWEN3_TEMPLATE) == "qwen3"
    assert parser_for_template(R1_TEMPLATE) == "deepseek_r1"
    assert parser_for_template("{{ messages[0].content }}") is None
    assert parser_for_template(None) is None
    with caplog.at_level(logging.WARNING):
        assert parser_for_template("[INST]{{ m }}<think></think>[/INST]") is None
    assert "--reasoning-parser" in caplog.text


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")
