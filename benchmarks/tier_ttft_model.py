"""The multiturn workload's TTFT with and without the host tier, modelled on the CPU: the real
scheduler, pool, host tier and recall rule (of whatever tree is on PYTHONPATH), driven as
benchmarks/multiturn.py drives an engine with async scheduling, each step timed by a cost
model instead of a GPU. A model, not a measurement: it splits a turn's TTFT into its parts
and shows what a scheduling change moves; the GPU run decides.

    PYTHONPATH=. python benchmarks/tier_ttft_model.py --device-blocks 3181

The cost model (defaults: the Llama-3-8B shape on the H100, from the figures logged there,
docs/benchmarks.md): a step's device time is a base (a one-row decode step) plus the KV its
rows read (per context token) plus its prefill (per token, and per token per context token);
a step with a prefill chunk runs eagerly, and its launch costs the host `--eager-host-ms`
(the start-up's one-token eager pass, host-bound); a decode-only step replays a graph. The
host launches step k while the device runs step k - 1 and then waits for it (async
scheduling), a step's tier copies adding their host time to its launch; a turn due while a
call runs is handed to the engine when the call returns (`noticed`). The copy stream runs a
step's offloads, then its recall, after the step before has ended on the device, at
`--block-copy-us` a block; a recall that lands for the next step holds that step's start,
one that lands layer by layer holds the end of the step that queues it (its last layer
computes after its copy)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

# this folder holds kernels.py, which would shadow the `kernels` package transformers probes for
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.recall_rule import RecallRule  # noqa: E402
from pagedserve.engine.request import Request  # noqa: E402
from pagedserve.engine.scheduler import Scheduler  # noqa: E402
from pagedserve.kv_cache.host_tier import HostTier  # noqa: E402
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager  # noqa: E402
from pagedserve.messages import ModelRunnerOutput, TierCosts  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402


def step_ms(args, out, scheduler) -> tuple[float, float]:
    """(device ms, host launch ms) of a scheduled step."""
    device, eager = args.base_ms, False
    new_ids = {new.req_id for new in out.scheduled_new_reqs}
    for req_id, start, n in zip(out.req_ids, out.num_computed_tokens, out.num_scheduled_tokens):
        device += args.ctx_read_us * 1e-3 * (start + n)
        if n > 1 or req_id in new_ids:
            eager = True
            device += args.prefill_us * 1e-3 * n
            device += args.context_ns * 1e-6 * ((start + n) ** 2 - start ** 2)
    host = args.eager_host_ms if eager else args.graph_host_ms
    host += args.offload_host_ms * bool(out.blocks_to_offload)
    return device, host + args.recall_host_ms * bool(out.blocks_to_recall)


def simulate(args, tier: bool, layerwise: bool) -> dict:
    rng = random.Random(args.seed)
    manager = KVCacheManager(args.device_blocks, 16, record_evictions=tier)
    config = EngineConfig(block_size=16, max_num_seqs=256, max_num_batched_tokens=16384)
    costs = TierCosts(args.block_copy_us * 1e-6, args.prefill_us * 1e-6, args.context_ns * 1e-9,
                      args.step_floor_ms * 1e-3, 0, 0)
    scheduler = Scheduler(config, manager, 8192,
                          host_tier=HostTier(args.host_slots) if tier else None,
                          recall_rule=RecallRule(costs, 16, 8192) if tier else None)
    vocab = 128_000
    groups = -(-args.conversations // 8)
    systems = [[rng.randrange(vocab) for _ in range(2000)] for _ in range(groups)]
    users = [[[rng.randrange(vocab) for _ in range(100)] for _ in range(8)]
             for _ in range(args.conversations)]
    thinks = [[rng.uniform(5, 30) * args.time_scale * 1e3 for _ in range(8)]  # ms
              for _ in range(args.conversations)]
    history = [list(systems[i // 8]) for i in range(args.conversations)]
    due = [rng.uniform(0, thinks[i][0]) for i in range(args.conversations)]
    turn = [0] * args.conversations
    owner: dict[str, int] = {}
    arrived: dict[str, tuple[float, float, str]] = {}  # due, noticed, kind
    kinds: dict[str, str] = {}
    recalled_of: dict[str, int] = {}
    original_recall = scheduler._recall

    def recall(request, slots, num_hit, out):
        recalled_of[request.request_id] = len(slots)
        original_recall(request, slots, num_hit, out)

    scheduler._recall = recall
    ttft: list[tuple[float, float, str]] = []
    now = 0.0  # the host: when the next call starts
    device_end = [0.0, 0.0]  # ends of the last two steps launched
    copy_free = 0.0
    in_flight = None  # (out, sampled requests) of the step launched last
    hold_next = 0.0  # a recall that lands for the next step holds its start
    steps = 0
    while owner or any(t < 8 for t in turn) or in_flight is not None:
        for i in range(args.conversations):
            if turn[i] < 8 and i not in owner.values() and due[i] <= now:
                rid = f"c{i}t{turn[i]}"
                prompt = history[i] + users[i][turn[i]]
                params = SamplingParams(max_tokens=200, ignore_eos=True)
                scheduler.add_request(Request(rid, prompt, params, 200))
                owner[rid], arrived[rid] = i, (due[i], now, "")
        out = scheduler.schedule() if scheduler.has_unfinished_requests() else None
        launched = None
        if out is not None and out.req_ids:
            for new in out.scheduled_new_reqs:  # by what its prefill is past its hits
                missed = len(new.prompt_token_ids) - new.num_computed_tokens
                kinds[new.req_id] = ("recall" if new.req_id in recalled_of
                                     else "device hit" if missed <= 320 else "miss")
            device, host = step_ms(args, out, scheduler)
            start = max(device_end[1], now + min(host, 1.0), hold_next)
            hold_next = 0.0
            copy_start = max(copy_free, device_end[1])
            copy_end = copy_start + args.block_copy_us * 1e-3 * (
                len(out.blocks_to_offload) + len(out.blocks_to_recall))
            copy_free = copy_end
            end = max(start + device, now + host)
            if out.blocks_to_recall:
                if layerwise:
                    end = max(end, copy_end + device / 32)
                else:
                    hold_next = copy_end
            device_end = [device_end[1], end]
            sampled = [r for r, s in zip(out.req_ids, out.samples) if s]
            launched = (out, [scheduler.requests[r] for r in sampled], end)
            steps += 1
        elif out is not None:
            scheduler.update_from_output(out, ModelRunnerOutput([], []))
        launch_done = now + (step_ms(args, out, scheduler)[1] if launched else 0.0)
        if in_flight is None:
            now = launch_done if launched else now + 1.0  # idle: the loop sleeps
        else:
            prev_out, requests, prev_end = in_flight
            now = max(launch_done, prev_end)
            scheduler.update_from_output(
                prev_out, ModelRunnerOutput([r.request_id for r in requests], [7] * len(requests)))
            for request in requests:
                rid = request.request_id
                if request.num_output_tokens == 1 and rid in arrived:
                    d, noticed, _ = arrived.pop(rid)
                    ttft.append((now - d, now - noticed, kinds.get(rid, "?")))
                if request.is_finished:
                    i = owner.pop(rid)
                    history[i] = list(request.all_token_ids)
                    due[i] = now + thinks[i][turn[i]]
                    turn[i] += 1
        in_flight = launched
        if launched is None and in_flight is None and not scheduler.has_unfinished_requests():
            pending = [due[i] for i in range(args.conversations)
                       if turn[i] < 8 and i not in owner.values()]
            if pending:
                now = max(now, min(pending))
    by_kind: dict[str, list[float]] = {}
    for due_ms, _, kind in ttft:
        by_kind.setdefault(kind, []).append(due_ms)
    return {"tier": "host" if tier else "off",
            "recall": ("layerwise, same step" if layerwise else "lands for the next step")
            if tier else None,
            "steps": steps, "turns": len(ttft),
            "ttft_p50_ms": round(statistics.median(t for t, _, _ in ttft), 1),
            "ttft_noticed_p50_ms": round(statistics.median(t for _, t, _ in ttft), 1),
            "by_kind": {k: {"turns": len(v), "p50_ms": round(statistics.median(v), 1)}
                        for k, v in sorted(by_kind.items())},
            "recalled_blocks": scheduler.num_blocks_recalled,
            "declined_blocks": scheduler.num_recalls_declined}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-blocks", type=int, default=3181)
    parser.add_argument("--host-slots", type=int, default=12288)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=0.3)
    parser.add_argument("--base-ms", type=float, default=5.7, help="a one-row decode step")
    parser.add_argument("--ctx-read-us", type=float, default=0.045,
                        help="a context token's KV read (128 KiB at ~2.9 TB/s)")
    parser.add_argument("--prefill-us", type=float, default=20.27, help="a prefilled token")
    parser.add_argument("--context-ns", type=float, default=0.762,
                        help="a prefilled token per context token")
    parser.add_argument("--eager-host-ms", type=float, default=12.0,
                        help="the host's launch of an eager step")
    parser.add_argument("--graph-host-ms", type=float, default=1.0)
    parser.add_argument("--block-copy-us", type=float, default=45.0)
    parser.add_argument("--offload-host-ms", type=float, default=0.0,
                        help="the runner's host time queuing a step's offload")
    parser.add_argument("--recall-host-ms", type=float, default=0.0,
                        help="the runner's host time queuing a step's recall")
    parser.add_argument("--step-floor-ms", type=float, default=5.7,
                        help="the recall rule's step_s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layerwise", choices=("yes", "no"), default="yes",
                        help="how the tree on PYTHONPATH lands a recall: yes, layer by layer in "
                        "the step that queues it (this tree); no, for the next step (trees "
                        "before it, whose scheduler computes the request a step later)")
    args = parser.parse_args()
    print(json.dumps(simulate(args, tier=False, layerwise=False)), flush=True)
    print(json.dumps(simulate(args, tier=True, layerwise=args.layerwise == "yes")), flush=True)


if __name__ == "__main__":
    main()
