"""Sampling time per decode step on a CUDA GPU: the fused kernels against the torch path.

    PYTHONPATH=. python benchmarks/sampling.py --out DIR [--batch 256] [--vocab 151936]
                                               [--pivots 8 16 32] [--blocks 512 1024]
                                               [--candidates 256 0]

One step's sampling at Qwen3's vocabulary from bf16 logits, for three workloads: greedy;
top_p 0.95 with top_k 40 at temperature 0.8; and the issue's mix (every row top_p 0.95 /
top_k 40, a quarter with repetition penalty 1.1, half seeded). Each is timed on the torch
path (`Sampler()`, which sorts the vocabulary) and on the fused kernels,
with the metadata built outside the timed call, as the runner overlaps it. The penalized
rows carry 512 prompt and 256 output tokens in a `PenaltyState`, and the fused rows'
penalty update (the scatter of the sampled tokens) is timed with them. --pivots / --blocks /
--candidates also time the filtered kernel's launch configurations (candidates 0: every
row takes the full pass over its vocabulary, as before the candidate path). Before timing
it checks the fused greedy tokens against torch.argmax and the filtered kernel's penalized
greedy rows against the reference penalties. Writes DIR/sampling.json (one object per row: workload, path,
batch, vocab, us_per_step, device, date) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import triton

from pagedserve.device.input_batch import CachedRequestState
from pagedserve.device.penalties import PenaltyState
from pagedserve.device.sampler import (Sampler, SamplingMetadata, apply_penalties,
                                       triton_sampling_kernels)
from pagedserve.kernels.triton.filtered_sampling import FilteredKernelConfig, filtered_sample
from pagedserve.sampling_params import SamplingParams

PROMPT_LEN, OUTPUT_LEN = 512, 256
WORKLOADS = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "top_p_top_k": lambda i: SamplingParams(temperature=0.8, top_p=0.95, top_k=40),
    "mixed_penalties": lambda i: SamplingParams(
        temperature=0.8, top_p=0.95, top_k=40, seed=i if i % 2 else None,
        repetition_penalty=1.1 if i % 4 == 0 else 1.0),
}


def make_requests(workload: str, batch: int, vocab: int, gen: torch.Generator
                  ) -> list[CachedRequestState]:
    requests = []
    for i in range(batch):
        prompt = torch.randint(vocab, (PROMPT_LEN,), generator=gen).tolist()
        request = CachedRequestState(f"r{i}", prompt, WORKLOADS[workload](i))
        for token in torch.randint(vocab, (OUTPUT_LEN,), generator=gen).tolist():
            request.append_output_token(token)
        requests.append(request)
    return requests


def penalty_state(requests: list[CachedRequestState], vocab: int, device: torch.device
                  ) -> tuple[PenaltyState, list[int]]:
    state = PenaltyState(vocab, device, initial_slots=len(requests))
    for r in requests:
        if r.sampling_params.needs_penalties:
            state.add(r.req_id, r.prompt_token_ids, r.output_token_ids)
    return state, state.slots([r.req_id for r in requests])


def bench_us(fn) -> float:
    if not torch.cuda.is_available():  # a smoke run on the CPU (TRITON_INTERPRET=1)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def check(logits: torch.Tensor, requests: list[CachedRequestState], vocab: int) -> None:
    """Fused greedy equals torch.argmax; penalized greedy equals the reference's argmax."""
    device = logits.device
    greedy = [CachedRequestState(r.req_id, r.prompt_token_ids,
                                 SamplingParams(temperature=0.0, repetition_penalty=1.3,
                                                frequency_penalty=0.2)) for r in requests]
    meta_all = SamplingMetadata.from_requests(
        [CachedRequestState("g", [1], SamplingParams(temperature=0.0))] * len(requests), vocab,
        device, fused=True)
    fused = Sampler(triton_sampling_kernels())
    assert torch.equal(fused(logits, meta_all).sampled_token_ids, logits.argmax(-1))
    for r, source in zip(greedy, requests):
        for token in source.output_token_ids:
            r.append_output_token(token)
    state, slots = penalty_state(greedy, vocab, device)
    meta = SamplingMetadata.from_requests(greedy, vocab, device, fused=True,
                                          penalty_state=state, penalty_slots=slots)
    tokens = fused(logits, meta).sampled_token_ids
    expected = apply_penalties(logits.float(), meta.penalties).argmax(-1)
    mismatches = int((tokens != expected).sum())
    print(f"check: fused greedy = argmax; penalized greedy rows differing from the "
          f"reference: {mismatches} of {len(requests)}", flush=True)


def time_workload(workload: str, logits: torch.Tensor, vocab: int, configs: list
                  ) -> list[dict]:
    device = logits.device
    requests = make_requests(workload, logits.shape[0], vocab,
                             torch.Generator().manual_seed(0))
    state, slots = penalty_state(requests, vocab, device)
    rows = []
    torch_meta = SamplingMetadata.from_requests(requests, vocab, device, fused=False,
                                                penalty_state=state, penalty_slots=slots)
    torch_sampler = Sampler()
    rows.append(("torch", bench_us(lambda: torch_sampler(logits, torch_meta))))
    fused_meta = SamplingMetadata.from_requests(requests, vocab, device, fused=True,
                                                penalty_state=state, penalty_slots=slots)
    fused_sampler = Sampler(triton_sampling_kernels())

    def fused_step():
        tokens = fused_sampler(logits, fused_meta).sampled_token_ids
        if fused_meta.penalties is not None:
            state.update(fused_meta.penalties.rows, tokens)

    rows.append(("fused", bench_us(fused_step)))
    if fused_meta.filtered or fused_meta.penalties is not None:
        m = fused_meta
        temperature = m.temperature if m.temperature is not None else torch.ones(
            len(requests), device=device)
        greedy = m.greedy_mask if m.greedy_mask is not None else torch.ones(
            len(requests), dtype=torch.bool, device=device)
        philox = m.philox if m.philox is not None else torch.zeros(
            len(requests), 2, dtype=torch.int64, device=device)
        for config in configs:
            us = bench_us(lambda: filtered_sample(logits, temperature, greedy, philox, m.min_p,
                                                  m.top_k, m.top_p, m.penalties, config))
            label = "full" if config.candidates >= vocab else f"cand={config.candidates}"
            rows.append((f"filtered b={config.block} p={config.pivots} {label}", us))
    return [{"workload": workload, "path": path, "us_per_step": round(us, 1)}
            for path, us in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--pivots", type=int, nargs="*", default=[16])
    parser.add_argument("--blocks", type=int, nargs="*", default=[512])
    parser.add_argument("--candidates", type=int, nargs="*", default=[256, 0])
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script "
                        "under TRITON_INTERPRET=1 on tiny shapes; its times mean nothing")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    logits = (torch.randn(args.batch, args.vocab, device=device) * 3).bfloat16()
    check(logits, make_requests("greedy", args.batch, args.vocab,
                                torch.Generator().manual_seed(1)), args.vocab)
    full = 1 << (args.vocab - 1).bit_length()  # at least the vocabulary: no candidate path
    configs = [FilteredKernelConfig(block=b, pivots=p, candidates=c or full)
               for b in args.blocks for p in args.pivots for c in args.candidates]
    rows = []
    for workload in WORKLOADS:
        rows += time_workload(workload, logits, args.vocab, configs)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    date = datetime.date.today().isoformat()
    for row in rows:
        row.update(batch=args.batch, vocab=args.vocab, device=name, date=date)
        print(f"{row['workload']:>16}  {row['path']:<32} {row['us_per_step']:>9.1f} us",
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sampling.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
