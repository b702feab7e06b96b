"""EngineCoreClient and the engine-core process: the same tokens as the in-process engine,
outputs batched once per step, requests aborted across the process boundary, start-up errors
reported with the core's message, nothing left running after shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve.config import EngineConfig
from pagedserve.frontend.core_client import EngineCoreClient
from pagedserve.messages import EngineCoreOutputs, EngineCoreRequest
from pagedserve.sampling_params import SamplingParams

PROMPTS = [[1, 504, 3459, 28, 1], [1, 421, 5248, 314], [1, 17, 4493, 30, 690, 28]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def client():
    client = EngineCoreClient(EngineConfig(device="cpu", dtype="float32",
                                           kv_cache_memory=128 << 20))
    client.wait_ready()
    yield client
    client.shutdown()
    assert not client.process.is_alive()


async def _collect(client: EngineCoreClient, expected_ids: set[str]
                   ) -> tuple[dict[str, list[int]], list[EngineCoreOutputs]]:
    """Token ids per request until each of `expected_ids` has finished, and every message."""
    tokens: dict[str, list[int]] = {}
    messages = []
    finished: set[str] = set()
    while finished != expected_ids:
        message = await asyncio.wait_for(client.get_outputs(), 120)
        messages.append(message)
        for out in message.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished.add(out.request_id)
    return tokens, messages


def _request(request_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS
             ) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt,
                             SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                            ignore_eos=True), time.time())


def test_greedy_tokens_equal_in_process_engine_and_come_once_per_step(client, engine):
    assert client.ready.max_model_len == engine.max_model_len
    assert client.ready.vocab_size == engine.model_config.vocab_size
    assert client.ready.num_gpu_blocks == engine.num_blocks
    for i, prompt in enumerate(PROMPTS):
        client.add_request(_request(f"r{i}", prompt))
    tokens, messages = asyncio.run(_collect(client, {f"r{i}" for i in range(len(PROMPTS))}))

    reference = engine.engine_core
    for i, prompt in enumerate(PROMPTS):
        reference.add_request(_request(f"ref{i}", prompt))
    expected: dict[str, list[int]] = {}
    while reference.has_unfinished_requests():
        for out in reference.step().outputs:
            expected.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens == {f"r{i}": expected[f"ref{i}"] for i in range(len(PROMPTS))}
    # one message per step for the whole batch (steps waiting together come merged), never
    # one per request
    with_outputs = [m for m in messages if m.outputs]
    assert len(with_outputs) < len(PROMPTS) * MAX_TOKENS
    assert any({o.request_id for o in m.outputs} == set(tokens) for m in with_outputs)


def test_abort_frees_the_request_in_the_core(client):
    client.add_request(_request("long", PROMPTS[0], max_tokens=1000))

    async def run() -> EngineCoreOutputs:
        first = await asyncio.wait_for(client.get_outputs(), 120)
        assert [o.request_id for o in first.outputs] == ["long"]
        client.abort_requests(["long"])
        # the core goes idle: its last message is the stats after the abort
        while True:
            message = await asyncio.wait_for(client.get_outputs(), 120)
            stats = message.scheduler_stats
            if stats.num_running == 0 and stats.num_waiting == 0:
                return message

    last = asyncio.run(run())
    assert last.scheduler_stats.kv_cache_usage == 0.0
    assert all(o.finish_reason is None for o in last.outputs)


def test_start_up_failure_reports_the_core_error(tmp_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(RuntimeError, match=f"model path {missing} does not exist"):
        EngineCoreClient(EngineConfig(model=str(missing), device="cpu")).wait_ready()


def test_start_up_failure_wins_over_the_work_beside_it(tmp_path):
    """The API process's own start-up work (its tokenizer) runs while the core starts; when
    both fail, the core's error names the cause (here the missing model), and the core is
    stopped."""
    missing = tmp_path / "missing.gguf"
    client = EngineCoreClient(EngineConfig(model=str(missing), device="cpu"))
    with pytest.raises(RuntimeError, match=f"model path {missing} does not exist"):
        client.wait_ready(lambda: 1 / 0)
    assert not client.process.is_alive()
