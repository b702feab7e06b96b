"""Grammars compile in the background of the engine core, never in its step: a constrained
request waits (WAITING_FOR_GRAMMAR) while the others are scheduled, then runs under its
grammar; a compile that fails finishes its request with an error and takes no block.

Requests go straight to `EngineCore` (no frontend): `LLMEngine`'s Processor compiles every
spec itself before the core sees it, which would hide the core's behaviour. The order of
outputs is asserted, never a duration: a free request gets all its tokens before a request
whose compile is held open (or slow: a 30,000-value enum) gets its first."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.core import EngineCore
from pagedserve.engine.request import RequestStatus
from pagedserve.messages import EngineCoreRequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.grammar import GrammarCache
from pagedserve.structured.manager import StructuredOutputManager
from pagedserve.structured.params import StructuredOutputsParams
from tests.conftest import assert_pool_clean
from tests.structured.test_engine import BLOCK, BLOCK_BYTES, PERSON, loaded, prompt  # noqa: F401

FREE_TOKENS = 16
# a compile of seconds on the dev box (2.5 s alone; 0.3 s at 10,000 values, too close to the
# free request's 16 steps under load), against a few ms a step
ENUM = {"type": "object", "properties": {"v": {"enum": [f"v{i:05d}" for i in range(30000)]}},
        "required": ["v"]}


def make_core(loaded, **options) -> EngineCore:  # noqa: F811
    return EngineCore(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                   block_size=BLOCK, kv_cache_memory=256 * BLOCK_BYTES,
                                   max_num_batched_tokens=64, **options), loaded)


def add(core: EngineCore, request_id: str, params: SamplingParams, i: int) -> None:
    core.add_request(EngineCoreRequest(request_id, prompt(i), params, time.time()))


def free_params() -> SamplingParams:
    return SamplingParams(max_tokens=FREE_TOKENS, temperature=0.0, ignore_eos=True)


def json_params(schema: dict) -> SamplingParams:
    return SamplingParams(max_tokens=100, temperature=0.0,
                          structured_outputs=StructuredOutputsParams(json=schema))


def run(core: EngineCore, on_step=None, errors: dict | None = None
        ) -> tuple[list[tuple[str, int]], dict, dict]:
    """Step to the end: the (request id, token count) of every output in order, each
    request's tokens and its finish reason. `on_step(core)` runs after each step; `errors`
    gets the error of each request that finished with one."""
    events, tokens, reasons = [], {}, {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            events.append((out.request_id, len(out.new_token_ids)))
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
            if out.error is not None and errors is not None:
                errors[out.request_id] = out.error
        if on_step is not None:
            on_step(core)
    return events, tokens, reasons


def text(core: EngineCore, token_ids: list[int]) -> str:
    if token_ids and token_ids[-1] in core.eos_token_ids:
        token_ids = token_ids[:-1]
    return core.tokenizer.decode(token_ids)


def assert_free_first_then_valid(core: EngineCore, events, tokens, reasons,
                                  constrained: str, schema: dict) -> None:
    """The free request produced all its tokens before the constrained one's first token,
    which then finished with JSON valid under `schema`; every block is free again."""
    assert len(tokens["free"]) == FREE_TOKENS
    last_free = max(i for i, (rid, _) in enumerate(events) if rid == "free")
    assert first_token_index(events, constrained) > last_free
    assert reasons[constrained] == "stop"
    jsonschema.validate(json.loads(text(core, tokens[constrained])), schema)
    assert_pool_clean(core)


def first_token_index(events: list[tuple[str, int]], request_id: str) -> int:
    return next(i for i, (rid, n) in enumerate(events) if rid == request_id and n)


class GatedGrammars(GrammarCache):
    """A grammar cache whose compile of one spec waits until the test opens the gate, and
    records the thread it ran on: a compile of any length, on demand."""

    def __init__(self, tokenizer, vocab_size: int, gated: StructuredOutputsParams) -> None:
        super().__init__(tokenizer, vocab_size)
        self.gated, self.gate = gated.key(), threading.Event()
        self.threads: list[threading.Thread] = []

    def get(self, params: StructuredOutputsParams):
        if params.key() == self.gated and self.peek(params) is None:
            self.threads.append(threading.current_thread())
            assert self.gate.wait(60), "the gate was never opened"
        return super().get(params)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_held_compile_delays_only_its_own_request(loaded, async_scheduling):  # noqa: F811
    core = make_core(loaded, async_scheduling=async_scheduling)
    params = json_params(PERSON)
    grammars = GatedGrammars(core.tokenizer, core.model_config.vocab_size,
                             params.structured_outputs)
    core.structured = StructuredOutputManager(
        core.tokenizer, core.model_config.vocab_size, core.eos_token_ids,
        core.config.max_num_seqs, device_type="cpu", grammars=grammars)
    add(core, "json", params, 0)  # first in the queue: the free one is admitted past it
    add(core, "free", free_params(), 1)

    def open_when_free_is_done(core: EngineCore) -> None:
        if "free" not in core.scheduler.requests:
            grammars.gate.set()
        elif "json" in core.scheduler.requests:
            assert core.scheduler.requests["json"].status == RequestStatus.WAITING_FOR_GRAMMAR

    events, tokens, reasons = run(core, open_when_free_is_done)
    assert grammars.threads and threading.main_thread() not in grammars.threads
    assert reasons["free"] == "length"
    assert_free_first_then_valid(core, events, tokens, reasons, "json", PERSON)
    core.shutdown()


@pytest.mark.parametrize("where", ["thread", "process"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_slow_compile_does_not_delay_a_free_request(loaded, where,  # noqa: F811
                                                      async_scheduling):
    """A real slow compile (a 30,000-value enum), in the core's process or the grammar
    process: the free request, added after it, finishes before its first token."""
    core = make_core(loaded, async_scheduling=async_scheduling,
                     grammar_process=where == "process")
    add(core, "enum", json_params(ENUM), 0)
    add(core, "free", free_params(), 1)
    events, tokens, reasons = run(core)
    assert_free_first_then_valid(core, events, tokens, reasons, "enum", ENUM)
    core.shutdown()


@pytest.mark.parametrize("where", ["thread", "process"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failed_compile_finishes_its_request_with_an_error(loaded, where,  # noqa: F811
                                                             async_scheduling, caplog):
    """A spec the core cannot compile (no frontend checked it): its request finishes with
    no token, the compiler's message (without its source paths) in its output and the log;
    the others run on; every block is free."""
    core = make_core(loaded, async_scheduling=async_scheduling,
                     grammar_process=where == "process")
    bad = {"type": "object", "properties": {"a": {"type": 7}}}
    add(core, "bad", json_params(bad), 0)
    add(core, "good", json_params(PERSON), 1)
    add(core, "free", free_params(), 2)
    errors: dict[str, str] = {}
    events, tokens, reasons = run(core, errors=errors)
    assert reasons == {"bad": "abort", "good": "stop", "free": "length"}
    assert list(errors) == ["bad"]  # the compiler's words, for the frontend to answer with
    assert errors["bad"].startswith("invalid json for structured outputs:")
    assert not re.search(r"\.(cc|h|cpp):\d|\[\d\d:\d\d:\d\d\]", errors["bad"]), errors
    assert tokens["bad"] == [] and ("bad", 0) in events
    jsonschema.validate(json.loads(text(core, tokens["good"])), PERSON)
    assert "request bad: its grammar failed to compile" in caplog.text
    assert_pool_clean(core)
    core.shutdown()


def test_an_abort_while_compiling_drops_the_request(loaded):  # noqa: F811
    """Aborted while its grammar compiles: no output, nothing left waiting, and the compile's
    end (later) is ignored."""
    core = make_core(loaded)
    params = json_params(PERSON)
    grammars = GatedGrammars(core.tokenizer, core.model_config.vocab_size,
                             params.structured_outputs)
    core.structured = StructuredOutputManager(
        core.tokenizer, core.model_config.vocab_size, core.eos_token_ids,
        core.config.max_num_seqs, device_type="cpu", grammars=grammars)
    add(core, "json", params, 0)
    assert core.step().outputs == []
    core.abort_requests(["json"])
    assert not core.has_unfinished_requests() and not core.structured.has_compiles()
    grammars.gate.set()
    deadline = time.monotonic() + 60
    while grammars.peek(params.structured_outputs) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the compile thread reports right after caching
    assert core.structured.take_compiled() == ([], [])
    assert not core.structured.has_requests()
    add(core, "again", params, 1)  # cached now: ready at the next step
    _, tokens, reasons = run(core)
    assert reasons == {"again": "stop"}
    jsonschema.validate(json.loads(text(core, tokens["again"])), PERSON)
    assert_pool_clean(core)
    core.shutdown()
