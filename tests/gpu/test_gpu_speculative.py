"""Speculative decoding on CUDA (issue 30): the ngram, draft-model and EAGLE-3 engines against
the default engine (async scheduling, CUDA graphs), same weights; each speculative engine
runs with async scheduling too (CUDA's default).

float32, so that a difference is a bug and not noise: a verify goes through the paged
prefill kernel while plain decodes go through the decode kernel, and in bf16 an
LM head scaled x25 puts logits near 64-128 where bf16 steps by 0.5, so a near-tie flips
whenever the two kernels round differently (a logprob moves by ~0.25 when one logit moves
one step). In float32 (IEEE dots, not TF32) the same sums in another order move logits by
~1e-5 relative, far below the x25 head's gaps: every request's greedy tokens must be the
default engine's, and its logprobs within 1e-2 (float32 noise is ~1e-4 here; a position's
logits read from the wrong row or penalty state are off by far more). A failure names each request's first diverging
position. The checkpoint is small (8 layers of the 0.6B shape, a 32000-token vocabulary)
and made here, once for the module.

The draft model is the target's own checkpoint (so nearly every draft is accepted, which
needs the draft's KV in the target's blocks to be right); the EAGLE-3 heads are random, in
the published layout (tests/spec/heads.py), reading the target's default three layers.
Verify steps (every request its last token and k drafts) replay CUDA graphs of their own,
and EAGLE-3's target steps replay graphs that also return its three layers' streams: each
proposer's engine gives the tokens of the same engine with enforce_eager, with requests
arriving while others verify (steps mixing prefills and verifies run eagerly), and the
engine's stats show the graphs replayed.
No bf16 case: a verify takes the same code in either dtype (its logits read as float32), so
bf16 would only add near-tie flips and its own kernels' compile time."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.gpu.checkpoints import QWEN3_8_LAYERS, random_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
VOCAB = QWEN3_8_LAYERS["vocab_size"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return random_checkpoint(tmp_path_factory.mktemp("spec-fp32"), QWEN3_8_LAYERS, "float32")


@pytest.fixture(scope="module")
def loaded(checkpoint):
    from pagedserve.config import EngineConfig
    from pagedserve.frontend.llm_engine import LoadedModel

    return LoadedModel.load(EngineConfig(model=checkpoint, device="cuda", dtype="float32"))


def make_engine(loaded, **options):
    from pagedserve.config import EngineConfig
    from pagedserve.frontend.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(device="cuda", dtype="float32", kv_cache_memory=2 << 30,
                                  max_model_len=2048, max_num_seqs=16, **options), loaded)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(20, 300))] for _ in range(count)]


def repeating_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase: what prompt lookup feeds on."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        phrase = [rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 20))]
        out.append((phrase * 20)[:rng.randint(60, 200)])
    return out


def run_outputs(engine, prompt_list, params_list) -> list:
    """Each request's final CompletionOutput; every block back in the pool at the end."""
    for i, (ids, params) in enumerate(zip(prompt_list, params_list)):
        engine.add_request(f"c{i}", None, params, prompt_token_ids=ids)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0]
    assert engine.get_stats().kv_cache_usage == 0.0
    return [done[f"c{i}"] for i in range(len(prompt_list))]


def run(engine, prompt_list, params_list) -> list[list[int]]:
    return [o.token_ids for o in run_outputs(engine, prompt_list, params_list)]


def first_divergences(plain: list[list[int]], speculative: list[list[int]]) -> list[int | None]:
    """Each request's first position where the tokens differ (None: the same tokens)."""
    out = []
    for a, b in zip(plain, speculative):
        diverge = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                       None if len(a) == len(b) else min(len(a), len(b)))
        out.append(diverge)
    return out


def assert_same_tokens(plain, speculative) -> None:
    divergences = first_divergences(plain, speculative)
    assert divergences == [None] * len(plain), f"first diverging positions: {divergences}"


def greedy(max_tokens: int, **options):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **options)


@torch.inference_mode()
@pytest.mark.parametrize("batch", [1, 4])
def test_ngram_gives_the_default_engines_greedy_tokens(loaded, batch):
    prompt_list = repeating_prompts(batch, seed=batch)
    params = [greedy(48)] * batch
    plain = run(make_engine(loaded), prompt_list, params)
    engine = make_engine(loaded, speculative_config=NGRAM)
    assert engine.async_scheduling  # its steps that may draft run synchronously
    speculative = run(engine, prompt_list, params)
    assert_same_tokens(plain, speculative)
    assert engine.get_stats().spec_num_accepted_tokens > 0


@torch.inference_mode()
@pytest.mark.parametrize("batch", [1, 4])
def test_a_draft_model_gives_the_default_engines_greedy_tokens(loaded, checkpoint, batch):
    prompt_list = prompts(batch, seed=20 + batch)
    params = [greedy(48)] * batch
    plain = run(make_engine(loaded), prompt_list, params)
    engine = make_engine(loaded, speculative_config={"model": checkpoint,
                                                     "num_speculative_tokens": 4})
    speculative = run(engine, prompt_list, params)
    assert_same_tokens(plain, speculative)
    stats = engine.get_stats()
    # the draft is the target: a rejection is a near-tie between its decode and the verify
    assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens > 0, (
        stats.spec_num_accepted_tokens, stats.spec_num_draft_tokens)


def eagle3_head(loaded, folder: Path) -> str:
    from tests.spec.heads import write_eagle3_head

    mc = loaded.model_config
    return str(write_eagle3_head(folder, {
        "hidden_size": mc.hidden_size, "vocab_size": mc.vocab_size,
        "max_position_embeddings": mc.max_position_embeddings}, None, 4096, heads=16,
        kv_heads=8, head_dim=64))


@torch.inference_mode()
def test_eagle3_heads_give_the_default_engines_greedy_tokens(loaded, tmp_path):
    prompt_list = prompts(4, seed=31)
    params = [greedy(40)] * 4
    plain = run(make_engine(loaded), prompt_list, params)
    engine = make_engine(loaded, speculative_config={
        "method": "eagle3", "model": eagle3_head(loaded, tmp_path / "eagle3"),
        "num_speculative_tokens": 3})
    speculative = run(engine, prompt_list, params)
    assert_same_tokens(plain, speculative)
    assert engine.get_stats().spec_num_draft_tokens > 0


@torch.inference_mode()
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_async_engine_with_a_model_proposer_pipelines_large_batches(loaded, checkpoint,
                                                                    tmp_path, method):
    """A proposer on the device under async scheduling (CUDA's default): 12 requests with
    drafting off above 4 are pipelined (graphs, placeholders, the draft run over each
    step's chunks once its tokens are back), then drafted for and verified synchronously;
    the greedy tokens are the default engine's, and the target drafting for itself still
    has nearly every draft accepted (its KV was kept right through the pipelined steps)."""
    model = checkpoint if method == "draft_model" else eagle3_head(loaded, tmp_path / "e3")
    prompt_list = prompts(12, seed=41)
    params = [greedy(16 + 8 * i) for i in range(12)]
    plain = run(make_engine(loaded), prompt_list, params)
    engine = make_engine(loaded, speculative_config={
        "method": method, "model": model, "num_speculative_tokens": 3,
        "disable_by_batch_size": 4})
    assert engine.async_scheduling
    speculative = run(engine, prompt_list, params)
    assert_same_tokens(plain, speculative)
    stats = engine.get_stats()
    assert stats.spec_num_draft_tokens > 0
    if method == "draft_model":
        assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens, (
            stats.spec_num_accepted_tokens, stats.spec_num_draft_tokens)


def drafts_per_step(engine, prompt_list, params_list) -> list[dict[str, list[int]]]:
    """The requests' drafts after each step (`ModelRunnerOutput.draft_token_ids`), stepped
    by hand through the scheduler and the runner's three calls (synchronously)."""
    core = engine.engine_core
    for i, (ids, params) in enumerate(zip(prompt_list, params_list)):
        engine.add_request(f"c{i}", None, params, prompt_token_ids=ids)
    runner, steps = core.model_runner, []
    while core.scheduler.has_unfinished_requests():
        out = core.scheduler.schedule()
        result = runner.sample_tokens(runner.launch(runner.prepare_step(out))).result()
        core.scheduler.update_from_output(out, result)
        steps.append(result.draft_token_ids or {})
    return steps


@torch.inference_mode()
def test_eagle3_draft_steps_replay_graphs_that_draft_as_the_eager_steps(loaded, tmp_path):
    """EAGLE-3's single-token draft steps replay CUDA graphs (three requests in the graph of
    four, a padding row that writes nothing): after every step each request's drafts are
    those of the same engine with enforce_eager (whose target steps, and the streams they
    hand the head, are eager too; float32 keeps the two within rounding, far below the
    head's argmax gaps)."""
    head = eagle3_head(loaded, tmp_path / "eagle3")
    prompt_list = prompts(3, seed=51)
    params = [greedy(24)] * 3
    runs = []
    for eager in (True, False):
        engine = make_engine(loaded, enforce_eager=eager, speculative_config={
            "method": "eagle3", "model": head, "num_speculative_tokens": 4})
        runs.append(drafts_per_step(engine, prompt_list, params))
    # steps that drafted four for all three: draft steps of three rows, in the graph of four
    assert any(len(step) == 3 and all(len(d) == 4 for d in step.values())
               for step in runs[1])
    assert runs[1] == runs[0]


def top(entry: dict, k: int) -> list[float]:
    return sorted((lp.logprob for lp in entry.values()), reverse=True)[:k]


@torch.inference_mode()
def test_penalty_logprobs_and_json_rows_are_verified(loaded):
    """Rows with penalties and logprobs and a json_schema row (its k + 1 bitmask rows per
    verify filled by the grammar process, CUDA's default) are drafted for: drafts are
    accepted, the tokens are the default engine's, every token has the default engine's
    logprobs (its own, the top ones and its rank), and the JSON parses where it ended."""
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.structured.params import StructuredOutputsParams

    schema = {"type": "object", "required": ["a"],
              "properties": {"a": {"type": "string", "pattern": "^[a-z]{1,12}$"}}}
    prompt_list = repeating_prompts(3, seed=11)
    params = [greedy(48, logprobs=2, frequency_penalty=0.3, repetition_penalty=1.05),
              greedy(48, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=48,
                             structured_outputs=StructuredOutputsParams(json=schema))]
    plain = run_outputs(make_engine(loaded), prompt_list, params)
    engine = make_engine(loaded, speculative_config=NGRAM)
    speculative = run_outputs(engine, prompt_list, params)
    assert engine.get_stats().spec_num_accepted_tokens > 0
    assert_same_tokens([p.token_ids for p in plain], [s.token_ids for s in speculative])
    for p, s, k in zip(plain[:2], speculative[:2], (2, 1)):
        assert len(s.logprobs) == len(s.token_ids)
        for j, (token, got, want) in enumerate(zip(s.token_ids, s.logprobs, p.logprobs)):
            where = f"request {p is plain[1]:d}, position {j}"
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-2), where
            assert got[token].rank == want[token].rank, where
            # the top k by value (ids may swap on a float32 near-tie)
            assert top(got, k) == pytest.approx(top(want, k), abs=1e-2), where
    assert speculative[2].finish_reason == plain[2].finish_reason
    if plain[2].finish_reason == "stop":  # else it ran out of max_tokens (whitespace)
        assert json.loads(speculative[2].text)["a"].isalpha()


@torch.inference_mode()
def test_async_engine_pipelines_large_batches_and_drafts_small_ones(loaded):
    """12 requests of different lengths with drafting off above 4: the async engine pipelines
    (graphs, placeholders) while more than 4 run, then completes its step in flight and
    verifies synchronously; the greedy tokens are the default engine's, drafts are
    accepted."""
    prompt_list = repeating_prompts(12, seed=17)
    params = [greedy(16 + 8 * i) for i in range(12)]
    plain = run(make_engine(loaded), prompt_list, params)
    engine = make_engine(loaded, speculative_config=NGRAM | {"disable_by_batch_size": 4})
    assert engine.async_scheduling
    speculative = run(engine, prompt_list, params)
    assert_same_tokens(plain, speculative)
    assert engine.get_stats().spec_num_accepted_tokens > 0


@torch.inference_mode()
def test_seeded_sampled_rows_repeat_under_speculation(loaded):
    """Seeded sampled rows (one with a repetition penalty) in a mixed batch give the same
    tokens twice under speculation, drafts accepted."""
    from pagedserve.sampling_params import SamplingParams

    prompt_list = repeating_prompts(6, seed=9)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=40,
                             ignore_eos=True, repetition_penalty=1.1 if i == 5 else 1.0)
              for i in range(6)]
    outs, accepted = [], []
    for _ in range(2):
        engine = make_engine(loaded, speculative_config=NGRAM)
        outs.append(run(engine, prompt_list, params))
        accepted.append(engine.get_stats().spec_num_accepted_tokens)
    assert_same_tokens(outs[0], outs[1])
    assert min(accepted) > 0


def run_arrivals(engine, arrivals: list[tuple[int, list[int], object]]) -> list[list[int]]:
    """Each request's greedy tokens, the requests added at their step of the run (so that
    later prompts are prefilled in steps that verify the earlier requests' drafts)."""
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    done, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, ids, params) = pending.pop(0)
            engine.add_request(f"c{i}", None, params, prompt_token_ids=ids)
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
        step += 1
    assert engine.get_stats().kv_cache_usage == 0.0
    return [done[f"c{i}"] for i in range(len(arrivals))]


def proposer_config(method: str, loaded, checkpoint: str, folder: Path) -> dict:
    """Drafting off above four requests. ngram at k = 1: prompt lookup proposes fewer than k
    tokens where the output repeats a short cycle (the latest match is a cycle back), and
    a request with fewer than k drafts runs eagerly; one token is what any match gives."""
    if method == "ngram":
        config = NGRAM | {"num_speculative_tokens": 1}
    elif method == "draft_model":
        config = {"model": checkpoint, "num_speculative_tokens": 4}
    else:
        config = {"method": "eagle3", "model": eagle3_head(loaded, folder),
                  "num_speculative_tokens": 3}
    return config | {"disable_by_batch_size": 4}


@torch.inference_mode()
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_verify_graphs_give_the_eager_engines_tokens(loaded, checkpoint, tmp_path, method):
    """Three requests verifying (in the graph of four), three more arriving beside them
    (a step of prefills and verifies: eager), six decoding with drafting off (decode
    graphs: EAGLE-3's target's too), back to verifies as they finish, a seventh arriving
    beside those, and the longest alone at the end (verifies in the graph of one): the
    same greedy tokens as with enforce_eager, verify and decode graphs replayed, none in
    the eager engine."""
    spec = proposer_config(method, loaded, checkpoint, tmp_path / "eagle3")
    prompt_list = repeating_prompts(7, seed=61)
    max_tokens = [24, 30, 36, 42, 48, 96, 20]
    arrivals = [(step, ids, greedy(n))
                for step, ids, n in zip([0, 0, 0, 2, 2, 2, 30], prompt_list, max_tokens)]
    outs, stats = [], []
    for eager in (True, False):
        engine = make_engine(loaded, enforce_eager=eager, speculative_config=spec)
        outs.append(run_arrivals(engine, arrivals))
        stats.append(engine.get_stats())
    assert_same_tokens(outs[0], outs[1])
    eager, graphs = stats
    assert eager.num_verify_graph_steps == eager.num_decode_graph_steps == 0
    assert graphs.spec_num_drafts > 0 and graphs.num_verify_graph_steps > 0, graphs
    assert graphs.num_decode_graph_steps > 0, graphs
