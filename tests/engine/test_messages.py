"""Every engine message survives a msgpack round trip unchanged (what crosses a process or a
worker boundary must mean the same on the other side), and the batch limits' auto rule."""

from __future__ import annotations

import msgspec
import pytest

from pagedserve.config import EngineConfig, resolve_batch_limits
from pagedserve.messages import (
    CachedRequestData, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, LogprobsLists,
    ModelRunnerOutput, NewRequestData, SchedulerOutput, SchedulerStats, TokenLogprobs, decode,
    encode)
from pagedserve.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=-3, stop=["\n\n", "END"],
                        stop_token_ids=[7], logprobs=2, repetition_penalty=1.1, max_tokens=None)


def scheduler_output() -> SchedulerOutput:
    cached = CachedRequestData()
    cached.append("b", False, [9], 2)
    cached.append("c", True, [4, 5, 6])
    return SchedulerOutput(
        req_ids=["b", "c", "a"], num_scheduled_tokens=[1, 1, 30],
        num_computed_tokens=[40, 33, 16], samples=[True, True, False], num_decodes=2,
        total_num_scheduled_tokens=32,
        scheduled_new_reqs=[NewRequestData("a", list(range(100)), PARAMS, [1, 2, 3], 16)],
        scheduled_cached_reqs=cached, finished_req_ids=["z"], preempted_req_ids=["y"],
        blocks_to_swap_out=[(5, 0), (6, 1)], blocks_to_swap_in=[(2, 11)])


MESSAGES = [
    EngineCoreRequest("r#1", [1, 2, 3], PARAMS, 1.7e9, cache_salt="tenant"),
    EngineCoreRequest("r", [4], SamplingParams(), 0.5),
    EngineCoreOutputs(
        [EngineCoreOutput("a", [17], [TokenLogprobs([17, 3], [-0.1, -2.5], -0.1, 1)]),
         EngineCoreOutput("b", [2], None, "stop", 2, num_cached_tokens=32),
         EngineCoreOutput("c", [5], finish_reason="length")],
        SchedulerStats(3, 1, 0.25, 640, 512, 2, 1000), timestamp=1.7e9),
    scheduler_output(),
    SchedulerOutput(),
    ModelRunnerOutput(["b", "c"], [17, 5], LogprobsLists(
        [[17, 3], [5, 9]], [[-0.1, -2.5], [-0.3, -1.0]], [-0.1, -0.3], [1, 1])),
    ModelRunnerOutput([], []),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    data = encode(message)
    received = decode(data, type(message))
    assert received == message
    assert encode(received) == data
    for name in message.__struct_fields__:  # same types too, not only equal values
        assert type(getattr(received, name)) is type(getattr(message, name))


def test_sampling_params_keep_their_derived_fields():
    received = decode(encode(MESSAGES[0]), EngineCoreRequest).sampling_params
    assert received.stop_strings == ["\n\n", "END"] and received.top_k == 40
    assert received.max_tokens is None and received.needs_penalties


def test_a_message_of_the_wrong_shape_is_rejected():
    with pytest.raises(msgspec.ValidationError):
        decode(encode(MESSAGES[1]), SchedulerOutput)


GIB = 1 << 30


@pytest.mark.parametrize("device, total, weights, expected", [
    ("cpu", None, 1 * GIB, (64, 2048)),
    ("cuda", 80 * GIB, int(1.2 * GIB), (256, 16384)),  # an H100 and a 0.6B model
    ("cuda", 40 * GIB, 2 * GIB, (256, 8192)),
    ("cuda", 80 * GIB, 60 * GIB, (128, 4096)),  # a large model leaves little room
    ("cuda", 24 * GIB, 30 * GIB, (128, 4096)),  # weights past the budget: the smallest tier
])
def test_batch_limits_follow_the_device_and_model(device, total, weights, expected):
    assert resolve_batch_limits(EngineConfig(), device, total, weights) == expected


def test_batch_limits_given_are_kept():
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=None)
    assert resolve_batch_limits(config, "cuda", 80 * GIB, GIB) == (8, 16384)
    config = EngineConfig(max_num_seqs=None, max_num_batched_tokens=512)
    assert resolve_batch_limits(config, "cpu", None, GIB) == (64, 512)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="admission_interval"):
        EngineConfig(admission_interval=0)
