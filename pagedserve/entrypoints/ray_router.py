"""Ray Serve's request router for pagedserve replicas: a request goes to the replica that
caches the longest prefix of its prompt, the least loaded of those first.

What each replica caches is read from its own KV events (vLLM's schema, `kv_cache.events`):
every replica reports its PUB and replay endpoints in its routing stats; the router
subscribes, and before each decision applies the batches that arrived (a gap in the
sequence numbers, e.g. a subscription made after the replica's first batches, is filled
from the replay socket). A request carries the external hashes of its prompt's full blocks
(`block_hashes`, computed by the ingress with the fleet's shared hash seed), so the match is
a walk along the chain: the number of leading hashes the replica holds. A request just
routed counts as cached on its replica at once (the events confirm or correct it), so a
burst sharing a prefix does not scatter before the first event arrives.

The answer is every replica in order of preference, one per rank: longest match first,
then the least loaded (the requests in flight Ray Serve last saw), then the smallest cache,
so prompts that match nowhere spread their prefixes over the fleet instead of piling onto
one replica. Ray Serve sends the request to the first with room, so a full replica passes
it on.
`routing="round_robin"` ignores the prompt (the baseline the benchmark compares against).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import msgspec
import zmq
from ray.serve.request_router import (PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

from pagedserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, \
    KVEventBatch
from pagedserve.kv_cache.kv_events import DEFAULT_TOPIC, END_OF_REPLAY

logger = logging.getLogger("ray.serve")

ROUTINGS = ("prefix", "round_robin")
REPLAY_TIMEOUT_MS = 2000
ROUTED_LIMIT = 100_000  # hashes per replica counted as cached before its events say so
# no module-level decoder: Ray Serve pickles the router class by value with its globals


@dataclass
class ReplicaCache:
    """What one replica caches, as its events tell (by medium) and as routed since."""

    events: str
    replay: str | None
    held: dict[str, set[int]] = field(default_factory=dict)  # medium -> hashes
    routed: dict[int, None] = field(default_factory=dict)  # sent here, not yet confirmed;
    # oldest first, at most ROUTED_LIMIT (a request aborted before its blocks were cached
    # never gets its confirmation)
    last_seq: int = -1
    socket: zmq.Socket | None = None

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.held.setdefault(event.medium or "", set()).update(event.block_hashes)
                for block_hash in event.block_hashes:
                    self.routed.pop(block_hash, None)
            elif isinstance(event, BlockRemoved):
                self.held.get(event.medium or "", set()).difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.held.clear()
                self.routed.clear()

    def subscribe(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, DEFAULT_TOPIC.encode())
        self.socket.connect(self.events)

    def read(self) -> None:
        """Apply the batches that arrived; a gap in their numbers is filled by replay."""
        while self.socket is not None and self.socket.poll(0):
            _topic, seq_bytes, payload = self.socket.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1:
                self._replay(self.last_seq + 1, seq)
            self.apply(msgspec.msgpack.decode(payload, type=KVEventBatch))
            self.last_seq = seq

    def _replay(self, start: int, stop: int) -> None:
        """Batches start .. stop - 1 from the replica's replay socket (what it still keeps)."""
        if self.replay is None:
            logger.warning("missed KV event batches %d-%d of %s (no replay endpoint)", start,
                           stop - 1, self.events)
            return
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(REPLAY_TIMEOUT_MS):
                _empty, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == END_OF_REPLAY:
                    return
                if start <= int.from_bytes(seq_bytes, "big") < stop:
                    self.apply(msgspec.msgpack.decode(payload, type=KVEventBatch))
            logger.warning("KV event replay from %s timed out", self.replay)
        finally:
            dealer.close()

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)

    def add_routed(self, hashes: list[int]) -> None:
        self.routed.update(dict.fromkeys(hashes))
        for stale in list(itertools.islice(self.routed, max(0, len(self.routed) - ROUTED_LIMIT))):
            del self.routed[stale]

    def size(self) -> int:
        return len(self.routed) + sum(len(held) for held in self.held.values())

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of the chain this replica holds (in any tier)."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self.routed and not any(
                    block_hash in held for held in self.held.values()):
                break
            count += 1
        return count


class PrefixAwareRouter(RequestRouter):
    """The request router (Ray Serve's custom request router API); see the module doc."""

    def initialize_state(self, routing: str = "prefix") -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        self._routing = routing
        self._caches: dict[ReplicaID, ReplicaCache] = {}
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if self._routing == "round_robin":
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            start = next(self._turn) % len(ordered)
            return [[r] for r in ordered[start:] + ordered[:start]]
        hashes = _hashes(pending_request)
        if not hashes:
            return [candidate_replicas]
        self._read_events(candidate_replicas)
        def preference(replica: RunningReplica) -> tuple[int, int, int]:
            cache = self._caches.get(replica.replica_id)
            match, size = (cache.match(hashes), cache.size()) if cache else (0, 0)
            load = self.replica_queue_len_cache.get(replica.replica_id) or 0
            return -match, load, size

        return [[r] for r in sorted(candidate_replicas, key=preference)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        cache = self._caches.get(replica_id)
        hashes = _hashes(pending_request)
        if cache is not None and hashes:
            cache.add_routed(hashes)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for replica_id in set(self._caches) - {r.replica_id for r in replicas}:
            self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        cache = self._caches.pop(replica_id, None)
        if cache is not None:
            cache.close()

    def _read_events(self, replicas: list[RunningReplica]) -> None:
        for replica in replicas:
            self._subscribed(replica).read()

    def _subscribed(self, replica: RunningReplica) -> ReplicaCache:
        """The replica's cache view, subscribed to its events once it has reported them."""
        cache = self._caches.get(replica.replica_id)
        stats = replica.routing_stats or {}
        if cache is None:
            cache = self._caches[replica.replica_id] = ReplicaCache(
                stats.get("kv_events", ""), stats.get("kv_replay"))
        if cache.socket is None and stats.get("kv_events"):
            cache.events, cache.replay = stats["kv_events"], stats.get("kv_replay")
            cache.subscribe()
        return cache


def _hashes(pending_request: PendingRequest | None) -> list[int]:
    if pending_request is None:
        return []
    return list(pending_request.kwargs.get("block_hashes") or ())
