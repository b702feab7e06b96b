"""KV-cache events for subscribers: what the prefix cache gained and lost, step by step.

A router that sends each prompt to the replica already caching its prefix needs to know what
every replica caches. With an endpoint set (`EngineConfig.kv_events_endpoint`), the block
pool records its events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) and the engine
publishes them after each step that produced any, as one batch on a ZeroMQ PUB socket;
with a host tier its own stored / removed events follow (`medium` "host", see `host_tier`).
This lives with the block pool, so it runs in whichever process runs the engine core.

Wire format: each batch is a multipart message of three frames: the topic (bytes), a
sequence number (8 bytes, big-endian, from 0, per publisher: a gap means the subscriber
missed batches, e.g. past the socket's high-water mark, and should resynchronize), and a
msgpack `KVEventBatch` whose events are tagged by their class name. Block hashes are the
engine's own (bytes); replicas that must agree on them share `prefix_caching_hash_seed`.
`decode_batch` reads a payload back.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import msgspec
import zmq

from pagedserve.kv_cache.block_pool import KVCacheEvent

DEFAULT_TOPIC = "kv-events"
SEND_HWM = 100_000  # batches queued for slow subscribers before ZeroMQ drops new ones


class KVEventBatch(msgspec.Struct, frozen=True):
    ts: float  # time.time() when the batch was published
    events: list[KVCacheEvent]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from the third frame of a published message."""
    return _DECODER.decode(payload)


class KVEventPublisher:
    """Binds a PUB socket at `endpoint` (e.g. "tcp://*:5557", "ipc:///tmp/kv") and sends
    each non-empty list of events as one batch. Sending never blocks the engine: ZeroMQ
    queues for slow subscribers and drops past the high-water mark."""

    def __init__(self, endpoint: str, topic: str = DEFAULT_TOPIC) -> None:
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close()
            raise ValueError(f"cannot publish KV events on {endpoint!r}: {exc}") from None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._seq = 0
        self._closer = weakref.finalize(self, self._socket.close)

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        if not events:
            return
        payload = _ENCODER.encode(KVEventBatch(time.time(), list(events)))
        self._socket.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def close(self) -> None:
        self._closer()
