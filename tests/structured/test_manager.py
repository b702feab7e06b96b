"""The structured-output manager's job pipeline, without a model: on worker threads and
inline it fills exactly the rows a fresh matcher that accepted the same tokens would (so a
row is never filled before its matcher took every earlier token), whatever the order of
submit/take, requests added and removed between jobs, and slots reused; a stop token ends
the grammar (the row goes free, the matcher is dropped, nothing fills a terminated matcher);
a refused token drops the matcher with an error; a worker's failure reaches the caller; the
switch interval is lowered only while the workers have work; shutdown stops the threads."""

from __future__ import annotations

import logging
import random
import sys
import threading
import time

import numpy as np
import pytest
import xgrammar as xgr

from benchmarks.make_checkpoint import byte_level_tokenizer
from pagedserve.structured.manager import StructuredOutputManager
from pagedserve.structured.params import StructuredOutputsParams

VOCAB = 259
EOS = 2  # <|im_end|> in the byte-level tokenizer
SPECS = [StructuredOutputsParams(json={"type": "object", "properties": {
             "a": {"type": "string", "pattern": "^[a-z]{1,8}$"},
             "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
             "required": ["a", "b"]}),
         StructuredOutputsParams(regex=r"[a-c]{1,3}(-[0-9]{1,2}){1,4}"),
         StructuredOutputsParams(choice=["alpha", "beta", "gamma"])]


class Params:
    def __init__(self, spec):
        self.structured_outputs = spec


class Request:
    def __init__(self, request_id: str, spec, output: list[int] | None = None):
        self.request_id = request_id
        self.sampling_params = Params(spec)
        self.output_token_ids = list(output or [])


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def make(tokenizer, threads: int, rows: int = 16) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, VOCAB, [EOS], rows, num_threads=threads)


def add_ready(manager: StructuredOutputManager, request) -> None:
    """`add_request`, then wait until its grammar (compiled in the background) is ready."""
    manager.add_request(request)
    if request.sampling_params.structured_outputs is None:
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, failed = manager.take_compiled()
        assert not failed
        if request.request_id in ready:
            return
        time.sleep(0.001)
    raise AssertionError(f"{request.request_id}: its grammar never compiled")


def expected_row(manager, request) -> np.ndarray:
    """The row of a fresh matcher fed the request's tokens; all ones if the request is free
    or its grammar ended."""
    row = xgr.allocate_token_bitmask(1, VOCAB)
    spec = request.sampling_params.structured_outputs
    if spec is None:
        return row.numpy()[0]
    matcher = xgr.GrammarMatcher(manager.grammars.get(spec), override_stop_tokens=[EOS])
    for token in request.output_token_ids:
        if matcher.is_terminated():
            return row.numpy()[0]
        assert matcher.accept_token(token)
    if not matcher.is_terminated():
        matcher.fill_next_token_bitmask(row)
    return row.numpy()[0]


def pick(row: np.ndarray, rng: random.Random, avoid_eos: bool) -> int:
    allowed = [t for t in range(VOCAB) if row[t // 32] >> (t % 32) & 1]
    if avoid_eos and len(allowed) > 1:
        allowed = [t for t in allowed if t != EOS]
    return rng.choice(allowed)


@pytest.mark.parametrize("threads", [0, 1, 3])
@pytest.mark.parametrize("pipelined", [True, False], ids=["async", "sync"])
def test_rows_match_fresh_matchers_through_adds_removes_and_stops(tokenizer, threads,
                                                                   pipelined):
    """A random batch walk in the engine's call order (async: accept + next rows in one
    job; sync: accepts queued, rows filled later), checked row by row every step."""
    rng = random.Random(threads * 2 + pipelined)
    manager = make(tokenizer, threads)
    live: list[Request] = []
    serial = 0
    ended = 0

    def add():
        nonlocal serial
        serial += 1
        request = Request(f"r{serial}", rng.choice(SPECS + [None]))
        add_ready(manager, request)
        live.append(request)

    for _ in range(6):
        add()
    progressed: list[Request] = []
    for step in range(40):
        rows = [r for r in live if rng.random() < 0.85]  # some rows skip a step (prefill)
        ids = [r.request_id for r in rows]
        if pipelined:
            manager.submit(progressed, ids)
            grammar = manager.take_bitmask()
        else:
            manager.submit(progressed)
            grammar = manager.grammar_bitmask(ids)
        constrained = [r for r in rows if manager.is_constrained(r.request_id)]
        assert (grammar is None) == (not constrained)
        progressed = []
        for i, request in enumerate(rows):
            want = expected_row(manager, request)
            if grammar is not None:
                assert grammar.req_ids == ids
                np.testing.assert_array_equal(grammar.bitmask[i], want, err_msg=request.request_id)
            else:
                assert (want == -1).all()
            # EOS only sometimes: a grammar that ended goes on free (ignore_eos) or finishes
            token = pick(want, rng, avoid_eos=rng.random() < 0.5)
            ended += token == EOS and not (want == -1).all()  # a grammar's end
            request.output_token_ids.append(token)
            progressed.append(request)
        if not pipelined:  # the engine queues the accepts right after the step
            manager.submit(progressed)
            progressed = []
        for request in list(live):
            if request.output_token_ids and request.output_token_ids[-1] == EOS \
                    and rng.random() < 0.5:
                live.remove(request)  # finished: its matcher goes (even if a job has it)
                manager.remove_request(request.request_id)
        if rng.random() < 0.3 and live:  # aborted between steps
            victim = rng.choice(live)
            live.remove(victim)
            manager.remove_request(victim.request_id)
        while len(live) < 6:
            add()
    manager.take_bitmask()
    assert ended > 0
    for request in live:
        manager.remove_request(request.request_id)
    assert not manager.has_requests()
    assert max(manager._free_slots, default=0) < 16  # slots are reused, not grown
    manager.shutdown()


def test_stop_token_ends_the_grammar_and_frees_the_row(tokenizer):
    manager = make(tokenizer, 2)
    spec = StructuredOutputsParams(choice=["ab"])
    request = Request("x", spec)
    add_ready(manager, request)
    for token in tokenizer.encode("ab", add_special_tokens=False):
        request.output_token_ids.append(token)
        manager.submit([request], ["x"])
        grammar = manager.take_bitmask()
    allowed = [t for t in range(VOCAB) if grammar.bitmask[0][t // 32] >> (t % 32) & 1]
    assert allowed == [EOS]
    request.output_token_ids.append(EOS)
    manager.submit([request], ["x"])  # the terminated matcher is not filled
    assert manager.take_bitmask() is None
    assert not manager.is_constrained("x")
    request.output_token_ids.append(65)  # free from here on (ignore_eos)
    manager.submit([request], ["x"])
    assert manager.take_bitmask() is None
    manager.shutdown()


def test_a_refused_token_drops_the_matcher_with_an_error(tokenizer, caplog):
    manager = make(tokenizer, 1)
    request = Request("x", StructuredOutputsParams(regex="[a-c]+"))
    add_ready(manager, request)
    request.output_token_ids.append(tokenizer.encode("z", add_special_tokens=False)[0])
    with caplog.at_level(logging.ERROR, logger="pagedserve.structured.manager"):
        manager.submit([request], ["x"])
        manager.take_bitmask()
    assert "does not match its grammar" in caplog.text
    assert not manager.is_constrained("x")
    manager.submit([], ["x"])
    assert manager.take_bitmask() is None
    manager.shutdown()


def test_a_worker_failure_reaches_the_engine_thread(tokenizer):
    manager = make(tokenizer, 2)
    request = Request("x", StructuredOutputsParams(choice=["a"]))
    add_ready(manager, request)
    matcher = manager._entries["x"].matcher
    for token in tokenizer.encode("a", add_special_tokens=False) + [EOS]:  # ended behind the manager's back
        assert matcher.accept_token(token)
    manager.submit([], ["x"])
    with pytest.raises(RuntimeError, match="grammar worker failed"):
        manager.take_bitmask()
    manager.remove_request("x")
    manager.submit([], ["x"])  # the manager still works
    assert manager.take_bitmask() is None
    manager.shutdown()


def test_one_bitmask_at_a_time(tokenizer):
    manager = make(tokenizer, 1)
    add_ready(manager, Request("x", SPECS[1]))
    manager.submit([], ["x"])
    with pytest.raises(RuntimeError, match="take it"):
        manager.submit([], ["x"])
    assert manager.take_bitmask() is not None
    manager.shutdown()


def test_switch_interval_is_lowered_only_while_the_workers_have_work(tokenizer):
    before = sys.getswitchinterval()
    manager = make(tokenizer, 1)
    request = Request("x", SPECS[0])
    add_ready(manager, request)
    others = set(threading.enumerate())
    manager.submit([], ["x"])
    assert sys.getswitchinterval() < min(before, 1e-3)
    manager.take_bitmask()
    assert sys.getswitchinterval() == before
    request.output_token_ids.append(tokenizer.encode("{", add_special_tokens=False)[0])
    manager.submit([request])  # an accept only: nobody takes it, its end still restores
    manager._inboxes[0].put(None)  # the worker stops after it
    for thread in set(threading.enumerate()) - others:
        thread.join(timeout=5)
    assert sys.getswitchinterval() == before
    assert manager.is_constrained("x")


def test_shutdown_stops_the_workers(tokenizer):
    def workers():
        return {t for t in threading.enumerate() if t.name.startswith("grammar-")}

    already = workers()
    manager = make(tokenizer, 3)
    add_ready(manager, Request("x", SPECS[0]))
    manager.submit([], ["x"])
    manager.take_bitmask()
    assert len(workers() - already) == 3
    manager.shutdown()
    for thread in workers() - already:
        thread.join(timeout=5)
    assert not workers() - already


def test_an_lm_head_wider_than_the_tokenizer(tokenizer):
    """The rows cover the tokenizer's ids and a padding word (not the head's 1,000 rows: each
    padding id is one more special token xgrammar scans per token); an EOS id past the
    tokenizer is left out of the stop tokens instead of failing; applied to logits of the
    head's width, a constrained row allows exactly its grammar's ids, a free row all."""
    import torch

    from pagedserve.structured.bitmask import apply_token_bitmask

    manager = StructuredOutputManager(tokenizer, 1000, [EOS, 999], 4, num_threads=1)
    assert manager.grammars.vocab_size == 288  # 259 ids + 1, rounded to 32
    request = Request("x", StructuredOutputsParams(regex="[a-c]+"))
    add_ready(manager, request)
    manager.submit([], ["free", "x"])
    grammar = manager.take_bitmask()
    assert grammar.bitmask.shape == (2, 9)
    logits = apply_token_bitmask(torch.zeros(2, 1000), torch.from_numpy(grammar.bitmask.copy()))
    assert torch.isfinite(logits[0]).all()
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == sorted(tokenizer.convert_tokens_to_ids(list("abc")))
    manager.shutdown()
