"""The `serve` command's own options (`add_serve_args`; the engine's are engine_args') and
what they set, checked (`serve_settings`: the limits, who may call, the chat template).

Apart from the server's code, and importing nothing heavy: `pagedserve serve` parses its
command line and starts the engine-core process before it imports FastAPI, the frontend and
torch, so that those imports run while the core imports its own and loads the weights.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.entrypoints.chat_template import RESERVED_TEMPLATE_KWARGS
from pagedserve.entrypoints.engine_args import parse_size
from pagedserve.entrypoints.server.reasoning import REASONING_PARSERS
from pagedserve.entrypoints.server.tool_parsers import PARSERS

DEFAULT_MAX_BODY_BYTES = 2 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0  # the default body limit over a slow link; slower ones need more
API_KEY_ENV = "PAGEDSERVE_API_KEY"


@dataclass(frozen=True)
class Limits:
    """The server's bounds on what requests may cost (None: unbounded)."""

    max_queued_requests: int | None = None  # engine requests waiting in the core
    request_timeout: float | None = None  # seconds from submission to the last token
    max_grammar_bytes: int = 256 << 10  # a structured-output spec, as its cache key spells it
    grammar_compile_timeout: float = 5.0  # seconds, waiting for a compile thread included
    grammar_compile_threads: int = 2

    def __post_init__(self) -> None:
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError("request_timeout must be > 0 seconds")
        if self.max_grammar_bytes < 1 or self.grammar_compile_threads < 1:
            raise ValueError("max_grammar_bytes and grammar_compile_threads must be >= 1")
        if not self.grammar_compile_timeout > 0:
            raise ValueError("grammar_compile_timeout must be > 0 seconds")


@dataclass(frozen=True)
class Access:
    """Who may call: `api_keys` (empty: anyone), whether /health and /metrics need a key
    too, and whether each key gets a prefix cache of its own."""

    api_keys: tuple[str, ...] = ()
    auth_health_and_metrics: bool = False
    cache_salt_from_api_key: bool = False

    def __post_init__(self) -> None:
        if any(not key for key in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.cache_salt_from_api_key and not self.api_keys:
            raise ValueError("--cache-salt-from-api-key needs --api-key")


def api_keys(flags: list[str] | None) -> tuple[str, ...]:
    """The keys of every --api-key (each may be a comma list), else of PAGEDSERVE_API_KEY."""
    given = flags if flags else [os.environ.get(API_KEY_ENV, "")]
    keys = [key.strip() for value in given for key in value.split(",")]
    return tuple(dict.fromkeys(key for key in keys if key))


@dataclass(frozen=True)
class ServeSettings:
    """The server's settings from its options, checked before anything starts."""

    limits: Limits
    access: Access
    chat_template: str | None  # the template's text (--chat-template), None: the model's


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """ValueError naming the option at fault."""
    limits = Limits(max_queued_requests=args.max_queued_requests,
                    request_timeout=args.request_timeout,
                    max_grammar_bytes=args.max_grammar_bytes,
                    grammar_compile_timeout=args.grammar_compile_timeout,
                    grammar_compile_threads=args.grammar_compile_threads)
    access = Access(api_keys(args.api_key), args.auth_health_and_metrics,
                    args.cache_salt_from_api_key)
    return ServeSettings(limits, access, _chat_template(args.chat_template))


def _chat_template(template: str | None) -> str | None:
    if template is not None and "{" not in template:  # a file's name, not a template
        try:
            return Path(template).read_text()
        except OSError as exc:
            raise ValueError(f"--chat-template: cannot read {template}: {exc}") from None
    return template


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's own options; the engine's come from `engine_args.add_engine_args`."""
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on "
                       "(default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on "
                       "(default: %(default)s)")
    group.add_argument("--served-model-name", default=None, help="name clients pass as "
                       "`model` (default: the model file's or folder's name)")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       type=_lora_module, help="LoRA adapters (PEFT folders) served as "
                       "`model` NAME on top of the base model (needs --enable-lora)")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    group.add_argument("--seed", type=int, default=0, help="seeds the engine's generator for "
                       "requests without a seed (default: %(default)s)")
    group.add_argument("--graceful-timeout", type=float, default=5.0, help="seconds in-flight "
                       "requests get to finish on SIGINT/SIGTERM (default: %(default)s)")
    group.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                       help="how the model writes tool calls (default: from its chat "
                       "template; hermes for a template without tools, which the server then "
                       "teaches hermes; needed for a template in no known format)")
    group.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                       help="split the model's <think> text into reasoning_content (default: "
                       "from its chat template when it is Qwen3's or DeepSeek-R1's)")
    group.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                       help="a Jinja chat template (a file, or the template itself) used "
                       "instead of the model's")
    group.add_argument("--default-chat-template-kwargs", type=_template_kwargs, default={},
                       metavar="JSON", help="variables every request's chat template gets, "
                       "as a JSON object, e.g. '{\"enable_thinking\": false}'; a request's "
                       "chat_template_kwargs override them")
    group.add_argument("--log-level", default="info", choices=["critical", "error", "warning",
                       "info", "debug"], help="server log verbosity (default: %(default)s)")
    group.add_argument("--max-body-size", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="largest request body in bytes; a larger one gets 413 "
                       "(default: %(default)s)")
    group.add_argument("--max-stored-responses", type=int, default=1024, metavar="N",
                       help="/v1/responses keeps at most this many responses in memory (for "
                       "previous_response_id and retrieval), the oldest evicted first "
                       "(default: %(default)s)")
    group.add_argument("--max-stored-bytes", type=parse_size, default="64M", metavar="SIZE",
                       help="the stored responses hold at most this much JSON in all, the "
                       "oldest evicted first (default: 64M)")
    net = parser.add_argument_group("on a network")
    net.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="requests need 'Authorization: Bearer KEY' (401 otherwise); give it "
                     f"several times or as a comma list for several keys (default: "
                     f"${API_KEY_ENV}, else no key needed)")
    net.add_argument("--auth-health-and-metrics", action="store_true",
                     help="/health and /metrics need the key too (default: open, for probes "
                     "and scrapers)")
    net.add_argument("--cache-salt-from-api-key", action="store_true",
                     help="each API key gets a prefix cache of its own (its requests' "
                     "cache_salt starts with one derived from the key): for several tenants")
    net.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                     help="engine requests (prompts x n) that may wait for a running slot; "
                     "past it 429 with Retry-After (default: unbounded)")
    net.add_argument("--request-timeout", type=_positive(float), default=None,
                     metavar="SECONDS", help="a request still unfinished this long after it "
                     "arrived is aborted (408, or an error event); the request's `timeout` "
                     "field may set less (default: none)")
    net.add_argument("--header-timeout", type=_positive(float), default=10.0,
                     metavar="SECONDS", help="a connection that has not sent a request's "
                     "headers within this is closed (default: %(default)s)")
    net.add_argument("--body-timeout", type=_positive(float), default=DEFAULT_BODY_TIMEOUT_S,
                     metavar="SECONDS", help="a request's body must arrive within this of its "
                     "headers, or it gets 408 and the connection is closed (default: "
                     "%(default)s)")
    net.add_argument("--health-timeout", type=_positive(float), default=5.0, metavar="SECONDS",
                     help="/health answers 503 when the tokenizer threads do not take a no-op "
                     "within this (default: %(default)s)")
    net.add_argument("--max-grammar-bytes", type=parse_size, default=Limits.max_grammar_bytes,
                     metavar="SIZE", help="largest structured-output spec (JSON schema, regex, "
                     "grammar, choices); a larger one gets 400 (default: 256K)")
    net.add_argument("--grammar-compile-timeout", type=_positive(float),
                     default=Limits.grammar_compile_timeout, metavar="SECONDS",
                     help="a grammar not compiled within this gets 400 and is refused at once "
                     "afterwards (default: %(default)s)")
    net.add_argument("--grammar-compile-threads", type=int,
                     default=Limits.grammar_compile_threads, metavar="N",
                     help="threads that compile grammars, apart from the ones that tokenize "
                     "(default: %(default)s)")
    return parser


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"not NAME=PATH: {text!r}")
    return name, path


def _template_kwargs(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value))
    if reserved:
        raise argparse.ArgumentTypeError(f"may not set {', '.join(reserved)}")
    return value
