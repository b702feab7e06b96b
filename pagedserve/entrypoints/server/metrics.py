"""Prometheus metrics of the server: engine state, token counters and request latencies.

Engine-wide numbers (queue lengths, KV usage, prefix-cache and token totals) are owned by the
engine; the AsyncEngine hands us a fresh `EngineStats` snapshot after every step and a
custom collector exposes the latest one at scrape time, so the HTTP side never touches the
engine. Latency histograms are observed once per finished request from the event loop's own
monotonic clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "pagedserve_"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                 5.0)


@dataclass
class RequestTiming:
    """Seconds from arrival at the server; TPOT is the mean gap after the first token."""

    ttft: float | None
    e2e: float
    num_output_tokens: int

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.num_output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)


class _EngineStatsCollector:
    """Exposes the latest engine snapshot; counters are the engine's running totals."""

    _GAUGES = (
        ("num_requests_running", "num_running", "Requests in the running batch."),
        ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
        ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV blocks held by requests "
         "(1 = full); cached blocks nobody holds do not count."),
    )
    _COUNTERS = (
        ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix "
         "cache, each prompt once (as first admitted, however long it waited)."),
        ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
        ("prefix_cache_evictions", "prefix_cache_evictions", "Cached KV blocks evicted "
         "(reused for other content) since start."),
        ("num_preemptions", "num_preemptions", "Requests preempted to free KV blocks."),
        ("swapped_out_blocks", "num_blocks_swapped_out", "KV blocks copied to CPU memory by "
         "preemption (--preemption-mode swap)."),
        ("swapped_in_blocks", "num_blocks_swapped_in", "KV blocks copied back from CPU memory "
         "for resumption."),
        ("host_tier_hit_blocks", "host_tier_hits", "KV blocks the prefix cache recalled from "
         "its host tier (--kv-offload-memory)."),
        ("host_tier_stored_blocks", "host_tier_stores", "Evicted KV blocks copied into the "
         "host tier."),
        ("host_tier_evicted_blocks", "host_tier_evictions", "KV blocks dropped from the host "
         "tier to make room (to the disk tier, if there is one)."),
        ("host_tier_declined_blocks", "host_tier_declined", "KV blocks found in the host tier "
         "but recomputed: the recall rule measured at start-up found that faster."),
        ("disk_tier_hit_blocks", "disk_tier_hits", "KV blocks read back whole from the disk "
         "tier (--kv-offload-path) into the host tier, to be recalled from there."),
        ("disk_tier_stored_blocks", "disk_tier_stores", "KV blocks the host tier dropped, "
         "written to the disk tier."),
        ("disk_tier_evicted_blocks", "disk_tier_evictions", "KV blocks dropped from the disk "
         "tier to make room (their files reused)."),
        ("disk_tier_load_failures", "disk_tier_load_failures", "Disk-tier files that did not "
         "read back whole (checksum, truncation): a miss, the block recomputed."),
        ("kv_tier_copy_seconds", "tier_copy_seconds", "Time the runner spent queuing the "
         "tiers' block copies and in their file I/O."),
        ("kv_tier_stream_seconds", "tier_stream_seconds", "Time the copy stream spent in the "
         "host tier's block copies (CUDA events; overlapped with the steps)."),
        ("kv_tier_recall_pass_overs", "tier_recall_pass_overs", "Waiting requests passed over "
         "in a step because blocks of their prefix hit were still being recalled."),
        ("kv_tier_offload_steps", "tier_offload_steps", "Steps that copied blocks the device "
         "pool evicted into the host tier (the copies are queued on the step's host path)."),
        ("spec_decode_num_drafts", "spec_num_drafts", "Speculative verifies (a request's "
         "drafts checked in one step)."),
        ("spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Draft tokens proposed."),
        ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Draft tokens "
         "accepted."),
        ("engine_steps", "num_steps", "Core steps that launched a forward pass."),
        ("decode_graph_steps", "num_decode_graph_steps", "Steps that replayed a CUDA graph "
         "of decodes (the others ran eagerly: a prefill chunk, mixed query lengths, the CPU)."),
        ("prompt_tokens", "prompt_tokens_total", "Prompt tokens processed."),
        ("generation_tokens", "generation_tokens_total", "Tokens generated."),
    )

    def __init__(self) -> None:
        self.stats: Any = None

    def collect(self) -> Iterable[Metric]:
        stats = self.stats
        for name, attr, doc in self._GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=_get(stats, attr))
        for name, attr, doc in self._COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc, value=_get(stats, attr))
        block_bytes = _get(stats, "kv_block_bytes")
        for tier in ("host", "disk"):
            for kind, attr in (("hit", "hits"), ("stored", "stores")):
                yield CounterMetricFamily(
                    f"{PREFIX}{tier}_tier_{kind}_bytes", f"Bytes of the {tier} tier's "
                    f"{kind} KV blocks (one rank's share).",
                    value=block_bytes * _get(stats, f"{tier}_tier_{attr}"))
        queries = _get(stats, "prefix_cache_queries")
        yield GaugeMetricFamily(
            PREFIX + "prefix_cache_hit_rate", "Fraction of prompt tokens looked up in the "
            "prefix cache that were found there, since start (0 before any lookup).",
            value=_get(stats, "prefix_cache_hits") / queries if queries else 0.0)
        yield from _spec_metrics(stats)


def _spec_metrics(stats: Any) -> Iterable[Metric]:
    """Speculative decoding's acceptance: per draft position, and the mean tokens a verify
    emits (its accepted drafts and the one it samples; 0 before any verify)."""
    per_position = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each "
        "position of a draft (0: its first token).", labels=["position"])
    for position, count in enumerate(getattr(stats, "spec_accepted_per_position", None) or []):
        per_position.add_metric([str(position)], count)
    yield per_position
    drafts = _get(stats, "spec_num_drafts")
    yield GaugeMetricFamily(
        PREFIX + "spec_decode_mean_accepted_length", "Tokens a speculative verify emits on "
        "average, since start (its accepted drafts and the token it samples).",
        value=1 + _get(stats, "spec_num_accepted_tokens") / drafts if drafts else 0.0)


def _get(stats: Any, attr: str) -> float:
    return float(getattr(stats, attr, 0) or 0) if stats is not None else 0.0


class ServerMetrics:
    """One registry per server (not the global one), so tests can run several servers."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engine = _EngineStatsCollector()
        self.registry.register(self._engine)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time between output tokens after the first.",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter(PREFIX + "request_finished", "Requests finished, by reason "
                                "(error: the engine core could not compile its grammar).",
                                ["finish_reason"], registry=self.registry)
        self.rejected = Counter(
            PREFIX + "request_rejected", "Requests refused by a server limit before they ran: "
            "unauthorized, queue_full, grammar (too large, too slow to compile), grammar_busy, "
            "timeout (the deadline passed while its grammar compiled).", ["reason"],
            registry=self.registry)
        self.lora_requests = Counter(PREFIX + "lora_requests", "Requests submitted under "
                                     "each LoRA adapter.", ["lora_name"], registry=self.registry)

    def watch_grammar_compiles(self, running: Callable[[], int],
                               waiting: Callable[[], int]) -> None:
        """Gauges read at scrape time: grammar compiles on a thread, and queued for one."""
        Gauge(PREFIX + "grammar_compiles_running", "Grammar compiles running on the server's "
              "compile threads.", registry=self.registry).set_function(running)
        Gauge(PREFIX + "grammar_compiles_waiting", "Grammar compiles waiting for a compile "
              "thread.", registry=self.registry).set_function(waiting)

    def update_engine_stats(self, stats: Any) -> None:
        """Called once per core step; a plain reference swap, read at scrape time."""
        self._engine.stats = stats

    def observe_request(self, timing: RequestTiming, finish_reason: str) -> None:
        self.finished.labels(finish_reason=finish_reason).inc()
        if finish_reason in ("abort", "timeout", "error"):
            return  # an aborted request's latency says nothing about serving speed
        if timing.ttft is not None:
            self.ttft.observe(timing.ttft)
        if timing.tpot is not None:
            self.tpot.observe(timing.tpot)
        self.e2e.observe(timing.e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
