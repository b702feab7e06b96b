"""A subscriber's view of KV events, written from vLLM's published schema
(vllm/distributed/kv_events.py: tagged, array-encoded msgspec structs) and nothing of
pagedserve's: if these decode what the engine publishes, routers built for vLLM do too."""

from __future__ import annotations

import msgspec
import zmq


class Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(Event):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def receive(sub: zmq.Socket, wait_ms: int = 500) -> list[tuple[int, KVEventBatch]]:
    """Every batch published so far on a SUB socket, as (sequence number, batch)."""
    batches = []
    while sub.poll(wait_ms):
        _topic, seq, payload = sub.recv_multipart()
        batches.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return batches


def replay(endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    """Ask a replay socket for the batches from `start` on, as vLLM's subscribers do."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        batches = []
        while dealer.poll(5000):
            _empty, seq, payload = dealer.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                return batches
            batches.append((number, DECODER.decode(payload)))
        raise TimeoutError("the replay socket did not finish its answer")
    finally:
        dealer.close()
