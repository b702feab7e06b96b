"""The multiturn workload (benchmarks/multiturn.py) through the scheduler alone, with no
model: where the host tier's time can go, measured on the CPU. A step's sampled token is
made up; the users' think times are counted in steps. Per run (tier off, tier on): the
steps and their mean batch, the prompt tokens prefilled, the blocks offloaded and
recalled, the copy runs a recall takes (runs of consecutive host slots, in the chain's
order and in slot order: each run is one copy per layer's K and V on CUDA), the requests
passed over while their hit lands, and the scheduler's host time per step.

    python benchmarks/tier_sim.py --device-blocks 585 --tier-slots 14000

With a recall rule's costs (--block-copy-us and the rest, as the engine logs them at
start-up) the tier run recalls only what the rule accepts; each run also gives the device
pool's hits (each prompt counted once, as admitted) and evictions, and the last line says
whether the two runs scheduled the same batches step for step (a rule that declines every
hit must leave the device pool as without the tier):

    python benchmarks/tier_sim.py --device-blocks 2340 --think-min 500 --think-max 3000 \
        --block-copy-us 39.6 --prefill-block-us 30.5 --context-ns 0.356 --step-ms 18.95 \
        --max-model-len 40960
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from pagedserve.attention.backend import consecutive_runs  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.recall_rule import RecallRule  # noqa: E402
from pagedserve.engine.request import Request  # noqa: E402
from pagedserve.engine.scheduler import Scheduler  # noqa: E402
from pagedserve.kv_cache.host_tier import HostTier  # noqa: E402
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager  # noqa: E402
from pagedserve.messages import ModelRunnerOutput, TierCosts  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402


def recall_rule(args: argparse.Namespace) -> RecallRule | None:
    """The rule over the given costs (None: every hit is recalled)."""
    if args.block_copy_us is None:
        return None
    bs = args.block_size
    costs = TierCosts(args.block_copy_us * 1e-6, args.prefill_block_us * 1e-6 / bs,
                      args.context_ns * 1e-9, args.step_ms * 1e-3, 0, 0)
    return RecallRule(costs, bs, args.max_model_len)


def simulate(args: argparse.Namespace, tier_slots: int) -> tuple[dict, list[tuple]]:
    """A run's figures and its schedule (per step: the batch and each chunk's size)."""
    rng = random.Random(args.seed)
    manager = KVCacheManager(args.device_blocks, args.block_size,
                             record_evictions=bool(tier_slots))
    config = EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    scheduler = Scheduler(config, manager, args.max_model_len,
                          host_tier=HostTier(tier_slots) if tier_slots else None,
                          recall_rule=recall_rule(args) if tier_slots else None)
    schedule = []
    systems = [[rng.randrange(1, args.vocab) for _ in range(args.system_tokens)]
               for _ in range(-(-args.conversations // args.group))]
    history = [list(systems[i // args.group]) for i in range(args.conversations)]
    turn = [0] * args.conversations
    arrival_step = [rng.randint(0, args.think_max) for _ in range(args.conversations)]
    owner: dict[str, int] = {}
    arrived: dict[str, int] = {}
    ttft, host_s = [], []
    steps = batch = prefill = offloaded = recalled = chain_runs = slot_runs = 0
    offload_steps = admitting_offload_steps = 0  # steps with offloads; of them, admitting
    while owner or any(t < args.turns for t in turn):
        for i in range(args.conversations):
            if turn[i] < args.turns and i not in owner.values() and arrival_step[i] <= steps:
                request_id = f"c{i}t{turn[i]}"
                prompt = history[i] + [rng.randrange(1, args.vocab)
                                       for _ in range(args.user_tokens)]
                params = SamplingParams(max_tokens=args.answer_tokens, ignore_eos=True)
                scheduler.add_request(Request(request_id, prompt, params, args.answer_tokens))
                owner[request_id], arrived[request_id] = i, steps
        start = time.perf_counter()
        out = scheduler.schedule()
        host_s.append(time.perf_counter() - start)
        schedule.append((tuple(out.req_ids), tuple(out.num_scheduled_tokens)))
        offloaded += len(out.blocks_to_offload)
        offload_steps += bool(out.blocks_to_offload)
        admitting_offload_steps += bool(out.blocks_to_offload and out.scheduled_new_reqs)
        slots = [slot for slot, _ in out.blocks_to_recall]
        recalled += len(slots)
        chain_runs += len(consecutive_runs(slots)) if slots else 0
        slot_runs += len(consecutive_runs(sorted(slots))) if slots else 0
        prefill += sum(n for n in out.num_scheduled_tokens if n > 1)
        batch += len(out.req_ids)
        sampled = [r for r, s in zip(out.req_ids, out.samples) if s]
        requests = [scheduler.requests[r] for r in sampled]
        scheduler.update_from_output(out, ModelRunnerOutput(sampled, [7] * len(sampled)))
        for request in requests:
            if request.num_output_tokens == 1:
                ttft.append(steps - arrived.pop(request.request_id))
            if request.is_finished:
                i = owner.pop(request.request_id)
                history[i] = list(request.all_token_ids)
                turn[i] += 1
                arrival_step[i] = steps + rng.randint(args.think_min, args.think_max)
        steps += 1
    ttft.sort()
    stats = manager.prefix_cache_stats
    return {"tier_slots": tier_slots, "device_blocks": args.device_blocks, "steps": steps,
            "prompt_tokens": stats.queries, "device_hit_tokens": stats.hits,
            "device_hit_rate": round(stats.hit_rate, 4),
            "device_evictions": manager.block_pool.num_evictions,
            "declined_blocks": scheduler.num_recalls_declined,
            "mean_batch": round(batch / steps, 2), "prefill_tokens": prefill,
            "offloaded_blocks": offloaded, "offload_steps": offload_steps,
            "admitting_offload_steps": admitting_offload_steps, "recalled_blocks": recalled,
            "recall_runs_chain_order": chain_runs, "recall_runs_slot_order": slot_runs,
            "recall_pass_overs": scheduler.num_recall_pass_overs,
            "ttft_steps_p50": ttft[len(ttft) // 2],
            "ttft_steps_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "schedule_ms_per_step": round(1e3 * statistics.mean(host_s), 4),
            "schedule_ms_max": round(1e3 * max(host_s), 2)}, schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-blocks", type=int, default=585)
    parser.add_argument("--tier-slots", type=int, default=14000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--user-tokens", type=int, default=100)
    parser.add_argument("--answer-tokens", type=int, default=200)
    parser.add_argument("--think-min", type=int, default=25, help="steps")
    parser.add_argument("--think-max", type=int, default=150, help="steps")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=1 << 20)
    parser.add_argument("--block-copy-us", type=float, default=None,
                        help="the recall rule's copy of a block (default: no rule)")
    parser.add_argument("--prefill-block-us", type=float, default=0.0)
    parser.add_argument("--context-ns", type=float, default=0.0,
                        help="prefill, a token per context token")
    parser.add_argument("--step-ms", type=float, default=0.0)
    args = parser.parse_args()
    schedules = []
    for slots in (0, args.tier_slots):
        row, schedule = simulate(args, slots)
        print(json.dumps(row), flush=True)
        schedules.append(schedule)
    first = next((i for i, (a, b) in enumerate(zip(*schedules)) if a != b), None)
    same = first is None and len(schedules[0]) == len(schedules[1])
    print(json.dumps({"same_schedule_every_step": same, "first_different_step": first}))


if __name__ == "__main__":
    main()
