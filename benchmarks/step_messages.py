"""The engine <-> ranks messages of one pipelined decode step, through the executor's own
channels (`ipc.RouterChannel` to `ipc.Channel`), no model: what tensor parallelism adds to a
step's host path over one process.

    PYTHONPATH=. python benchmarks/step_messages.py [--ranks 4] [--steps 3000] [--transport tcp]

Per step the engine sends a one-request decode `SchedulerOutput`, `SampleTokens` and
`CollectOutput` to every rank (as `MultiprocExecutor` does), and waits for rank 0's
`CollectedOutput`; each rank decodes every message, rank 0 answers the collect. Prints the
median over the steps (the first 200 left out) of the engine's sends and of the whole round
trip, in microseconds. `--transport ipc` runs the same over a Unix socket instead of TCP
loopback (the executor's).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import zmq

WARMUP = 200


def rank_loop(address: str, rank: int) -> None:
    from pagedserve import ipc
    from pagedserve.device.executor import rank_identity
    from pagedserve.messages import (
        CollectedOutput, CollectOutput, ModelRunnerOutput, ShutdownWorker, ToWorker)

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, rank_identity(rank))
    sock.connect(address)
    channel = ipc.Channel(sock, ToWorker)
    sock.send(b"")  # hello
    answer = CollectedOutput(ModelRunnerOutput(["cmpl-0"], [123]))
    while True:
        message = channel.receive()
        if isinstance(message, ShutdownWorker):
            break
        if isinstance(message, CollectOutput) and rank == 0:
            channel.send(answer)
    sock.close()
    context.term()


def measure(ranks: int, steps: int, transport: str) -> dict:
    from pagedserve import ipc
    from pagedserve.device.executor import rank_identity
    from pagedserve.messages import (
        CollectOutput, FromWorker, SampleTokens, SchedulerOutput, ShutdownWorker)

    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    folder = tempfile.TemporaryDirectory()
    if transport == "ipc":
        address = f"ipc://{Path(folder.name) / 'engine'}"
        sock.bind(address)
    else:
        address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    procs = [mp.get_context("spawn").Process(target=rank_loop, args=(address, r))
             for r in range(ranks)]
    for proc in procs:
        proc.start()
    for _ in procs:
        sock.recv_multipart()
    channel = ipc.RouterChannel(sock, FromWorker)
    identities = [rank_identity(r) for r in range(ranks)]
    step = SchedulerOutput(req_ids=["cmpl-0"], num_scheduled_tokens=[1],
                           num_computed_tokens=[200], samples=[True], num_decodes=1,
                           total_num_scheduled_tokens=1)
    sends, trips = [], []
    for _ in range(steps):
        start = time.perf_counter_ns()
        channel.send_to(identities, step)
        channel.send_to(identities, SampleTokens())
        channel.send_to(identities, CollectOutput())
        sent = time.perf_counter_ns()
        channel.receive_from()
        trips.append(time.perf_counter_ns() - start)
        sends.append(sent - start)
    channel.send_to(identities, ShutdownWorker())
    for proc in procs:
        proc.join()
    sock.close()
    context.term()
    folder.cleanup()
    return {"ranks": ranks, "transport": transport,
            "sends_us": round(statistics.median(sends[WARMUP:]) / 1e3, 1),
            "round_trip_us": round(statistics.median(trips[WARMUP:]) / 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    args = parser.parse_args()
    print(measure(args.ranks, args.steps, args.transport))


if __name__ == "__main__":
    main()
