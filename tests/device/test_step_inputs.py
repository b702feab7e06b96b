"""The runner's step inputs, through `ModelRunner.prepare_step` (the host work of every step):
positions, the slot mapping, the block tables, sequence lengths, query starts, input ids and
the rows that reach the LM head, against the KV layout contract computed independently per
token (`slot = block_id * block_size + offset`; block tables padded with the null block 0).

The property test runs random multi-step schedules through one runner per block size:
chunked prefills, prefix hits, blocks appended step by step, leading blocks nulled out of a
sliding window, preemption and resumption into new blocks, and finished requests whose
block-table rows (and step buffers, written by earlier, wider steps) are reused.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.make_checkpoint import make_checkpoint
from pagedserve.config import EngineConfig
from pagedserve.device.executor import initialize_runner
from pagedserve.device.loading import LoadedModel
from pagedserve.device.model_runner import ModelRunner, StepInputs
from pagedserve.messages import (
    CachedRequestData, KVCacheSpec, NewRequestData, SchedulerOutput)
from pagedserve.sampling_params import SamplingParams

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16,
    "hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 512,
    "num_attention_heads": 2, "num_hidden_layers": 1, "num_key_value_heads": 1,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "vocab_size": 259, "bos_token_id": 1, "eos_token_id": 2,
}
MAX_MODEL_LEN = 192
MAX_SEQS = 6
MAX_TOKENS = 96  # per step
NUM_BLOCKS = 12000  # enough for any example's requests, never reused within one
_ids = itertools.count()


@functools.cache
def tiny_model(root: str) -> LoadedModel:
    folder = Path(root)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    make_checkpoint(folder / "config.json", folder / "ckpt", torch.float32, seed=0,
                    tokenizer="bytes")
    return LoadedModel.load(EngineConfig(model=str(folder / "ckpt"), device="cpu",
                                         dtype="float32"))


@functools.cache
def make_runner(root: str, block_size: int) -> ModelRunner:
    loaded = tiny_model(root)
    config = EngineConfig(model="tiny", device="cpu", dtype="float32", block_size=block_size,
                          max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS,
                          kv_cache_memory=1 << 20)
    runner = ModelRunner(config, loaded.model, loaded.model_config, torch.device("cpu"))
    initialize_runner(runner, KVCacheSpec(NUM_BLOCKS, 0, MAX_MODEL_LEN))
    return runner


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tiny-step-inputs"))


@dataclass
class Seq:
    """The test's own record of a request: its prompt, how far it is computed, its blocks
    (None where a leading block was nulled out of the window)."""

    req_id: str
    prompt: list[int]
    computed: int = 0
    blocks: list[int | None] = field(default_factory=list)


@dataclass
class Chunk:
    seq: Seq
    start: int
    num_new: int

    @property
    def end(self) -> int:
        return self.start + self.num_new


def expected_and_check(runner: ModelRunner, inputs: StepInputs, chunks: list[Chunk]) -> None:
    """Every input of the step against the layout contract, token by token."""
    bs = runner.block_size
    positions = [p for c in chunks for p in range(c.start, c.end)]
    slots = [c.seq.blocks[p // bs] * bs + p % bs for c in chunks for p in range(c.start, c.end)]
    tokens = [c.seq.prompt[p] for c in chunks for p in range(c.start, c.end)]
    # every block the step attends to, the null block for the rest of the row
    tables = np.zeros((len(chunks), runner.buffers.block_tables.np.shape[1]), dtype=np.int32)
    for i, c in enumerate(chunks):
        assert len(c.seq.blocks) == -(-c.end // bs)  # as the scheduler allocates
        tables[i, :len(c.seq.blocks)] = [b or 0 for b in c.seq.blocks]
    query_start = np.cumsum([0] + [c.num_new for c in chunks])
    samples = [c.end == len(c.seq.prompt) for c in chunks]
    meta = inputs.meta
    np.testing.assert_array_equal(inputs.positions.numpy(), positions)
    np.testing.assert_array_equal(meta.slot_mapping.numpy(), slots)
    np.testing.assert_array_equal(inputs.input_ids.numpy(), tokens)
    np.testing.assert_array_equal(meta.block_tables.numpy(), tables)
    np.testing.assert_array_equal(meta.seq_lens.numpy(), [c.end for c in chunks])
    np.testing.assert_array_equal(meta.query_start_loc.numpy(), query_start)
    np.testing.assert_array_equal(inputs.logits_indices.numpy(),
                                  [query_start[i + 1] - 1 for i, s in enumerate(samples) if s])
    assert meta.num_decodes == sum(c.num_new == 1 for c in chunks)
    assert meta.max_query_len == max(c.num_new for c in chunks)
    assert meta.max_seq_len == max(c.end for c in chunks)
    assert [s.req_id for s in inputs.sampling_states] == [
        c.seq.req_id for c, s in zip(chunks, samples) if s]
    assert inputs.placeholder_ids == [] and inputs.graph_size is None


def step(runner: ModelRunner, chunks: list[Chunk], new: list[Seq], cached: CachedRequestData,
         finished: list[str], preempted: list[str]) -> None:
    chunks = sorted(chunks, key=lambda c: c.num_new != 1)  # decodes first, as scheduled
    output = SchedulerOutput(
        req_ids=[c.seq.req_id for c in chunks],
        num_scheduled_tokens=[c.num_new for c in chunks],
        num_computed_tokens=[c.start for c in chunks],
        samples=[c.end == len(c.seq.prompt) for c in chunks],
        num_decodes=sum(c.num_new == 1 for c in chunks),
        total_num_scheduled_tokens=sum(c.num_new for c in chunks),
        scheduled_new_reqs=[NewRequestData(s.req_id, s.prompt, SamplingParams(), list(s.blocks),
                                           s.computed) for s in new],
        scheduled_cached_reqs=cached, finished_req_ids=finished, preempted_req_ids=preempted)
    prepared = runner.prepare_step(output)
    assert prepared.output is output
    if chunks:
        expected_and_check(runner, prepared.inputs, chunks)
    else:
        assert prepared.inputs is None


class Blocks:
    """Distinct block ids, never the null block."""

    def __init__(self, data: st.DataObject) -> None:
        seed = data.draw(st.integers(0, 2**32 - 1), label="block ids seed")
        self.free = random.Random(seed).sample(range(1, NUM_BLOCKS), NUM_BLOCKS - 1)

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(block_size=st.sampled_from([1, 4, 16]), data=st.data())
def test_step_inputs_follow_the_layout_contract(root, block_size, data):
    runner = make_runner(root, block_size)
    # an example that failed left its requests behind: forget them first
    runner.prepare_step(SchedulerOutput(finished_req_ids=list(runner.requests)))
    blocks = Blocks(data)
    bs = block_size
    running: list[Seq] = []
    preempted: list[Seq] = []
    finished_ids: list[str] = []
    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        budget = MAX_TOKENS
        chunks, new, cached, preempted_ids = [], [], CachedRequestData(), []
        # preempt one running request (its blocks are gone; it resumes later from scratch)
        if running and data.draw(st.booleans(), label="preempt"):
            victim = running.pop(data.draw(st.integers(0, len(running) - 1)))
            victim.computed, victim.blocks = 0, []
            preempted.append(victim)
            preempted_ids.append(victim.req_id)
        for seq in list(running):
            num_new = min(budget, len(seq.prompt) - seq.computed,
                          data.draw(st.integers(1, 40), label="chunk"))
            if num_new <= 0:
                continue
            end = seq.computed + num_new
            grown = blocks.take(-(-end // bs) - len(seq.blocks))
            seq.blocks += grown
            # a window may have nulled leading blocks wholly before this chunk
            nulled = data.draw(st.integers(0, seq.computed // bs), label="nulled")
            for i in range(nulled):
                seq.blocks[i] = None
            if grown or nulled:
                cached.append(seq.req_id, False, grown, nulled)
            chunks.append(Chunk(seq, seq.computed, num_new))
            budget -= num_new
        if (preempted and budget > 0 and not preempted_ids
                and data.draw(st.booleans(), label="resume")):
            seq = preempted.pop(0)
            num_new = min(budget, len(seq.prompt))
            seq.blocks = blocks.take(-(-num_new // bs))
            cached.append(seq.req_id, True, list(seq.blocks))
            chunks.append(Chunk(seq, 0, num_new))
            running.append(seq)
            budget -= num_new
        while (budget > 0 and len(running) + len(preempted) < MAX_SEQS
               and data.draw(st.booleans(), label="admit")):
            length = data.draw(st.integers(1, MAX_MODEL_LEN - 1), label="prompt length")
            prompt = data.draw(st.lists(st.integers(3, 258), min_size=length,
                                        max_size=length), label="prompt")
            hit = bs * data.draw(st.integers(0, (length - 1) // bs), label="prefix hit")
            num_new = min(budget, length - hit)
            seq = Seq(f"r{next(_ids)}", prompt, hit, blocks.take(-(-(hit + num_new) // bs)))
            new.append(seq)
            chunks.append(Chunk(seq, hit, num_new))
            running.append(seq)
            budget -= num_new
        step(runner, chunks, new, cached, finished_ids, preempted_ids)
        for c in chunks:
            c.seq.computed = c.end
        # requests whose prompt is done sampled their first token: they finish here
        done = [s for s in running if s.computed == len(s.prompt)]
        running = [s for s in running if s.computed < len(s.prompt)]
        finished_ids = [s.req_id for s in done]
    # the runner forgets every request of the example (their rows go back to the free list)
    step(runner, [], [], CachedRequestData(), finished_ids + [s.req_id for s in running]
         + [s.req_id for s in preempted], [])
    assert runner.requests == {}


def test_slot_mapping_and_block_table_of_two_requests(root):
    """Request a (6 tokens) in two chunks of 3, its blocks [5] then [9]; b (9 tokens, blocks
    [2, 7, 3]) whole in the second step: a's chunk [3, 6) writes offset 3 of block 5 then the
    first two slots of block 9; the block tables are a's blocks padded with the null block,
    and b's."""
    bs = 4
    runner = make_runner(root, bs)
    a = Seq("two-a", list(range(10, 16)), 0, [5])
    b = Seq("two-b", [20] * 9, 0, [2, 7, 3])
    step(runner, [Chunk(a, 0, 3)], [a], CachedRequestData(), [], [])
    grown = CachedRequestData()
    grown.append("two-a", False, [9])
    output = SchedulerOutput(
        req_ids=["two-a", "two-b"], num_scheduled_tokens=[3, 9], num_computed_tokens=[3, 0],
        samples=[True, True], total_num_scheduled_tokens=12,
        scheduled_new_reqs=[NewRequestData("two-b", b.prompt, SamplingParams(), [2, 7, 3], 0)],
        scheduled_cached_reqs=grown)
    inputs = runner.prepare_step(output).inputs
    assert inputs.meta.slot_mapping[:3].tolist() == [5 * bs + 3, 9 * bs, 9 * bs + 1]
    assert inputs.meta.slot_mapping[3:].tolist() == [2 * bs + i for i in range(4)] + [
        7 * bs + i for i in range(4)] + [3 * bs]
    assert inputs.meta.block_tables[:, :3].tolist() == [[5, 9, 0], [2, 7, 3]]
    assert not inputs.meta.block_tables[:, 3:].any()
    assert inputs.input_ids.tolist() == a.prompt[3:] + b.prompt
    runner.prepare_step(SchedulerOutput(finished_req_ids=["two-a", "two-b"]))
    assert runner.requests == {}


@pytest.mark.parametrize("bs", [1, 4])
def test_chunks_that_end_on_a_block_boundary(root, bs):
    """A prompt of two whole blocks in two chunks, each exactly one block: the second chunk's
    first token takes offset 0 of the new block (not the old block's offset bs), and the
    first step's table row holds one block padded with the null block. A second request of
    one token shows a ragged batch: its row is one block, the rest the null block."""
    runner = make_runner(root, bs)
    a = Seq(f"edge-a{bs}", list(range(30, 30 + 2 * bs)), 0, [11])
    c = Seq(f"edge-c{bs}", [40], 0, [13])
    first = runner.prepare_step(SchedulerOutput(
        req_ids=[a.req_id, c.req_id], num_scheduled_tokens=[bs, 1], num_computed_tokens=[0, 0],
        samples=[False, True], total_num_scheduled_tokens=bs + 1,
        scheduled_new_reqs=[NewRequestData(s.req_id, s.prompt, SamplingParams(), s.blocks, 0)
                            for s in (a, c)])).inputs
    assert first.meta.slot_mapping.tolist() == [11 * bs + i for i in range(bs)] + [13 * bs]
    assert first.meta.block_tables[:, :2].tolist() == [[11, 0], [13, 0]]
    assert first.meta.seq_lens.tolist() == [bs, 1]
    grown = CachedRequestData()
    grown.append(a.req_id, False, [17])
    second = runner.prepare_step(SchedulerOutput(
        req_ids=[a.req_id], num_scheduled_tokens=[bs], num_computed_tokens=[bs],
        samples=[True], total_num_scheduled_tokens=bs, scheduled_cached_reqs=grown,
        finished_req_ids=[c.req_id])).inputs
    assert second.meta.slot_mapping.tolist() == [17 * bs + i for i in range(bs)]
    assert second.positions.tolist() == list(range(bs, 2 * bs))
    assert second.meta.block_tables[0, :3].tolist() == [11, 17, 0]
    assert second.input_ids.tolist() == a.prompt[bs:]
    runner.prepare_step(SchedulerOutput(finished_req_ids=[a.req_id]))
    assert runner.requests == {}
