"""The fused sampling kernel against references, under TRITON_INTERPRET=1 (conftest).

Tiles are small (16 tokens) so short rows still cross tile and split boundaries. Greedy rows
are checked against torch.argmax; random rows exactly against a numpy reference of the noise
the kernel documents (Philox4x32-10, itself checked on Random123's known answers), and their
empirical distribution against softmax(logits / T). The interpreter runs one program per
row at a time, slowly, so row counts stay small; the many-draw statistics run on the
vectorized reference, which the exact test ties to the kernel.
"""

import numpy as np
import pytest
import torch

from pagedserve.device.input_batch import CachedRequestState
from pagedserve.device.penalties import PenaltyState
from pagedserve.device.sampler import (Sampler, SamplingKernels, SamplingMetadata, VocabShard,
                                       apply_penalties, triton_sampling_kernels)
from pagedserve.kernels.triton.sampling import (SamplingKernelConfig, choose_num_splits,
                                               fused_sample, sample_vocab_shard,
                                               split_winners)
from pagedserve.sampling_params import SamplingParams

SMALL = SamplingKernelConfig(block=16)
TILINGS = [(SMALL, None), (SMALL, 1), (SamplingKernelConfig(block=32), 3),
           (SamplingKernelConfig(block=64), 2)]
NAN, INF = float("nan"), float("inf")
MASK32 = np.uint64(0xFFFFFFFF)
LOG2E = 1.4426950408889634


# -- numpy reference of the kernel's noise ---------------------------------------------------

def philox4x32(key, counters: list, rounds: int = 10) -> list[np.ndarray]:
    """Philox4x32 (Salmon et al., SC'11) on uint64 arrays holding 32-bit words; key(s) 64-bit."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & MASK32 for c in counters)
    key = np.asarray(key, dtype=np.uint64)
    k0, k1 = key & MASK32, key >> np.uint64(32)
    for _ in range(rounds):
        p0, p1 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & MASK32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & MASK32)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & MASK32, (k1 + np.uint64(0xBB67AE85)) & MASK32
    return [c0, c1, c2, c3]


def reference_draws(logits: torch.Tensor, temperature: float, seeds, streams) -> np.ndarray:
    """The kernel's documented draw for each (seed, stream), vectorized: argmax over tokens of
    logits * log2(e) / T - log2(log2(e) * E), E = -ln(1 - V), V from the top 23 bits of
    output token % 4 of the Philox call at counter (token // 4, stream low word, stream high
    word, 0); float32, E by its series below V = 2^-7 as in the kernel."""
    vocab = logits.shape[0]
    seeds = np.asarray(seeds, dtype=np.uint64)[:, None]
    streams = np.asarray(streams, dtype=np.uint64)[:, None]
    groups = np.arange(-(-vocab // 4), dtype=np.uint64)[None, :]
    zero = groups * seeds * 0
    outputs = philox4x32(seeds + zero, [groups + zero, (streams & MASK32) + zero,
                                        (streams >> np.uint64(32)) + zero, zero])
    bits = np.stack(outputs, axis=2).reshape(len(seeds), -1)[:, :vocab]
    v = ((bits >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2**-23)
    assert 0 < v.min() and v.max() < 1
    f32 = np.float32
    series = v * (f32(1) + v * (f32(0.5) + v * f32(1 / 3))) * f32(LOG2E)
    exponential2 = np.where(v < f32(2**-7), series, -np.log2(f32(1) - v))
    scale = f32(LOG2E) / f32(temperature)
    scores = logits.float().numpy()[None, :] * scale - np.log2(exponential2)
    return scores.argmax(-1)


def test_philox_reference_matches_random123_known_answers():
    cases = [(0, [0, 0, 0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
             (2**64 - 1, [2**32 - 1] * 4, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
             (0x299F31D0A4093822, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
              [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1])]
    for key, counters, expected in cases:
        assert [int(w) for w in philox4x32(key, counters)] == expected


# -- helpers ---------------------------------------------------------------------------------

def random_batch(temperatures: list[float], philox: list[tuple[int, int]]):
    """(temperature, greedy_mask, philox) tensors; temperature 0 marks a greedy row."""
    greedy = torch.tensor([t == 0 for t in temperatures])
    temperature = torch.tensor([t if t > 0 else 1.0 for t in temperatures])
    return temperature, greedy, torch.tensor(philox, dtype=torch.int64)


def fresh_seed() -> int:
    return torch.seed() % 2**31


# -- greedy rows -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config,num_splits", TILINGS[:3])
def test_greedy_rows_equal_torch_argmax_ties_included(dtype, config, num_splits):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    # integer-valued logits: many exact ties, spread over tiles and splits
    logits = torch.randint(-4, 5, (5, 75), generator=gen).to(dtype)
    logits[4] = 0
    logits[4, [70, 9, 40]] = 7  # a three-way tie in different tiles: the lowest id wins
    expected = logits.argmax(-1)
    assert expected[4] == 9
    got = fused_sample(logits, None, None, None, config, num_splits)
    assert torch.equal(got, expected), f"seed {seed}"
    # the same rows marked greedy inside a batch that also samples
    temps = [0.0, 0.0, 1.0, 0.0, 0.0]
    got = fused_sample(logits, *random_batch(temps, [(i, 0) for i in range(5)]), config,
                       num_splits)
    greedy = torch.tensor([t == 0 for t in temps])
    assert torch.equal(got[greedy], expected[greedy]), f"seed {seed}"


def nan_inf_rows() -> torch.Tensor:
    rows = torch.randn(5, 40, generator=torch.Generator().manual_seed(5))
    rows[0, [30, 7]] = NAN  # the lowest NaN, as torch.argmax
    rows[1] = -INF  # all -inf: token 0, as torch.argmax
    rows[2] = -INF
    rows[2, 33] = -3.0  # the only finite logit
    rows[3, [20, 25]] = INF  # the lowest +inf
    rows[4, 2], rows[4, 35] = INF, NAN  # NaN beats +inf, as torch.argmax
    return rows


@pytest.mark.parametrize("config,num_splits", TILINGS[:2])
def test_nan_and_inf_follow_torch_argmax_on_greedy_and_random_rows(config, num_splits):
    logits = nan_inf_rows()
    expected = logits.argmax(-1)
    assert expected.tolist() == [7, 0, 33, 20, 35]
    assert torch.equal(fused_sample(logits, None, None, None, config, num_splits), expected)
    # random rows: a NaN or +inf logit is always the draw; -inf logits never are
    batch = random_batch([0.7] * 5, [(11 + i, 3) for i in range(5)])
    assert torch.equal(fused_sample(logits, *batch, config, num_splits), expected)


# -- random rows -----------------------------------------------------------------------------

def test_random_rows_equal_the_reference_draw():
    """Exact: same Philox words, same counters, same float32 scores."""
    seed = fresh_seed()
    logits = torch.randn(6, 70, generator=torch.Generator().manual_seed(seed)) * 2
    temps = [0.6, 1.0, 2.5, 0.05, 1.3, 0.9]
    philox = [(seed, 0), (2**63 - 1, 5), (0, 2**32 + 4), (7, 2**40 + 3), (123, 9), (seed, 1)]
    got = fused_sample(logits, *random_batch(temps, philox), SMALL)
    expected = [int(reference_draws(logits[i], temps[i], [seed], [stream])[0])
                for i, (seed, stream) in enumerate(philox)]
    assert got.tolist() == expected, f"seed {seed}"


def test_extreme_uniforms_give_finite_noise():
    """Found by search with the reference: at stream 3, seed 402055 draws the largest V for
    token 3 (the smallest noise) and seed 125823 the smallest V for token 5 (the largest).
    The smallest must not win a flat row (a uniform rounding to 1 once gave it +inf); the
    largest, about 16 nats, must carry a token 10 nats down to the top."""
    logits = torch.zeros(2, 8)
    logits[1, 5] = -10.0
    philox = [(402055, 3), (125823, 3)]
    got = fused_sample(logits, *random_batch([1.0, 1.0], philox), SMALL)
    expected = [int(reference_draws(logits[i], 1.0, [seed], [stream])[0])
                for i, (seed, stream) in enumerate(philox)]
    assert got.tolist() == expected
    assert expected[0] != 3 and expected[1] == 5


LOGITS_5 = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_kernel_draws_follow_softmax_over_seeds():
    """160 rows, one draw each from its own seed. Chi-square, 4 degrees of freedom, below 30
    (the 1e-5 tail is at 25.7): a loose check that catches uniform or greedy-only draws and
    grossly wrong noise; the reference test below measures the law precisely. Seeds are
    fixed, so the outcome is too."""
    draws, temperature = 160, 0.6
    logits = LOGITS_5.expand(draws, -1)
    batch = random_batch([temperature] * draws, [(1000 + i, 0) for i in range(draws)])
    tokens = fused_sample(logits, *batch, SMALL)
    probs = (LOGITS_5 / temperature).softmax(-1).double().numpy()
    assert chi_square(np.bincount(tokens.numpy(), minlength=5), probs) < 30.0


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_reference_draws_follow_softmax_over_seeds_and_streams(temperature):
    """The kernel equals the reference draw for draw (above), so 50000 reference draws,
    across seeds and across streams of one seed, measure the kernel's distribution. A
    temperature off by 10% gives an expected chi-square above 100 at this count."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.25])
    probs = (logits / temperature).softmax(-1).double().numpy()
    n = 50000
    for seeds, streams in ((np.arange(n), np.zeros(n)), (np.full(n, 42), np.arange(n) + 2**32)):
        counts = np.bincount(reference_draws(logits, temperature, seeds, streams), minlength=7)
        assert chi_square(counts, probs) < 40.0  # 6 dof: the 1e-6 tail is at 35.9


def test_seeded_row_draws_the_same_token_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(7)
    row = torch.randn(90, generator=gen)
    others = torch.randn(4, 90, generator=gen) * 3
    alone, batched = [], []
    for stream in range(6):
        alone.append(int(fused_sample(row[None], *random_batch([0.8], [(1234, stream)]),
                                      SMALL)[0]))
        batch = torch.cat([others[:3], row[None], others[3:]])
        temps = [1.0, 0.0, 0.3, 0.8, 2.0]
        philox = [(5, stream), (6, 0), (1234, stream + 1), (1234, stream), (99, 2**32)]
        config, num_splits = TILINGS[2 + stream % 2]
        batched.append(int(fused_sample(batch, *random_batch(temps, philox), config,
                                        num_splits)[3]))
    assert batched == alone
    assert len(set(alone)) > 1  # the stream really moves the draw
    other_seed = [int(fused_sample(row[None], *random_batch([0.8], [(4321, s)]), SMALL)[0])
                  for s in range(6)]
    assert other_seed != alone


def test_draws_do_not_depend_on_tiles_or_splits():
    seed = fresh_seed()
    logits = torch.randn(4, 150, generator=torch.Generator().manual_seed(seed))
    batch = random_batch([0.0, 1.0, 0.7, 3.0], [(seed, 0), (seed, 1), (seed + 1, 0), (3, 8)])
    results = [fused_sample(logits, *batch, config, splits) for config, splits in TILINGS]
    for result in results[1:]:
        assert torch.equal(result, results[0]), f"seed {seed}"


def vocab_slices(logits: torch.Tensor, ranks: int) -> list[tuple[torch.Tensor, int, int]]:
    """Each rank's (slice, first token id, real tokens) as a vocab-parallel LM head cuts
    [S, V]: ceil(V / ranks) columns each, the last rank's tail padding, here huge logits
    (a zero-weight row's logit is 0, which beats a row of negative ones)."""
    per_rank = -(-logits.shape[1] // ranks)
    padded = torch.full((logits.shape[0], per_rank * ranks), 1e4, dtype=logits.dtype)
    padded[:, :logits.shape[1]] = logits
    return [(padded[:, r * per_rank:(r + 1) * per_rank], r * per_rank,
             min(per_rank, logits.shape[1] - r * per_rank)) for r in range(ranks)]


@pytest.mark.parametrize("ranks,vocab,tiling", [(2, 151, 0), (4, 157, 2)])
def test_slices_of_the_vocabulary_draw_what_the_whole_row_draws(ranks, vocab, tiling):
    """Each rank's split winners, concatenated in rank order, reduce to fused_sample's token
    of the whole row: greedy ties and NaN/inf included, padding never drawn."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    logits = torch.cat([torch.randint(-4, 5, (4, vocab), generator=gen).float(),
                        torch.randn(4, vocab, generator=gen) * 2])
    logits[0, [3, vocab - 2]] = 9  # a tie across two ranks: the lower id
    logits[1, vocab - 1] = NAN
    logits[2] = -INF
    logits[3, [vocab // 2 + 1, 1]] = INF
    temps = [0.0, 0.0, 0.9, 0.0, 0.0, 1.0, 0.5, 3.0]
    batch = random_batch(temps, [(seed, i) for i in range(8)])
    slices = vocab_slices(logits, ranks)
    config, splits = TILINGS[tiling]
    for rows in (None, batch):
        args = rows or (None, None, None)
        parts = [split_winners(s, *args, offset, real, config, splits)
                 for s, offset, real in slices]
        got = sample_vocab_shard(slices[0][0], *args, slices[0][1], slices[0][2], ranks,
                                 lambda own: torch.cat([own] + parts[1:], -1), config, splits)
        assert torch.equal(got, fused_sample(logits, *args, config, splits)), f"seed {seed}"
        assert got.max() < vocab


def test_a_slice_must_start_on_a_group_of_four_tokens():
    with pytest.raises(ValueError, match="multiple of 4"):
        split_winners(torch.zeros(1, 8), None, None, None, token_offset=6)
    with pytest.raises(ValueError, match="vocab"):
        split_winners(torch.zeros(1, 8), None, None, None, token_offset=8, vocab=9)


def test_rows_split_until_the_gpu_is_full_but_never_below_a_tile():
    vocab = 151936  # 75 tiles of 2048
    assert choose_num_splits(256, vocab, num_sms=132) == 3  # 768 programs for 528 wanted
    assert choose_num_splits(1024, vocab, num_sms=132) == 1
    assert choose_num_splits(1, vocab, num_sms=132) == 75  # one tile each
    assert choose_num_splits(8, 100, num_sms=132) == 1


def test_rejects_partial_row_parameters_and_bad_tiles():
    temperature, greedy, philox = random_batch([1.0], [(0, 0)])
    with pytest.raises(ValueError, match="together"):
        fused_sample(torch.zeros(1, 8), temperature, greedy, None)
    for block in (2, 48):
        with pytest.raises(ValueError, match="power of two"):
            SamplingKernelConfig(block=block)


# -- the Sampler on its fused path -----------------------------------------------------------

VOCAB = 40


def make_request(i: int, output=(), **params) -> CachedRequestState:
    params.setdefault("max_tokens", 100)
    request = CachedRequestState(f"r{i}", [1, 2, 3], SamplingParams(**params))
    for token in output:
        request.append_output_token(token)
    return request


def fused_step(requests: list[CachedRequestState], logits: torch.Tensor,
               kernels: SamplingKernels | None = None):
    state = PenaltyState(VOCAB, torch.device("cpu"))
    for r in requests:
        if r.sampling_params.needs_penalties:
            state.add(r.req_id, r.prompt_token_ids, r.output_token_ids)
    meta = SamplingMetadata.from_requests(requests, VOCAB, torch.device("cpu"), fused=True,
                                          penalty_state=state,
                                          penalty_slots=state.slots([r.req_id
                                                                     for r in requests]))
    assert meta.all_greedy or meta.philox is not None
    return Sampler(kernels or triton_sampling_kernels())(logits, meta), meta


def test_fused_sampler_mixed_batch():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3)).bfloat16()
    requests = [
        make_request(0, temperature=0.0, logprobs=2),
        make_request(1, temperature=0.9, seed=77, output=(4, 4)),
        make_request(2, temperature=1.0, top_k=3, seed=5),
        make_request(3, temperature=0.0, output=(int(logits[3].argmax()),),
                     repetition_penalty=2.0),
        make_request(4, temperature=1.2),
    ]
    out, meta = fused_step(requests, logits)
    tokens = out.sampled_token_ids.tolist()
    assert tokens[0] == int(logits[0].argmax())
    alone, _ = fused_step([make_request(9, temperature=0.9, seed=77, output=(4, 4))],
                          logits[1:2])
    assert tokens[1] == int(alone.sampled_token_ids[0])  # same draw from the other kernel
    assert tokens[2] in logits[2].float().topk(3).indices.tolist()
    penalized = apply_penalties(logits.float(), meta.penalties)
    assert tokens[3] == int(penalized[3].argmax()) != int(logits[3].argmax())
    raw = logits.float().log_softmax(-1)
    torch.testing.assert_close(out.logprobs.sampled_logprobs,
                               raw.gather(1, out.sampled_token_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.logprobs.top_logprobs, raw.topk(2).values)


def test_fused_sampler_seeded_request_repeats_step_by_step():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))

    def generate(seed: int) -> list[int]:
        request = make_request(0, temperature=1.0, seed=seed)
        for _ in range(6):
            request.append_output_token(
                int(fused_step([request], logits)[0].sampled_token_ids[0]))
        return request.output_token_ids

    first = generate(2024)
    assert generate(2024) == first
    assert generate(2025) != first
    assert len(set(first)) > 1


def test_fused_sampler_unseeded_rows_follow_torch_manual_seed():
    logits = torch.zeros(4, VOCAB)  # uniform: four rows, 40 tokens each
    requests = [make_request(i, temperature=1.0) for i in range(4)]
    torch.manual_seed(0)
    first = fused_step(requests, logits)[0].sampled_token_ids.tolist()
    second = fused_step(requests, logits)[0].sampled_token_ids.tolist()
    torch.manual_seed(0)
    assert fused_step(requests, logits)[0].sampled_token_ids.tolist() == first
    assert second != first  # a fresh step seed per step
    assert len(set(first + second)) > 2  # rows of one step draw independently


def test_fused_sampler_hands_the_kernels_model_dtype_logits(monkeypatch):
    """The point of the kernels is one read of the bf16 logits per pass: no float32 copy
    first, not even for logprobs (computed apart) or penalties (fused into the loads)."""
    kernels, seen = triton_sampling_kernels(), []

    def recording(kernel):
        def run(logits, *args):
            seen.append((kernel.__name__, logits.dtype))
            return kernel(logits, *args)
        return run

    recorded = SamplingKernels(recording(kernels.plain), recording(kernels.filtered))
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(6)).bfloat16()
    fused_step([make_request(0, temperature=0.8), make_request(1, temperature=0.0)], logits,
               recorded)
    fused_step([make_request(0, temperature=0.8, logprobs=1)], logits[:1], recorded)
    fused_step([make_request(0, temperature=0.8, presence_penalty=0.5, output=(3,))],
               logits[:1], recorded)
    fused_step([make_request(0, temperature=0.0, presence_penalty=0.5, output=(3,))],
               logits[:1], recorded)
    assert seen == [("fused_sample", torch.bfloat16), ("fused_sample", torch.bfloat16),
                    ("filtered_sample", torch.bfloat16), ("filtered_sample", torch.bfloat16)]


@pytest.mark.parametrize("params,shards", [
    ({"temperature": 0.0}, True),
    ({"temperature": 0.8, "seed": 3}, True),
    ({"temperature": 0.8, "top_k": 5}, False),
    ({"temperature": 0.8, "min_p": 0.1}, False),
    ({"temperature": 0.0, "logprobs": 1}, False),
    ({"temperature": 0.0, "presence_penalty": 0.5}, False),
    ({"temperature": 0.0, "logit_bias": {3: 1.0}}, False),
    ({"temperature": 0.0, "allowed_token_ids": [1, 2]}, False),
    ({"temperature": 0.0, "bad_words_token_ids": [[7]]}, False),
])
def test_only_plain_rows_sample_from_a_vocabulary_slice(params, shards):
    """A row that reads the whole vocabulary (a filter, logprobs, a penalty, a restriction)
    needs the gathered logits: the sampler says so, and refuses the slice."""
    requests = [make_request(0, temperature=0.0), make_request(1, **params)]
    state = PenaltyState(VOCAB, torch.device("cpu"))
    for r in requests:
        if r.sampling_params.needs_penalties:
            state.add(r.req_id, r.prompt_token_ids, r.output_token_ids)
    meta = SamplingMetadata.from_requests(requests, VOCAB, torch.device("cpu"), fused=True,
                                          penalty_state=state,
                                          penalty_slots=state.slots(["r0", "r1"]))
    sampler = Sampler(triton_sampling_kernels())
    assert sampler.samples_shards(meta) == shards
    assert not Sampler().samples_shards(SamplingMetadata(all_greedy=True))  # no kernels
    shard = VocabShard(0, VOCAB, VOCAB, 1, lambda parts: parts)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    if shards:
        assert torch.equal(sampler.sample_shard(logits, meta, shard).sampled_token_ids,
                           sampler(logits, meta).sampled_token_ids)
    else:
        with pytest.raises(ValueError, match="whole vocabulary"):
            sampler.sample_shard(logits, meta, shard)
