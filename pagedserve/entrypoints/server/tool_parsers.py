"""Tool calling: the model's tool-call text parsed into OpenAI `tool_calls`, and the prompt
side for templates that know nothing of tools.

Five output formats (vLLM's parser names), picked by `--tool-call-parser` or from the chat
template (`parser_for_template`, which never guesses: a template that renders tools in no
known format, or in several, gets a log line and needs the flag):
- `hermes` (Hermes, Qwen 2.5/3, and our fallback prompt): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, with free text around them;
- `llama3_json` (Llama 3.1+): the message is one JSON object `{"name": ..., "parameters": {...}}`
  (several separated by ";"), optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v0.3 tokenizers) or
  `name[ARGS]{...}` per call (newer ones, optionally `name[CALL_ID]id[ARGS]{...}`); the markers
  are special tokens, so such requests keep special tokens in the text (`needs_special_tokens`);
- `qwen3_coder`: XML in `<tool_call>`: `<function=name>` holding `<parameter=key>value
  </parameter>`, values as raw text, typed by the tool's parameter schema;
- `pythonic` (Llama 3.2 / 4): the message is a Python list of calls, `[f(a=1), g(b="x")]`,
  optionally inside `<|python_start|>` ... `<|python_end|>`.

With `tool_choice` "required" or a named function the output is held by a JSON-schema grammar
instead (see `forced_tool_schema`), so it parses by construction whatever the model. The
"required" array holds 1 to MAX_PARALLEL_CALLS calls: a small model, free to go on, repeats
its call until max_tokens. Its complete calls are what both streamed and whole responses
give (`parse_forced_prefix`), so a cut-off array still yields the calls written before the cut.

Streaming (`ToolCallStream`): text is streamed as content until a call may be starting; from
there the text is held back and each call goes out once its text is complete (a delta with
its id and name, then one with its arguments), since a half-written call cannot be told
apart from text until it closes. A call never completed goes out as content at the end.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic")
MAX_PARALLEL_CALLS = 8  # calls in one forced ("required") answer with parallel_tool_calls


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


# ---- which format -----------------------------------------------------------------------------

# what a chat template that teaches each format contains (all of a row's strings)
_TEMPLATE_SIGNS = {
    "mistral": ("[TOOL_CALLS]",),
    "qwen3_coder": ("<tool_call>", "<function=", "<parameter="),
    "hermes": ("<tool_call>",),
    "llama3_json": ("<|python_tag|>",),
    "pythonic": ("[func_name1(",),
}


def parser_for_template(chat_template: str | None) -> str | None:
    """The format a model's chat template teaches: hermes for a template that does not render
    tools (the server teaches hermes then, see `fallback_tools_prompt`); None, with a log line,
    when it renders tools in no known format or in several (then --tool-call-parser is
    needed)."""
    template = chat_template or ""
    if not template_supports_tools(template):
        return "hermes"
    found = [name for name, signs in _TEMPLATE_SIGNS.items()
             if all(sign in template for sign in signs)]
    if "qwen3_coder" in found:
        found.remove("hermes")  # its calls are in <tool_call> too, with XML inside
    if not found and "ipython" in template and '"parameters"' in template:
        found.append("llama3_json")  # Llama 3.2's JSON template, without a python tag
    if len(found) == 1:
        return found[0]
    logger.warning("the chat template renders tools in %s; tool calls under tool_choice "
                   "'auto' need --tool-call-parser (%s)",
                   f"several known formats ({', '.join(found)})" if found
                   else "no known format", ", ".join(PARSERS))
    return None


def template_supports_tools(chat_template: str | None) -> bool:
    return "tools" in (chat_template or "")


def needs_special_tokens(parser: str | None) -> bool:
    """Whether the format's markers are special tokens, which a decode that skips them drops."""
    return parser == "mistral"


# ---- the formats ------------------------------------------------------------------------------

def _call(obj: Any, args_key: str) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass
class _Parsed:
    """A text read for calls: the text outside them, the complete calls, and where a call
    that has started but not finished begins (len(text) when none)."""

    content: str
    calls: list[ParsedToolCall]
    pending: int


def _tagged(text: str, open_tag: str, close_tag: str, read) -> _Parsed:
    """Calls between tags, free text around them; `read(body)` a call or None (not a call
    after all: kept as text)."""
    calls, content, pos = [], [], 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            content.append(text[pos:])
            return _Parsed("".join(content), calls, len(text))
        end = text.find(close_tag, start)
        if end < 0:
            content.append(text[pos:start])
            return _Parsed("".join(content), calls, start)
        call = read(text[start + len(open_tag):end])
        if call is None:
            content.append(text[pos:end + len(close_tag)])
        else:
            content.append(text[pos:start])
            calls.append(call)
        pos = end + len(close_tag)


def _hermes_call(body: str) -> ParsedToolCall | None:
    try:
        return _call(json.loads(body), "arguments")
    except ValueError:
        return None


def _parse_hermes(text: str, tools: list[dict] | None) -> _Parsed:
    return _tagged(text, "<tool_call>", "</tool_call>", _hermes_call)


_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


def _parse_qwen3_coder(text: str, tools: list[dict] | None) -> _Parsed:
    def read(body: str) -> ParsedToolCall | None:
        match = _FUNCTION.fullmatch(body)
        if match is None:
            return None
        name = match.group(1)
        schema = _parameter_schemas(tools, name)
        arguments = {key: _typed(_trim_newline(value), schema.get(key))
                     for key, value in _PARAMETER.findall(match.group(2))}
        return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))

    return _tagged(text, "<tool_call>", "</tool_call>", read)


def _parameter_schemas(tools: list[dict] | None, name: str) -> dict[str, Any]:
    for tool in tools or ():
        if tool["function"]["name"] == name:
            return (tool["function"].get("parameters") or {}).get("properties") or {}
    return {}


def _trim_newline(value: str) -> str:
    """The value between its tags, less the one newline on each side the format puts there."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: Any) -> Any:
    """A raw XML value as its schema's type: text stays text (and so does what is not valid
    for the type); numbers, booleans, null, objects and arrays are read as JSON."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _parse_llama3_json(text: str, tools: list[dict] | None) -> _Parsed:
    pos = _skip_blanks(text, 0)
    if text.startswith("<|python_tag|>", pos):
        pos = _skip_blanks(text, pos + len("<|python_tag|>"))
    if not text.startswith("{", pos):
        return _Parsed(text, [], len(text))
    calls, decoder = [], json.JSONDecoder()
    while pos < len(text):
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:  # unfinished (or not JSON): pending from here
            return _Parsed("", calls, pos)
        call = _call(obj, "parameters")
        if call is None:
            return (_Parsed("", calls, pos) if calls else _Parsed(text, [], len(text)))
        calls.append(call)
        pos = _skip_blanks(text, end, "; \n\t")
    return _Parsed("", calls, len(text))


def _skip_blanks(text: str, pos: int, blanks: str = " \n\t\r") -> int:
    while pos < len(text) and text[pos] in blanks:
        pos += 1
    return pos


# spaces allowed around the markers: a decode that keeps special tokens may put them there
_MISTRAL_NAMED = re.compile(
    r"\s*([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?\[ARGS\]\s*")


def _parse_mistral(text: str, tools: list[dict] | None) -> _Parsed:
    marker = "[TOOL_CALLS]"
    start = text.find(marker)
    if start < 0:
        return _Parsed(text, [], len(text))
    calls, pos, decoder = [], start, json.JSONDecoder()
    while True:
        call_start = pos
        if text.startswith(marker, pos):
            pos += len(marker)
        rest = text[pos:].lstrip()
        pos = len(text) - len(rest)
        if not rest:
            return _Parsed(text[:start], calls, call_start if call_start < len(text) else pos)
        named = _MISTRAL_NAMED.match(text, pos)
        try:
            if rest.startswith("["):  # v0.3: a JSON list of calls
                items, pos = decoder.raw_decode(text, pos)
                found = [_call(item, "arguments") for item in items] \
                    if isinstance(items, list) else [None]
            elif named is not None:
                arguments, pos = decoder.raw_decode(text, named.end())
                found = [_call({"name": named.group(1), "arguments": arguments}, "arguments")]
                if found[0] is not None and named.group(2):
                    found[0].id = named.group(2)
            else:
                found = [None]
        except ValueError:  # not finished yet (or never will be: text at the end)
            return _Parsed(text[:start], calls, call_start)
        if None in found:
            return _Parsed(text[:start] + text[call_start:], calls, len(text))
        calls += found
        after = len(text) - len(text[pos:].lstrip())
        if after >= len(text) or not (text.startswith(marker, after)
                                      or _MISTRAL_NAMED.match(text, after)):
            return _Parsed(text[:start] + text[pos:], calls, len(text))
        pos = after


def _parse_pythonic(text: str, tools: list[dict] | None) -> _Parsed:
    body = text.strip().removeprefix("<|python_start|>")
    body = body.removesuffix("<|python_end|>").strip()
    if not body.startswith("["):
        return _Parsed(text, [], len(text))
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return _Parsed("", [], 0)  # unfinished (or not Python): the whole message is pending
    calls = _python_calls(tree)
    if calls is None:
        return _Parsed(text, [], len(text))
    return _Parsed("", calls, len(text))


def _python_calls(tree: ast.expr) -> list[ParsedToolCall] | None:
    """`[f(a=1), g()]` as calls; None for anything else (positional arguments, names that
    are not plain, values that are not literals)."""
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args \
                or any(k.arg is None for k in node.keywords):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            text = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        calls.append(ParsedToolCall(node.func.id, text))
    return calls


_FORMATS = {
    "hermes": _parse_hermes,
    "llama3_json": _parse_llama3_json,
    "mistral": _parse_mistral,
    "qwen3_coder": _parse_qwen3_coder,
    "pythonic": _parse_pythonic,
}
# where a call may start: a marker anywhere, or (whole-message formats) the message's start
_MARKERS = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "mistral": "[TOOL_CALLS]"}
_MESSAGE_STARTS = {"llama3_json": ("{", "<|python_tag|>"), "pythonic": ("[", "<|python_start|>")}


def parse_tool_calls(parser: str, text: str, tools: list[dict] | None = None
                     ) -> tuple[str | None, list[ParsedToolCall]]:
    """The content left once the calls are taken out, and the calls (finished output). A
    call never finished stays in the content."""
    parsed = _FORMATS[parser](text, tools)
    content = parsed.content + text[parsed.pending:]
    if parsed.calls:
        content = content.strip()
    return content or None, parsed.calls


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

    def __init__(self, parser: str, tools: list[dict] | None = None) -> None:
        self.parser = parser
        self.tools = tools
        self._content_sent = 0  # characters of the text streamed as content
        self._calls_sent = 0

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """(content delta, newly completed calls)."""
        content = self._content_upto(text, self._content_end(text))
        parsed = _FORMATS[self.parser](text[self._content_sent:], self.tools)
        return content, self._new(parsed.calls)

    def finish(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """The rest: held-back text that is not part of a call goes out as content."""
        rest = text[self._content_sent:]
        parsed = _FORMATS[self.parser](rest, self.tools)
        self._content_sent = len(text)
        content = parsed.content + rest[parsed.pending:]
        if parsed.calls:
            content = content.strip()
        return content, self._new(parsed.calls)

    def _content_end(self, text: str) -> int:
        """How far the text is surely content: up to where a call starts or may start."""
        marker = _MARKERS.get(self.parser)
        if marker is not None:
            return _marker_safe_end(text, marker)
        head = text.lstrip()
        if not head or any(head.startswith(s) or s.startswith(head)
                           for s in _MESSAGE_STARTS[self.parser]):
            return self._content_sent  # the message may be a call: hold it all
        return len(text)

    def _content_upto(self, text: str, end: int) -> str:
        if end <= self._content_sent:
            return ""
        delta, self._content_sent = text[self._content_sent:end], end
        return delta

    def _new(self, calls: list[ParsedToolCall]) -> list[ParsedToolCall]:
        """The calls past those already sent (a longer text may read as fewer complete
        calls for a while: a whole-message format's closing marker half-written)."""
        new = calls[self._calls_sent:]
        self._calls_sent += len(new)
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
