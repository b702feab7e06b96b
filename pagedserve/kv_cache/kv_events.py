"""KV-cache events for subscribers: what the prefix cache gained and lost, step by step.

A router that sends each prompt to the replica already caching its prefix needs to know what
every replica caches. With an endpoint set (`EngineConfig.kv_events_endpoint`), the block
pool records its events and the engine publishes them after each step that produced any, as
one `KVEventBatch` (the schema: `kv_cache.events`, vLLM's) on a ZeroMQ PUB socket; with a
host tier its own events follow (medium "CPU"). This lives with the block pool, so it runs in
whichever process runs the engine core.

Wire protocol (vLLM's, so its subscribers work unchanged): each batch is a multipart message
of three frames: the topic, a sequence number (8 bytes, big-endian, from 0, per publisher),
and the msgpack batch. A gap in the numbers means the subscriber missed batches (past the
socket's high-water mark, or connected late); with a replay endpoint
(`kv_events_replay_endpoint`) it asks a ROUTER socket for them: a DEALER (or REQ) sends an
empty frame and the first wanted number (8 bytes, big-endian); the answer is one message
[empty, number, batch] per kept batch from there on, then [empty, -1 (signed), empty]. The
last `REPLAY_BATCHES` batches are kept. Replay is served on a thread of its own, so a
subscriber catching up never waits for the engine's next step.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from pagedserve.kv_cache.events import KVCacheEvent, KVEventBatch

DEFAULT_TOPIC = "kv-events"
SEND_HWM = 100_000  # batches queued for slow subscribers before ZeroMQ drops new ones
REPLAY_BATCHES = 10_000  # batches kept for replay
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from the third frame of a published message."""
    return _DECODER.decode(payload)


def _bound(kind: int, endpoint: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as exc:
        socket.close()
        raise ValueError(f"cannot publish KV events on {endpoint!r}: {exc}") from None
    return socket


class _Replay:
    """The ROUTER socket and its thread: answers replay requests from the kept batches."""

    def __init__(self, endpoint: str, kept: deque[tuple[int, bytes]], lock: threading.Lock):
        self._socket = _bound(zmq.ROUTER, endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._kept, self._lock = kept, lock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-events-replay",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(100):
                self._answer(self._socket.recv_multipart())
        self._socket.close()

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not [identity, empty, 8-byte number]: nothing to answer
        client, start = frames[0], int.from_bytes(frames[2], "big")
        with self._lock:
            batches = [(seq, payload) for seq, payload in self._kept if seq >= start]
        for seq, payload in batches:
            self._socket.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._socket.send_multipart([client, b"", END_OF_REPLAY, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class KVEventPublisher:
    """Binds a PUB socket at `endpoint` (e.g. "tcp://*:5557", "ipc:///tmp/kv"), and a
    replay ROUTER socket at `replay_endpoint` if given, and sends each non-empty list of
    events as one batch. Sending never blocks the engine: ZeroMQ queues for slow
    subscribers and drops past the high-water mark (replay recovers what was dropped)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = DEFAULT_TOPIC, data_parallel_rank: int = 0) -> None:
        self._socket = _bound(zmq.PUB, endpoint)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._seq = 0
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._lock = threading.Lock()
        self._replay = None
        if replay_endpoint is not None:
            try:
                self._replay = _Replay(replay_endpoint, self._kept, self._lock)
            except ValueError:
                self._socket.close()
                raise
        self.replay_endpoint = self._replay.endpoint if self._replay is not None else None
        self._closer = weakref.finalize(self, _close, self._socket, self._replay)

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        if not events:
            return
        payload = _ENCODER.encode(KVEventBatch(time.time(), list(events), self._rank))
        seq = self._seq.to_bytes(8, "big")
        if self._replay is not None:
            with self._lock:
                self._kept.append((self._seq, payload))
        self._socket.send_multipart([self._topic, seq, payload])
        self._seq += 1

    def close(self) -> None:
        self._closer()


def _close(socket: zmq.Socket, replay: _Replay | None) -> None:
    if replay is not None:
        replay.close()
    socket.close()
