"""How much reserved KV memory holds no token: contiguous reservation vs paged blocks.

Reproduces the PagedAttention paper's memory-waste finding with a simulation, no GPU needed.
Run from the repo root: `python -m benchmarks.fragmentation [--plot docs/fragmentation.png]`.

Workload (ShareGPT-like, stated so anyone can change it): prompt and output lengths are
independent lognormals, prompt mean 161 and output mean 338 tokens (the paper's ShareGPT
means), sigma 1.0, clipped to >= 1 and to prompt + output <= max_model_len (2048).

Serving model: every request is queued at time 0; each step every running request appends one
token; a request holds `prompt` tokens when admitted and finishes after `output` steps.
Admission is first come first served while memory allows. Strategies:
  reserve-max     reserve max_model_len slots per request for its whole life
  reserve-pow2    reserve the request's true final length (an oracle) rounded up to a power
                  of two: the best a contiguous allocator can do without knowing the future
                  exactly
  paged-B         blocks of B tokens taken as the request grows; when a step needs a block
                  and none is free, the most recently admitted request is preempted (its
                  blocks freed, restarted later), as in vLLM
Figures are taken over the steps while the queue is non-empty (steady state): waste =
1 - tokens held / slots reserved, summed over those steps; concurrency = mean running
requests, which is also tokens generated per step.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

MAX_MODEL_LEN = 2048
PROMPT_MEAN, OUTPUT_MEAN, SIGMA = 161.0, 338.0, 1.0


@dataclass
class Result:
    strategy: str
    waste: float
    concurrency: float
    preemptions: int


def sample_requests(n: int, seed: int) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs; lognormal mu chosen so the mean matches."""
    rng = random.Random(seed)

    def draw(mean: float) -> int:
        return max(1, round(rng.lognormvariate(math.log(mean) - SIGMA**2 / 2, SIGMA)))

    out = []
    for _ in range(n):
        prompt = min(draw(PROMPT_MEAN), MAX_MODEL_LEN - 1)
        out.append((prompt, min(draw(OUTPUT_MEAN), MAX_MODEL_LEN - prompt)))
    return out


def simulate_reserved(requests: list[tuple[int, int]], budget: int, name: str) -> Result:
    """Contiguous reservation: a request holds its full reservation from admission to finish."""
    def reserve(p: int, o: int) -> int:
        return MAX_MODEL_LEN if name == "reserve-max" else 1 << (p + o - 1).bit_length()

    queue = list(reversed(requests))
    running: list[list[int]] = []  # [tokens held, tokens left to generate, reserved]
    free, held_sum, reserved_sum, running_sum, steps = budget, 0, 0, 0, 0
    while queue:
        while queue and reserve(*queue[-1]) <= free:
            p, o = queue.pop()
            free -= reserve(p, o)
            running.append([p, o, reserve(p, o)])
        if not running:
            raise ValueError("budget too small for a single request")
        held_sum += sum(r[0] for r in running)
        reserved_sum += budget - free
        running_sum += len(running)
        steps += 1
        for r in running:
            r[0] += 1
            r[1] -= 1
        free += sum(r[2] for r in running if r[1] == 0)
        running = [r for r in running if r[1] > 0]
    return Result(name, 1 - held_sum / reserved_sum, running_sum / steps, 0)


def simulate_paged(requests: list[tuple[int, int]], budget: int, block: int) -> Result:
    """Paged: blocks on demand; preempt the newest request when a step cannot grow."""
    queue = list(reversed(requests))
    running: list[list[int]] = []  # [tokens held, tokens left, blocks held, (p, o)]
    free = budget // block
    held_sum = reserved_blocks_sum = running_sum = steps = preemptions = 0
    while queue:
        while queue and -(-queue[-1][0] // block) <= free:
            p, o = queue.pop()
            free -= -(-p // block)
            running.append([p, o, -(-p // block), (p, o)])
        if not running:
            raise ValueError("budget too small for a single request")
        held_sum += sum(r[0] for r in running)
        reserved_blocks_sum += budget // block - free
        running_sum += len(running)
        steps += 1
        i = 0
        while i < len(running):
            r = running[i]
            if r[0] + 1 > r[2] * block:  # the next token needs a new block
                while free == 0 and running[-1] is not r:
                    victim = running.pop()
                    free += victim[2]
                    queue.append(victim[3])
                    preemptions += 1
                if free == 0:  # r is itself the newest: preempt it
                    running.pop()
                    free += r[2]
                    queue.append(r[3])
                    preemptions += 1
                    break
                free -= 1
                r[2] += 1
            r[0] += 1
            r[1] -= 1
            i += 1
        free += sum(r[2] for r in running if r[1] == 0)
        running = [r for r in running if r[1] > 0]
    waste = 1 - held_sum / (reserved_blocks_sum * block)
    return Result(f"paged-{block}", waste, running_sum / steps, preemptions)


def plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.strategy for r in results]
    colors = ["tab:red" if n.startswith("reserve") else "tab:blue" for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(names, [100 * r.waste for r in results], color=colors)
    ax1.set_ylabel("reserved KV slots holding no token (%)")
    ax1.set_title("KV memory waste")
    ax2.bar(names, [r.concurrency for r in results], color=colors)
    ax2.set_ylabel("mean concurrent requests")
    ax2.set_title("Requests that fit in the same KV budget")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"ShareGPT-like lognormal lengths (means {PROMPT_MEAN:.0f}/{OUTPUT_MEAN:.0f}, "
                 f"sigma {SIGMA}), max_model_len {MAX_MODEL_LEN}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--budget-tokens", type=int, default=65536,
                        help="KV slots available (e.g. ~26 GB of a 13B model's KV)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="write a PNG here")
    args = parser.parse_args()
    reqs = sample_requests(args.num_requests, args.seed)
    mean_p = sum(p for p, _ in reqs) / len(reqs)
    mean_o = sum(o for _, o in reqs) / len(reqs)
    results = [simulate_reserved(reqs, args.budget_tokens, "reserve-max"),
               simulate_reserved(reqs, args.budget_tokens, "reserve-pow2")]
    results += [simulate_paged(reqs, args.budget_tokens, b) for b in (8, 16, 32, 128)]
    print(f"{len(reqs)} requests, sampled mean prompt {mean_p:.0f}, output {mean_o:.0f}; "
          f"budget {args.budget_tokens} KV slots; max_model_len {MAX_MODEL_LEN}\n")
    print("| strategy | slots holding no token | slots used | mean concurrent requests "
          "| preemptions |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r.strategy} | {100 * r.waste:.1f}% | {100 * (1 - r.waste):.1f}% "
              f"| {r.concurrency:.1f} | {r.preemptions} |")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
