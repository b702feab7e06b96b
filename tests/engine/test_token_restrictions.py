"""allowed_token_ids and bad_words in the sampler, against per-row references: only allowed
tokens are ever drawn; a bad word's last token is banned exactly where the output ends with
its other tokens, whether the host knows the last of them or it is still in flight (async
scheduling: the device's last token decides)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.device.input_batch import CachedRequestState
from pagedserve.device.sampler import Sampler, SamplingMetadata
from pagedserve.sampling_params import SamplingParams
from tests.engine.test_async_scheduling import Arrival, greedy, loaded, make, run  # noqa: F401

VOCAB = 40
CPU = torch.device("cpu")


def request(output=(), in_flight: int = 0, **params) -> CachedRequestState:
    state = CachedRequestState("r", [1, 2, 3], SamplingParams(max_tokens=100, **params))
    for token in output:
        state.append_output_token(token)
    state.num_output_placeholders = in_flight + 1  # the one drawn now, and those in flight
    return state


@pytest.mark.parametrize("seed", range(3))
def test_only_allowed_tokens_are_drawn(seed):
    gen = torch.Generator().manual_seed(seed)
    allowed = sorted(torch.randperm(VOCAB, generator=gen)[:3].tolist())
    rows = [request(temperature=1.0, seed=seed + i, allowed_token_ids=allowed)
            for i in range(4)] + [request(temperature=0.0)]
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 4
    meta = SamplingMetadata.from_requests(rows, VOCAB, CPU)
    for _ in range(20):
        tokens = Sampler()(logits, meta).sampled_token_ids.tolist()
        assert all(t in allowed for t in tokens[:4])
        assert tokens[4] == int(logits[4].argmax())  # a row without them is untouched


def banned(rows: list[CachedRequestState], last: list[int] | None = None) -> list[set[int]]:
    """The tokens each (greedy) row can no longer sample: raised far above the others, a
    token is still not drawn."""
    meta = SamplingMetadata.from_requests(
        rows, VOCAB, CPU, last_token_ids=None if last is None else torch.tensor(last))
    result = [set() for _ in rows]
    for token in range(VOCAB):
        logits = torch.zeros(len(rows), VOCAB)
        logits[:, token] = 10.0
        drawn = Sampler()(logits, meta).sampled_token_ids.tolist()
        for row, t in enumerate(drawn):
            if t != token:
                result[row].add(token)
    return result


def test_bad_words_ban_the_last_token_after_the_others():
    words = [[7], [4, 5], [4, 5, 6]]
    rows = [
        request((), bad_words=["x"], bad_words_token_ids=words, temperature=0.0),
        request((9, 4), bad_words=["x"], bad_words_token_ids=words, temperature=0.0),
        request((4, 5), bad_words=["x"], bad_words_token_ids=words, temperature=0.0),
        request((5, 4), bad_words=["x"], bad_words_token_ids=words, temperature=0.0),
    ]
    assert banned(rows) == [{7}, {7, 5}, {7, 6}, {7, 5}]


def test_bad_words_with_the_last_token_in_flight():
    """The host knows the output up to the token in flight; the device has it."""
    words = [[7], [4, 5], [4, 5, 6]]
    params = dict(bad_words=["x"], bad_words_token_ids=words, temperature=0.0)
    rows = [
        request((), in_flight=1, **params),  # in flight: 4 -> [4, 5]'s 5
        request((9,), in_flight=1, **params),  # in flight: 3 -> nothing but 7
        request((4,), in_flight=1, **params),  # in flight: 5 -> [4, 5, 6]'s 6
        request((9,), in_flight=1, **params),  # in flight: 5, but 9 is not 4
    ]
    assert banned(rows, last=[4, 3, 5, 5]) == [{7, 5}, {7}, {7, 6}, {7}]
    # the same outputs all known to the host give the same bans
    known = [request(o, **params) for o in ((4,), (9, 3), (4, 5), (9, 5))]
    assert banned(known) == [{7, 5}, {7}, {7, 6}, {7}]


def test_rows_without_restrictions_build_none():
    meta = SamplingMetadata.from_requests([request(temperature=0.0)], VOCAB, CPU)
    assert meta.allowed_tokens is None and meta.bad_words is None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_bans_a_two_token_word_with_and_without_async_scheduling(loaded,
                                                                        async_scheduling):
    """The word's first token is still in flight when the step that must ban its second is
    launched (async): the engines give the same output as the synchronous one, which follows
    the free output up to the word's first token and then leaves the word."""
    prompt = [5, 80, 81, 82, 83, 84, 85, 86, 87, 88]
    free = run(make(loaded, False), [Arrival(0, "free", prompt, greedy(24))])["free"][0]
    i = 3
    word = free.token_ids[i:i + 2]
    params = dataclasses.replace(greedy(24), bad_words_token_ids=[word])
    out = run(make(loaded, async_scheduling), [Arrival(0, "r", prompt, params)])["r"][0]
    assert out.token_ids[:i + 1] == free.token_ids[:i + 1]
    assert out.token_ids[i + 1] != word[1]
    assert all(out.token_ids[k:k + 2] != word for k in range(len(out.token_ids)))
