"""The host tier on CUDA (pinned host memory, asynchronous copies): conversations whose
blocks a small device pool evicted are recalled from the host tier and answer with the same
greedy tokens as an engine that kept them on the device. Runs only where CUDA is available
(CI skips it); the checkpoint is the random Qwen3-0.6B-shaped one of test_gpu_engine."""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.checkpoints import QWEN3_0_6B, random_checkpoint
from tests.gpu.test_gpu_engine import make_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def recalls_pay(monkeypatch):
    """The copies under test, whatever this GPU's recall rule would decide for the model:
    the start-up costs given as a copy far cheaper than any prefill (the rule itself:
    test_the_measured_rule_keeps_the_tokens, tests/engine/test_recall_rule.py)."""
    from pagedserve.device.model_runner import ModelRunner
    from pagedserve.messages import TierCosts

    monkeypatch.setattr(ModelRunner, "measure_tier_costs",
                        lambda runner, _: TierCosts(1e-9, 1e-3, 0.0, 1e-9, 1, 1))


def conversations(engine, count: int = 6) -> list[list[int]]:
    """Turn 1 of every conversation, then turn 2 of each (its history and more): with a
    small pool, the later turn-1 prompts evict the earlier ones."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rng = random.Random(7)
    firsts = [[rng.randrange(10_000) for _ in range(300)] for _ in range(count)]

    def ask(request_id, prompt):
        engine.add_request(request_id, None, params, prompt_token_ids=prompt)
        tokens = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    tokens = list(output.outputs[0].token_ids)
        return tokens

    answers = [ask(f"a{i}", prompt) for i, prompt in enumerate(firsts)]
    return answers + [ask(f"b{i}", prompt + answer + [5, 6, 7])
                      for i, (prompt, answer) in enumerate(zip(firsts, answers))]


def test_recalled_conversations_give_the_same_tokens(loaded, recalls_pay):
    # the same max_model_len in both engines: under CUDA graphs the decode grid is sized for it,
    # and another split of the sums would be bf16 noise, not a recall error
    large = make_engine(loaded, max_model_len=512)
    reference = conversations(large)
    block_bytes = large.model_runner.block_bytes
    del large
    engine = make_engine(loaded, kv_cache_memory=48 * block_bytes, max_model_len=512,
                         kv_offload_memory=512 * block_bytes)
    assert conversations(engine) == reference
    stats = engine.get_stats()
    assert stats.prefix_cache_evictions > 0 and stats.host_tier_hits > 0


def test_conversations_recalled_from_disk_give_the_same_tokens(loaded, tmp_path, recalls_pay):
    """A disk tier under a host tier too small for the conversations: blocks are written
    from pinned host slots once their copies out have landed, read back into slots no copy
    in flight still reads, then recalled; the tokens are those of an engine that kept
    them on the device."""
    large = make_engine(loaded, max_model_len=512)
    reference = conversations(large)
    block_bytes = large.model_runner.block_bytes
    del large
    engine = make_engine(loaded, kv_cache_memory=48 * block_bytes, max_model_len=512,
                         kv_offload_memory=40 * block_bytes, kv_offload_path=str(tmp_path))
    assert conversations(engine) == reference
    stats = engine.get_stats()
    assert stats.disk_tier_stores > 0 and stats.disk_tier_hits > 0
    assert stats.disk_tier_load_failures == 0


@pytest.fixture(scope="module")
def loaded_float32(checkpoint):
    from pagedserve.config import EngineConfig
    from pagedserve.frontend.llm_engine import LoadedModel

    return LoadedModel.load(EngineConfig(model=checkpoint, device="cuda", dtype="float32"))


def test_the_measured_rule_keeps_the_tokens(loaded_float32):
    """The costs this GPU measures at start-up (the copy through the tier's copy stream,
    the prefill's forward passes) are real durations, and whatever the rule makes of them
    the conversations answer as without eviction: each hit is recalled or recomputed, and
    where no hit could pay nothing is offloaded. In float32: a recomputed block is the same
    computation over other chunks, which in bf16 rounds differently enough to flip a greedy
    near-tie of random weights, in float32 not."""
    large = make_engine(loaded_float32, max_model_len=512, dtype="float32")
    reference = conversations(large)
    block_bytes = large.model_runner.block_bytes
    del large
    engine = make_engine(loaded_float32, kv_cache_memory=48 * block_bytes, max_model_len=512,
                         kv_offload_memory=512 * block_bytes, dtype="float32")
    costs = engine.model_runner.measure_tier_costs(512)
    assert costs.block_copy_s > 0 and costs.token_s > 0 and costs.token_context_s >= 0
    assert costs.step_s > 0
    assert costs.copy_blocks > 1 and costs.prefill_tokens == 512
    assert conversations(engine) == reference
    stats = engine.get_stats()
    assert stats.prefix_cache_evictions > 0
    assert stats.host_tier_hits + stats.host_tier_declined > 0 or stats.host_tier_stores == 0


def test_copies_on_the_copy_stream_keep_every_bit(loaded):
    """One step offloads device blocks and recalls other host slots into those very blocks
    (evicted and handed to a recalled request in the same step): the offload gathers them
    before the recall overwrites them, and the recall has landed once the next step's
    compute stream has waited for it. Bitwise, both ways."""
    from pagedserve.messages import SchedulerOutput

    engine = make_engine(loaded, kv_cache_memory=1 << 30, kv_offload_memory=256 << 20)
    runner = engine.model_runner
    host = runner.tiers.host_caches
    k, v = runner.kv_caches[3]
    host_k, host_v = host[3]
    k[5:8].normal_()
    v[5:8].normal_()
    host_k[3:5].normal_()
    host_v[3:5].normal_()
    device_before = (k[5:8].clone(), v[5:8].clone())
    host_before = (host_k[3:5].clone(), host_v[3:5].clone())
    runner.swap(SchedulerOutput(blocks_to_offload=[(5, 0), (6, 1), (7, 2)],
                                blocks_to_recall=[(3, 5), (4, 6)]))
    runner.swap(SchedulerOutput())  # the next step: its stream waits for the recall
    # read on the compute stream (no device-wide sync): its wait for the recall's event
    # also covers the offload queued before it on the copy stream
    assert torch.equal(k[5:7].cpu(), host_before[0]) and torch.equal(v[5:7].cpu(), host_before[1])
    assert torch.equal(k[7], device_before[0][2])
    assert torch.equal(host_k[0:3], device_before[0].cpu())
    assert torch.equal(host_v[0:3], device_before[1].cpu())


def test_copies_in_descending_slot_order_put_each_block_in_place(loaded):
    """A conversation's blocks come back from the pool tail first, so its chain sits in
    descending host slots: copies queued in slot order (long runs) still move each block
    to and from its own place, bitwise."""
    from pagedserve.messages import SchedulerOutput

    engine = make_engine(loaded, kv_cache_memory=1 << 30, kv_offload_memory=256 << 20)
    runner = engine.model_runner
    host_k, host_v = runner.tiers.host_caches[2]
    k, v = runner.kv_caches[2]
    k[10:14].normal_()
    v[10:14].normal_()
    device_before = (k[10:14].clone(), v[10:14].clone())
    offloads = [(10, 7), (11, 6), (12, 5), (13, 4)]  # tail first into ascending slots
    runner.swap(SchedulerOutput(blocks_to_offload=offloads))
    recalls = [(7, 20), (6, 21), (5, 22), (4, 23)]  # the chain again, in chain order
    runner.swap(SchedulerOutput(blocks_to_recall=recalls))
    runner.swap(SchedulerOutput())  # the next step: its stream waits for the recall
    # compared on the compute stream first: its wait for the recall covers the offload
    # queued before it on the copy stream, so the host slots are written by then
    assert torch.equal(k[20:24], device_before[0]) and torch.equal(v[20:24], device_before[1])
    assert torch.equal(host_k[4:8].flip(0), device_before[0].cpu())
    assert torch.equal(host_v[4:8].flip(0), device_before[1].cpu())


def test_each_layer_of_a_recall_has_landed_once_its_event_is_waited_for(loaded):
    """A recall lands layer by layer in the step that queues it: once the compute stream has
    waited for layer n's event (what layer n's attention does first), layer n's blocks
    hold the host slots' bytes, read on the compute stream with no device-wide sync."""
    from pagedserve.messages import SchedulerOutput

    engine = make_engine(loaded, kv_cache_memory=1 << 30, kv_offload_memory=256 << 20)
    runner = engine.model_runner
    for host_k, host_v in runner.tiers.host_caches:
        host_k[30:34].normal_()
        host_v[30:34].normal_()
    recalls = [(33, 40), (32, 41), (31, 42), (30, 43)]
    runner.swap(SchedulerOutput(blocks_to_recall=recalls))
    wait = runner.tiers.layer_waits()
    assert wait is not None
    for layer, ((k, v), (host_k, host_v)) in enumerate(zip(runner.kv_caches,
                                                            runner.tiers.host_caches)):
        wait(layer)
        assert torch.equal(k[40:44].cpu(), host_k[30:34].flip(0))
        assert torch.equal(v[40:44].cpu(), host_v[30:34].flip(0))
    runner.tiers.await_recalls()
    assert runner.tiers.layer_waits() is None


@pytest.fixture(scope="module")
def float32_loaded(tmp_path_factory):
    """A float32 random checkpoint (LM head x25): under load the batches differ between
    the runs compared, and float32 leaves no near-tie for another batch shape to flip."""
    from pagedserve.config import EngineConfig
    from pagedserve.frontend.llm_engine import LoadedModel

    out = random_checkpoint(tmp_path_factory.mktemp("qwen3-random-fp32"), QWEN3_0_6B,
                            "float32")
    return LoadedModel.load(EngineConfig(model=out, device="cuda", dtype="float32"))


def under_load(engine, count: int = 8) -> dict[str, list[int]]:
    """Turn 1 of every conversation, one arriving per step; then turn 2 of each, again
    one per step and each followed by another user's fresh prompt, so recalls are queued
    and land while other requests prefill and decode (and preempt one another)."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rng = random.Random(11)
    firsts = [[rng.randrange(10_000) for _ in range(rng.randint(200, 320))]
              for _ in range(count)]
    others = [[rng.randrange(10_000) for _ in range(200)] for _ in range(count)]

    def drive(arrivals):
        done, arrivals = {}, list(arrivals)
        while arrivals or engine.has_unfinished_requests():
            if arrivals:
                request_id, prompt = arrivals.pop(0)
                engine.add_request(request_id, None, params, prompt_token_ids=prompt)
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = list(output.outputs[0].token_ids)
        return done

    answers = drive((f"a{i}", prompt) for i, prompt in enumerate(firsts))
    seconds = [(f"b{i}", prompt + answers[f"a{i}"] + [5, 6, 7])
               for i, prompt in enumerate(firsts)]
    fresh = [(f"o{i}", prompt) for i, prompt in enumerate(others)]
    return answers | drive(item for pair in zip(seconds, fresh) for item in pair)


@pytest.mark.parametrize("disk", [False, True])
def test_recalls_under_load_give_the_same_tokens(float32_loaded, disk, tmp_path, recalls_pay):
    """Many requests at once on a small pool, with the host tier (and a disk tier below a
    host tier too small for them): the recalled conversations answer as an engine that
    never evicted them."""
    from pagedserve.config import EngineConfig
    from pagedserve.frontend.llm_engine import LLMEngine

    def engine(**options):
        return LLMEngine(EngineConfig(device="cuda", dtype="float32", max_model_len=512,
                                      max_num_seqs=16, **options), float32_loaded)

    large = engine(kv_cache_memory=2 << 30)
    reference = under_load(large)
    block_bytes = large.model_runner.block_bytes
    del large
    tier = (dict(kv_offload_memory=40 * block_bytes, kv_offload_path=str(tmp_path)) if disk
            else dict(kv_offload_memory=512 * block_bytes))
    small = engine(kv_cache_memory=64 * block_bytes, **tier)
    assert under_load(small) == reference
    stats = small.get_stats()
    assert stats.prefix_cache_evictions > 0 and stats.host_tier_hits > 0
    if disk:
        assert stats.disk_tier_hits > 0 and stats.disk_tier_load_failures == 0
