"""The host tier's copies (`device/tier_copies.py`) on their CUDA path, run here over CPU
tensors with the copy stream and its events as host stand-ins (as
benchmarks/tier_copies_host.py does): every block goes to and from its own place, bit for
bit, in the layer-major host slots; a recall's per-layer events are recorded after that
layer's blocks have landed and before the next layer's copies; a slot's bytes, as the disk
tier writes them, are every layer's K and V in layer order."""

from __future__ import annotations

import pytest
import torch

from benchmarks.tier_copies_host import HostEvent, HostStream, HostStreamContext
from pagedserve.device.tier_copies import TierCopies

LAYERS, BLOCKS, SLOTS = 3, 24, 16


class Recorder(HostStream):
    """A stream and the events recorded on it; an event keeps what `snapshot` returned when
    it was recorded."""

    def __init__(self, snapshot) -> None:
        self.snapshot = snapshot
        self.waited: list = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


@pytest.fixture
def host_streams(monkeypatch):
    """torch.cuda's streams and events as host stand-ins; the stream returned records the
    compute stream's waits."""
    state = {"snapshot": lambda: None}
    compute = Recorder(None)

    class Event(HostEvent):
        def __init__(self, *args, **kwargs) -> None:
            self.seen = None

        def record(self, *args) -> None:
            self.seen = state["snapshot"]()

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", HostStreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: compute)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    return state, compute


def copies_on_the_cuda_path(dtype=torch.bfloat16):
    """Random caches of LAYERS layers (V of another shape than K, as a drafter's layer may
    be), and their TierCopies taking its CUDA path (a copy stream) over CPU tensors."""
    gen = torch.Generator().manual_seed(3)
    caches = [(torch.randn((BLOCKS, 4, 2, 8), generator=gen).to(dtype),
               torch.randn((BLOCKS, 4, 1, 8), generator=gen).to(dtype)) for _ in range(LAYERS)]
    copies = TierCopies(caches, SLOTS, torch.device("cpu"), backend=None)
    copies._stream = Recorder(None)
    return caches, copies


def test_offload_then_recall_move_every_block_to_its_place(host_streams):
    caches, copies = copies_on_the_cuda_path()
    before = [(k.clone(), v.clone()) for k, v in caches]
    offloads = [(10, 7), (11, 6), (12, 5), (13, 4), (2, 12)]  # a tail into ascending slots
    copies.offload(offloads)
    for (k, v), (host_k, host_v) in zip(before, copies.host_caches):
        for block, slot in offloads:
            assert torch.equal(host_k[slot], k[block]) and torch.equal(host_v[slot], v[block])
    recalls = [(7, 20), (6, 21), (5, 22), (4, 23), (12, 1)]  # the chain again, chain order
    copies.recall(recalls)
    for (k, v), (k_before, v_before) in zip(caches, before):
        assert torch.equal(k[20:24], k_before[10:14]) and torch.equal(v[20:24], v_before[10:14])
        assert torch.equal(k[1], k_before[2]) and torch.equal(v[1], v_before[2])
        assert torch.equal(k[:1], k_before[:1]) and torch.equal(k[2:20], k_before[2:20])


def test_a_recall_lands_layer_by_layer_and_is_awaited_whole_once(host_streams):
    state, compute = host_streams
    caches, copies = copies_on_the_cuda_path()
    for (k, v), (host_k, host_v) in zip(caches, copies.host_caches):
        host_k[3:6].normal_()
        host_v[3:6].normal_()
    pairs = [(5, 9), (4, 8), (3, 7)]

    def landed() -> list[bool]:
        return [all(torch.equal(k[block], host_k[slot]) and torch.equal(v[block], host_v[slot])
                    for slot, block in pairs)
                for (k, v), (host_k, host_v) in zip(caches, copies.host_caches)]

    state["snapshot"] = landed
    assert copies.layer_waits() is None
    copies.recall(pairs)
    events = copies._layer_landed
    # layer n's event: its blocks are in place, the later layers' not yet
    assert [event.seen for event in events] == [[n <= i for n in range(LAYERS)]
                                                for i in range(LAYERS)]
    wait = copies.layer_waits()
    assert wait is not None
    for layer in range(LAYERS):
        wait(layer)
    wait(LAYERS)  # a layer past the recalled caches (a drafter's): nothing to wait for
    assert compute.waited == events
    copies.await_recalls()  # after the forward pass: the whole recall, once
    assert compute.waited[-1].seen == [True] * LAYERS
    assert copies.layer_waits() is None
    copies.await_recalls()
    assert len(compute.waited) == LAYERS + 1


def test_a_slot_row_is_every_layer_k_and_v_in_layer_order(host_streams):
    """The disk tier's bytes: the same order as the block-major rows before the layer-major
    slots, so files written before read back the same."""
    caches, copies = copies_on_the_cuda_path(torch.float32)
    copies.offload([(5, 2)])
    row = copies.slot_row(2)
    expected = torch.cat([c[5].reshape(-1).view(torch.uint8) for layer in caches for c in layer])
    assert torch.equal(row, expected) and row.numel() == copies.slot_bytes
    copies.fill_slot(9, row)
    assert all(torch.equal(k[9], k[2]) and torch.equal(v[9], v[2]) for k, v in copies.host_caches)
