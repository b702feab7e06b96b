"""The thinking budget: after `max_tokens` tokens inside the block its end tokens are forced,
whether the prompt opened the block or the output did, whatever the model would have drawn,
and the same with a token in flight (async scheduling: the device's last token decides)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.device.input_batch import CachedRequestState
from pagedserve.device.sampler import Sampler, SamplingMetadata
from pagedserve.errors import RequestError
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.thinking_budget import ThinkingBudget
from tests.engine.test_async_scheduling import Arrival, greedy, loaded, make, run  # noqa: F401

VOCAB = 40
CPU = torch.device("cpu")
START, END = 30, 31


def budget(n: int, inside: bool = False, end=(END,)) -> ThinkingBudget:
    return ThinkingBudget(n, [START], list(end), starts_inside=inside)


def request(output, b: ThinkingBudget, in_flight: int = 0) -> CachedRequestState:
    state = CachedRequestState("r", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0,
                                                              thinking_budget=b))
    for token in output:
        state.append_output_token(token)
    state.num_output_placeholders = in_flight + 1
    return state


def drawn(rows: list[CachedRequestState], last: list[int] | None = None) -> list[int]:
    """What each greedy row draws when the model strongly prefers token 5."""
    logits = torch.zeros(len(rows), VOCAB)
    logits[:, 5] = 50.0
    meta = SamplingMetadata.from_requests(
        rows, VOCAB, CPU, last_token_ids=None if last is None else torch.tensor(last))
    return Sampler()(logits, meta).sampled_token_ids.tolist()


def test_the_end_is_forced_once_the_budget_is_spent():
    rows = [
        request([START, 5, 5], budget(3)),  # 2 inside: free
        request([START, 5, 5, 5], budget(3)),  # 3 inside: the end now
        request([5, 5, 5], budget(3, inside=True)),  # the prompt opened it
        request([5, 5, 5, 5], budget(3)),  # never opened: free
        request([START, 5, END, 5], budget(1)),  # closed by the model: free
        request([START], budget(0)),  # a zero budget closes it at once
        request([START, 5, 5], budget(2, end=(32, 33))),  # two end tokens, one per step
        request([START, 5, 5, 32], budget(2, end=(32, 33))),
    ]
    assert drawn(rows) == [5, END, END, 5, 5, END, 32, 33]


def test_the_in_flight_token_decides_on_the_device():
    rows = [
        request([START, 5, 5], budget(3), in_flight=1),  # 3 inside unless it closed it
        request([START, 5, 5], budget(3), in_flight=1),
        request([5], budget(0), in_flight=1),  # opened by it: a zero budget ends it
        request([5], budget(0), in_flight=1),
        request([START, 5], budget(3), in_flight=1),  # 2 inside at most: free
    ]
    assert drawn(rows, last=[5, END, START, 5, 5]) == [END, 5, END, 5, 5]


def test_a_budget_with_structured_outputs_from_the_first_token_is_refused():
    with pytest.raises(RequestError) as err:
        SamplingParams(thinking_budget=budget(2),
                       structured_outputs=StructuredOutputsParams(regex="a+"))
    assert err.value.param == "thinking_budget"
    after = StructuredOutputsParams(regex="a+", starts_after=[END])  # after the block: fine
    assert SamplingParams(thinking_budget=budget(2), structured_outputs=after).thinking_budget
    with pytest.raises(RequestError, match=">= 0"):
        budget(-1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_forces_the_end_with_and_without_async_scheduling(loaded, async_scheduling):
    """The free output's first token opens the block (as `<think>` would): the budget's end
    comes exactly `n` tokens later, and the output goes on after it."""
    prompt = [5, 80, 81, 82, 83, 84, 85, 86, 87, 88]
    free = run(make(loaded, False), [Arrival(0, "free", prompt, greedy(16))])["free"][0]
    start = free.token_ids[0]
    end = next(t for t in range(100, 200) if t not in free.token_ids)
    for n in (0, 3):
        params = dataclasses.replace(greedy(16), thinking_budget=ThinkingBudget(
            n, [start], [end]))
        out = run(make(loaded, async_scheduling), [Arrival(0, "r", prompt, params)])["r"][0]
        assert out.token_ids[:n + 1] == free.token_ids[:n + 1]
        assert out.token_ids[n + 1] == end
        assert len(out.token_ids) == 16
