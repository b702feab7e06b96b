"""How a step's SchedulerOutput reaches the tensor-parallel ranks: ZeroMQ (what the executor
does) against torch.distributed's broadcast_object_list, on the CPU, one run.

    PYTHONPATH=. python benchmarks/step_fanout.py [--ranks 2] [--steps 2000]

The message is a steady-state decode step of 256 requests (ids, counts, a new block for one
in 16). ZeroMQ: the engine encodes it once with msgspec and sends it to each rank's DEALER
over TCP loopback; each rank decodes it and answers one byte, and the time is to the last
answer. broadcast_object_list: the engine is rank 0 of a gloo group of 1 + ranks (it would
have to be a member), pickles the message and broadcasts it, each rank unpickles it, and a
barrier stands for the answer. Prints microseconds per step for each (median of 5 blocks).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import msgspec

from pagedserve.messages import CachedRequestData, SchedulerOutput, decode, encode


def decode_step(batch: int = 256) -> SchedulerOutput:
    ids = [f"cmpl-{i:06d}-0" for i in range(batch)]
    cached = CachedRequestData()
    for i in range(0, batch, 16):
        cached.append(ids[i], False, [1000 + i])
    return SchedulerOutput(req_ids=ids, num_scheduled_tokens=[1] * batch,
                           num_computed_tokens=[600 + i for i in range(batch)],
                           samples=[True] * batch, num_decodes=batch,
                           total_num_scheduled_tokens=batch, scheduled_cached_reqs=cached)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def zmq_rank(rank: int, address: str, steps: int) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"rank%d" % rank)
    sock.connect(address)
    sock.send(b"hello")
    for _ in range(steps):
        decode(sock.recv(), SchedulerOutput)
        sock.send(b"k")


def time_zmq(ranks: int, steps: int) -> list[float]:
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    procs = [mp.Process(target=zmq_rank, args=(r, f"tcp://127.0.0.1:{port}", steps))
             for r in range(ranks)]
    for p in procs:
        p.start()
    for _ in range(ranks):
        sock.recv_multipart()
    message, times = decode_step(), []
    for _ in range(steps):
        t0 = time.perf_counter()
        payload = encode(message)
        for r in range(ranks):
            sock.send_multipart([b"rank%d" % r, payload], copy=False)
        for _ in range(ranks):
            sock.recv_multipart()
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join()
    return times


def dist_rank(rank: int, size: int, port: int, steps: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    message, times = decode_step(), []
    for _ in range(steps):
        t0 = time.perf_counter()
        box = [message if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def time_broadcast(ranks: int, steps: int) -> list[float]:
    out = mp.Queue()
    port = free_port()
    procs = [mp.Process(target=dist_rank, args=(r, ranks + 1, port, steps, out))
             for r in range(ranks + 1)]
    for p in procs:
        p.start()
    times = out.get()
    for p in procs:
        p.join()
    return times


def summary(times: list[float]) -> float:
    blocks = [times[i::5] for i in range(5)]
    return round(statistics.median(statistics.mean(b) for b in blocks) * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    mp.set_start_method("spawn")
    size = len(msgspec.msgpack.encode(decode_step()))
    print(f"message: {size} bytes (msgpack)")
    print(f"zeromq + msgspec:       {summary(time_zmq(args.ranks, args.steps))} us/step")
    print(f"broadcast_object_list:  {summary(time_broadcast(args.ranks, args.steps))} us/step")


if __name__ == "__main__":
    main()
