"""A request's stream in the API process (`async_engine._Stream`): a consumer that falls
behind gets what accumulated as one output whose deltas are the joined deltas, so nothing is
lost or repeated, and an error ends the stream whatever is pending."""

import asyncio

from pagedserve.entrypoints.server.async_engine import _Stream
from pagedserve.frontend.outputs import CompletionOutput, RequestOutput


def step(all_ids: list[list[int]], new: int, finished: bool = False) -> RequestOutput:
    """The output after `new` more tokens per sample: text is the ids as letters."""
    outputs = []
    for index, ids in enumerate(all_ids):
        delta = [len(ids) + k for k in range(new)]
        ids.extend(delta)
        text = "".join(chr(97 + t % 26) for t in ids)
        outputs.append(CompletionOutput(
            index=index, text=text, token_ids=list(ids), cumulative_logprob=None,
            logprobs=None, finish_reason="length" if finished else None,
            text_delta=text[len(text) - new:], token_ids_delta=delta))
    return RequestOutput("r", None, [1, 2], outputs, finished)


def test_a_consumer_behind_gets_one_output_with_the_joined_deltas():
    async def main():
        stream = _Stream(0.0)
        ids = [[], []]  # n = 2: merged per sample index
        for new in (1, 2, 3):
            stream.put(step(ids, new))
        merged = await stream.get()
        assert not merged.finished
        for c, sample_ids in zip(merged.outputs, ids):
            assert c.token_ids_delta == sample_ids == c.token_ids == list(range(6))
            assert c.text_delta == c.text == "abcdef"
        stream.put(step(ids, 1, finished=True))
        last = await stream.get()
        assert last.finished and [c.token_ids_delta for c in last.outputs] == [[6], [6]]
        assert [c.text_delta for c in last.outputs] == ["g", "g"]

    asyncio.run(main())


def test_a_waiting_consumer_gets_each_output_as_it_comes():
    async def main():
        stream = _Stream(0.0)
        ids = [[]]
        got = []

        async def consume():
            while not got or not got[-1].finished:
                got.append(await stream.get())

        task = asyncio.create_task(consume())
        for k in range(3):
            await asyncio.sleep(0)  # the consumer is waiting again
            stream.put(step(ids, 1, finished=k == 2))
        await asyncio.wait_for(task, 5)
        assert [c.outputs[0].token_ids_delta for c in got] == [[0], [1], [2]]

    asyncio.run(main())


def test_an_error_replaces_pending_output_and_ends_the_stream():
    async def main():
        stream = _Stream(0.0)
        ids = [[]]
        stream.put(step(ids, 1))
        error = RuntimeError("engine died")
        stream.put(error)
        stream.put(step(ids, 1))  # a late output after the failure is dropped
        assert await stream.get() is error

    asyncio.run(main())
