"""Tool calling: the model's tool-call text parsed into OpenAI `tool_calls`, and the prompt
side for templates that know nothing of tools.

Two output formats, picked by `--tool-call-parser` or from the chat template:
- `hermes` (Hermes, Qwen 2.5/3, and our fallback prompt): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, with free text around them;
- `llama3_json` (Llama 3.1+): the message is one JSON object `{"name": ..., "parameters": {...}}`
  (several separated by ";"), optionally after `<|python_tag|>`.

With `tool_choice` "required" or a named function the output is held by a JSON-schema grammar
instead (see `forced_tool_schema`), so it parses by construction whatever the model. The
"required" array holds 1 to MAX_PARALLEL_CALLS calls: a small model, free to go on, repeats
its call until max_tokens. Its complete calls are what both streamed and whole responses
give (`parse_forced_prefix`), so a cut-off array still yields the calls written before the cut.

Streaming (`ToolCallStream`): text is streamed as content until a call may be starting; from
there the text is held back and each call goes out once its text is complete (a delta with
its id and name, then one with its arguments), since a half-written call cannot be told
apart from text until it closes.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json")
MAX_PARALLEL_CALLS = 8  # calls in one forced ("required") answer with parallel_tool_calls


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


def parser_for_template(chat_template: str | None) -> str:
    """The format a model's chat template teaches; hermes (our fallback prompt's) otherwise."""
    template = chat_template or ""
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def template_supports_tools(chat_template: str | None) -> bool:
    return "tools" in (chat_template or "")


def _call(obj: Any, args_key: str) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(args_key, obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ParsedToolCall], int]:
    """(content outside the calls, the complete calls, where unparsed text begins)."""
    calls, content, pos = [], [], 0
    while True:
        start = text.find("<tool_call>", pos)
        if start < 0:
            content.append(text[pos:])
            pos = len(text)
            break
        end = text.find("</tool_call>", start)
        if end < 0:
            content.append(text[pos:start])
            pos = start
            break
        try:
            call = _call(json.loads(text[start + len("<tool_call>"):end]), "arguments")
        except ValueError:
            call = None
        if call is None:  # not a call after all: keep it as text
            content.append(text[pos:end + len("</tool_call>")])
        else:
            content.append(text[pos:start])
            calls.append(call)
        pos = end + len("</tool_call>")
    joined = "".join(content).strip()
    return joined or None, calls, pos


def parse_llama3_json(text: str) -> tuple[str | None, list[ParsedToolCall], int]:
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text.strip() or None, [], len(text)
    calls, decoder, pos = [], json.JSONDecoder(), 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return (None, calls, -1) if calls else (text.strip() or None, [], len(text))
        call = _call(obj, "parameters")
        if call is None:
            return text.strip() or None, [], len(text)
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in "; \n\t":
            pos += 1
    return None, calls, len(text)


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """The content left once the calls are taken out, and the calls (finished output)."""
    if parser == "hermes":
        content, calls, _ = parse_hermes(text)
        return content, calls
    content, calls, _ = parse_llama3_json(text)
    return content, calls


def parse_forced(text: str, named: str | None) -> list[ParsedToolCall]:
    """The output of a grammar-held call: the arguments object of `named`, or (required)
    an array of {"name", "parameters"}."""
    value = json.loads(text)
    if named is not None:
        return [ParsedToolCall(named, json.dumps(value, ensure_ascii=False))]
    return [ParsedToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in value]


def parse_forced_prefix(text: str) -> list[ParsedToolCall]:
    """The complete calls at the start of a "required" output still being written."""
    decoder, calls = json.JSONDecoder(), []
    pos = text.find("[") + 1
    while pos > 0:
        while pos < len(text) and text[pos] in ", \n\t":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        calls.append(ParsedToolCall(item["name"],
                                    json.dumps(item["parameters"], ensure_ascii=False)))
    return calls


def forced_tool_schema(tools: list[dict], named: str | None,
                       parallel: bool = True) -> dict[str, Any]:
    """The JSON schema that holds the output to a call: the named function's parameters, or
    1 to MAX_PARALLEL_CALLS calls of any of the tools (one if parallel calls are off)."""
    def parameters(tool: dict) -> dict:
        return tool["function"].get("parameters") or {"type": "object"}

    if named is not None:
        return parameters(next(t for t in tools if t["function"]["name"] == named))
    calls = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "parameters": parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if parallel else 1}


def fallback_tools_prompt(tools: list[dict]) -> str:
    """For templates that ignore `tools`: the tools and the hermes format, as system text."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You can call functions. The available functions, as JSON:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call one, answer with its name and arguments as JSON inside tags:\n"
            '<tool_call>{"name": "<function name>", "arguments": {<arguments>}}</tool_call>')


def render_tool_calls_text(tool_calls: list[dict]) -> str:
    """An assistant message's past calls in the hermes format, for templates that only
    render `content`."""
    return "\n".join(
        "<tool_call>" + json.dumps({"name": c["function"]["name"],
                                    "arguments": _arguments_dict(c["function"]["arguments"])},
                                   ensure_ascii=False) + "</tool_call>"
        for c in tool_calls)


def _arguments_dict(arguments: str | dict) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def template_tool_calls(tool_calls: list[dict]) -> list[dict]:
    """Past calls as transformers' templates expect them: arguments as an object."""
    return [{"type": "function", "id": c.get("id"),
             "function": {"name": c["function"]["name"],
                          "arguments": _arguments_dict(c["function"]["arguments"])}}
            for c in tool_calls]


class ToolCallStream:
    """Splits streamed text into content deltas and complete tool calls (see the module
    docstring). `feed` and `finish` take the whole text so far."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self._content_sent = 0  # characters of the text streamed as content
        self._calls_sent = 0

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """(content delta, newly completed calls)."""
        if self.parser == "hermes":
            _, calls, _ = parse_hermes(text)
            return self._content_upto(text, _marker_safe_end(text, "<tool_call>")), \
                self._new(calls)
        head = text.lstrip()
        if not head or head[0] == "{" or "<|python_tag|>".startswith(head[:14]):
            _, calls, _ = parse_llama3_json(text)  # a call may be under way: hold the text
            return "", self._new(calls)
        return self._content_upto(text, len(text)), []

    def finish(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """The rest: held-back text that is not part of a call goes out as content."""
        rest = text[self._content_sent:]
        if self.parser == "hermes":
            content, calls, _ = parse_hermes(rest)  # the streamed prefix holds no call
        else:
            content, calls, _ = parse_llama3_json(text)
            content = rest if not calls else None
        self._content_sent = len(text)
        return content or "", self._new(calls)

    def _content_upto(self, text: str, end: int) -> str:
        if end <= self._content_sent:
            return ""
        delta, self._content_sent = text[self._content_sent:end], end
        return delta

    def _new(self, calls: list[ParsedToolCall]) -> list[ParsedToolCall]:
        new = calls[self._calls_sent:]
        self._calls_sent = len(calls)
        return new


def _marker_safe_end(text: str, marker: str) -> int:
    """Where text may be streamed up to: before a marker that has started or may be starting
    (a prefix of it at the very end)."""
    start = text.find(marker)
    if start >= 0:
        return start
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)
