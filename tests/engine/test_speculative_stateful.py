"""The scheduler with speculative decoding, against a simulated runner whose KV slots record
the token prefix that produced them: speculative (greedy) and ordinary (with bad words, which
never speculate) requests arrive, are aborted and stepped on a small pool (so lookahead
allocations preempt), and each verify accepts a drawn number of its drafts. After every step:
the pool's invariants hold, no request holds a block past what its computed tokens and next
token need (rejected drafts' lookahead went back), every computed position's KV is that of
the request's own known tokens (a rejected draft never counts as computed), and no block is
hashed past the computed tokens. With a proposer on the device (a draft model, simulated),
each request the runner drafts for holds real blocks for its lookahead during the step, and
gives them back after it; its drafts come back with the step's output and are verified next.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.config import EngineConfig
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.scheduler import Scheduler
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.messages import ModelRunnerOutput, SchedulerOutput, decode, encode
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec.ngram import NgramProposer
from tests.kv_cache.conftest import check_manager_invariants

MAX_LEN = 48


class SpecMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([2, 4]), num_blocks=st.integers(5, 14),
                k=st.integers(1, 4), budget=st.sampled_from([6, 32]),
                on_device=st.booleans())
    def setup(self, block_size: int, num_blocks: int, k: int, budget: int,
              on_device: bool) -> None:
        spec = {"num_speculative_tokens": k} | ({"model": "/a/draft"} if on_device else {})
        config = EngineConfig(block_size=block_size, max_num_seqs=4,
                              max_num_batched_tokens=budget, speculative_config=spec)
        self.manager = KVCacheManager(num_blocks, block_size)
        self.scheduler = Scheduler(config, self.manager, MAX_LEN,
                                   proposer=None if on_device else NgramProposer(1, 3))
        self.block_size = block_size
        self.device: dict[int, tuple] = {}  # slot -> the token prefix its KV came from
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20),
          max_tokens=st.integers(1, 12), speculative=st.booleans())
    def arrive(self, prompt, max_tokens, speculative) -> None:
        max_tokens = max(1, min(max_tokens, MAX_LEN - len(prompt)))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                bad_words_token_ids=None if speculative else [[3]])
        self.scheduler.add_request(Request(f"r{self.next_id}", prompt, params, max_tokens))
        self.next_id += 1

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(data=st.data())
    def step(self, data) -> None:
        out = decode(encode(self.scheduler.schedule()), SchedulerOutput)
        requests = self.scheduler.requests
        chunks = []
        for req_id, computed, num_new in zip(out.req_ids, out.num_computed_tokens,
                                             out.num_scheduled_tokens):
            request = requests[req_id]
            drafts = out.draft_token_ids.get(req_id, [])
            assert not drafts or request.sampling_params.bad_words_token_ids is None
            chunks.append((request, computed, computed + num_new,
                           request.all_token_ids + drafts))
        for request, start, end, tokens in chunks:  # the forward pass writes every chunk
            for pos, slot in zip(range(start, end), self.slots(request, start, end)):
                self.device[slot] = tuple(tokens[:pos + 1])
        for request, _, end, tokens in chunks:  # ... then attends to each context
            for pos, slot in enumerate(self.slots(request, 0, end)):
                assert self.device.get(slot) == tuple(tokens[:pos + 1])
        for req_id, ahead in out.num_lookahead_tokens.items():  # the drafter's positions
            request, start, end, _ = next(c for c in chunks if c[0].request_id == req_id)
            assert end + ahead <= MAX_LEN and 0 not in self.manager.get_block_ids(req_id)
            assert len(self.manager.get_block_ids(req_id)) * self.block_size >= end + ahead
        sampled = [r for r, s in zip(out.req_ids, out.samples) if s]
        tokens, accepted = [], []
        for req_id in sampled:
            drafts = out.draft_token_ids.get(req_id, [])
            num = data.draw(st.integers(0, len(drafts)))
            accepted.append(drafts[:num])
            rejected = drafts[num] if num < len(drafts) else None
            tokens.append(next(t for t in range(5) if t != rejected))
        proposed = {req_id: [data.draw(st.integers(0, 4)) for _ in range(ahead)]
                    for req_id, ahead in out.num_lookahead_tokens.items()}
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            sampled, tokens, accepted_token_ids=accepted if out.draft_token_ids else None,
            draft_token_ids=proposed or None))

    def slots(self, request: Request, start: int, end: int) -> list[int]:
        block_ids = self.manager.get_block_ids(request.request_id)
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    @invariant()
    def pool_and_requests_hold(self) -> None:
        if not hasattr(self, "manager"):
            return
        check_manager_invariants(self.manager)
        bs = self.block_size
        for request in self.scheduler.requests.values():
            computed = request.num_computed_tokens
            held = len(self.manager.req_to_blocks.get(request.request_id, []))
            assert held <= -(-(computed + 1) // bs), "rejected drafts' blocks kept"
            assert self.manager.num_cached_block.get(request.request_id, 0) * bs <= computed
            assert computed < request.num_tokens or request.num_output_placeholders
            tokens = request.all_token_ids
            for pos, slot in enumerate(self.slots(request, 0, computed)):
                assert self.device.get(slot) == tuple(tokens[:pos + 1]), \
                    f"{request.request_id} counts a rejected draft's KV at {pos}"


SpecMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSpecStateMachine = SpecMachine.TestCase
