"""A tensor-parallel worker: one rank's ModelRunner, driven by the engine core's calls.

The engine starts one per rank on its own host (`executor.MultiprocExecutor`). Across hosts,
torchrun starts them and they join the group by env:// rendezvous, while the engine, started
on its own with `--tensor-parallel-address`, waits for them to connect:

    # the engine (its host needs the tokenizer and config.json, not a GPU)
    pagedserve serve --model /models/m --tensor-parallel-size 16 \\
        --tensor-parallel-address tcp://*:5600
    # on each of the two GPU hosts, node rank 0 and 1
    torchrun --nnodes 2 --node-rank $NODE --nproc-per-node 8 \\
        --master-addr $HOST0 --master-port 29500 \\
        -m pagedserve.device.worker --engine tcp://$ENGINE_HOST:5600

Each rank loads its own shard of `--model` (the path must exist on every host), on GPU
LOCAL_RANK. Set NCCL_NVLS_ENABLE=0 (and the others in `executor.WORKER_ENV`) in torchrun's
environment; the engine sets them for the workers it starts.

The worker answers the set-up calls (load, profile, initialize) and makes the runner's
calls of every step in the order they come (see executor.py for why `collect` is a call).
Its first failure is reported to the engine as a traceback, then it exits. A watchdog
thread ends the process when the engine is gone (its connection drops, or, for a worker the
engine started, the engine's process is no longer its parent), so no worker outlives it.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import threading
import traceback
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from pagedserve import ipc
from pagedserve.config import EngineConfig
from pagedserve.device import step_profile
from pagedserve.device.executor import (
    rank_identity, set_heartbeat, dtype_name, initialize_runner, total_memory, weight_bytes)
from pagedserve.device.loading import load_on_device, resolve_device
from pagedserve.device.model_runner import ModelRunner, PendingRunnerOutput, StepHandle
from pagedserve.messages import (
    CollectedOutput, CollectOutput, KVCacheSpec, LoadWeights, ProfileMemory, ProfileStopped,
    SampleTokens, SchedulerOutput, ShutdownWorker, StartProfile, StopProfile, ToWorker,
    WorkerBlocks, WorkerBye, WorkerFailure, WorkerHello, WorkerInitialized, WorkerLoaded)
from pagedserve.model import parallel
from pagedserve.structured.manager import GrammarOutput

STORE_TIMEOUT_S = 60.0  # connecting to the engine's store, which is up before we start


class Worker:
    def __init__(self, rank: int, size: int, local_rank: int, init_method: str,
                 channel: ipc.Channel, stopping: threading.Event,
                 store_address: str | None = None) -> None:
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self.init_method = init_method
        self.store_address = store_address  # the engine's open TCPStore, tcp://HOST:PORT
        self.channel = channel
        self.stopping = stopping  # set once told to stop
        self.runner: ModelRunner | None = None
        # the engine's calls in its order: launched steps until sampled, sampled steps until
        # collected
        self.launched: collections.deque[StepHandle] = collections.deque()
        self.pending: collections.deque[PendingRunnerOutput] = collections.deque()
        self.answered = False  # rank 0: the oldest pending step's output is sent already
        self.step_profile: step_profile.StepProfile | None = None  # rank 0's (`load`)
        self.handlers = {LoadWeights: self.load, ProfileMemory: self.profile,
                         KVCacheSpec: self.initialize, SchedulerOutput: self.execute_model,
                         SampleTokens: self.sample_tokens, CollectOutput: self.collect,
                         StartProfile: self.start_profile, StopProfile: self.stop_profile}

    def serve(self) -> None:
        """Handle calls until told to stop."""
        while True:
            message = self.channel.receive()
            if isinstance(message, ShutdownWorker):
                self.stopping.set()
                self.channel.send(WorkerBye())
                return
            self.handlers[type(message)](message)

    # -- set-up ---------------------------------------------------------------------------

    def load(self, message: LoadWeights) -> None:
        config = message.config
        self.device = device = self.rank_device(config)
        if self.rank == 0:  # the one rank that traces (see start_profile)
            self.step_profile = step_profile.StepProfile(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # the ranks share the host's cores: a full thread pool per rank (torch's default)
        # oversubscribes them, and a GPU rank's host work between launches waits on it
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.size))
        parallel.init_tensor_parallel(
            self.rank, self.size, device, self.init_method, store=self.join_store(),
            peer_all_reduce_max_bytes=config.peer_all_reduce_max_bytes,
            fuse_all_reduce_norm=config.fuse_all_reduce_norm,
            fuse_two_shot_all_reduce_norm=config.fuse_two_shot_all_reduce_norm,
            all_reduce_push=config.all_reduce_push)
        torch.manual_seed(config.seed)  # unseeded sampling draws alike on every rank
        self.model, self.model_config, _ = load_on_device(config, device)
        self.channel.send(WorkerLoaded(
            device.type, total_memory(device), weight_bytes(self.model),
            dtype_name(self.model.embed_tokens.weight.dtype), self.model.quantization))

    def join_store(self) -> dist.TCPStore | None:
        """A client of the store the engine holds open (workers it spawned), else None (the
        group joins by `init_method`, as under torchrun). A port that rank 0 would bind for
        the rendezvous, probed free by the engine seconds before, could be taken in between
        (a clash seen when two engines started at once on one host); the engine's store holds
        its port from the start."""
        if self.store_address is None:
            return None
        host, port = self.store_address.removeprefix("tcp://").rsplit(":", 1)
        return dist.TCPStore(host, int(port), is_master=False,
                             timeout=timedelta(seconds=STORE_TIMEOUT_S))

    def rank_device(self, config: EngineConfig) -> torch.device:
        """GPU local_rank when the engine's device is CUDA (whatever index it names), else
        the CPU."""
        device = resolve_device(config.device.split(":")[0])
        if device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    def profile(self, message: ProfileMemory) -> None:
        self.runner = ModelRunner(message.config, self.model, self.model_config, self.device)
        num_blocks = self.runner.determine_num_blocks()
        self.channel.send(WorkerBlocks(num_blocks, self.runner.block_bytes,
                                       dtype_name(self.runner.kv_cache_dtype)))

    def initialize(self, spec: KVCacheSpec) -> None:
        self.channel.send(WorkerInitialized(initialize_runner(self.runner, spec)))

    # -- steps ----------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Launch a step; the placeholders' tokens are the latest sampled step's (a step
        in flight is sampled before the next one is launched, as in the engine's process).
        Rank 0 first answers the oldest uncollected step if its tokens are already on the
        host: the engine's `collect` of it comes after this step's calls, and the engine's
        work on those tokens (its outputs, the next schedule) then runs beside this step's
        host work instead of after it. The device has finished that step, so it waits on
        the host either way; the runner's calls keep their order."""
        if self.rank == 0 and self.pending and not self.answered:
            early = self.pending[0].output_if_ready()
            if early is not None:
                self.channel.send(CollectedOutput(early))
                self.answered = True
        prepared = self.runner.prepare_step(scheduler_output)
        latest = self.pending[-1] if self.pending else None
        self.launched.append(self.runner.launch(prepared, latest))

    def sample_tokens(self, sample: SampleTokens) -> None:
        message, grammar = sample.grammar, None
        if message is not None:
            bitmask = np.frombuffer(message.bitmask, dtype=np.int32)
            grammar = GrammarOutput(message.req_ids,
                                    bitmask.reshape(-1, message.num_words).copy())
        self.pending.append(self.runner.sample_tokens(self.launched.popleft(), grammar))

    def collect(self, _: CollectOutput) -> None:
        output = self.pending.popleft().result()
        if self.rank == 0 and not self.answered:
            self.channel.send(CollectedOutput(output))
        self.answered = False

    # -- profiling (rank 0 alone traces: the ranks run the same kernels) ------------------

    def start_profile(self, _: StartProfile) -> None:
        if self.step_profile is not None:
            self.step_profile.start()

    def stop_profile(self, message: StopProfile) -> None:
        if self.step_profile is not None:
            self.step_profile.stop(message.trace_path)
        self.channel.send(ProfileStopped())


def _watch(monitor: zmq.Socket, parent_pid: int | None, stopping: threading.Event) -> None:
    """End this process when the engine is gone (unless it told us to stop: then it goes
    away as we do); runs in a daemon thread."""
    while True:
        if monitor.poll(1000):
            event = recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED and not stopping.is_set():
                os._exit(1)
        if ipc.parent_gone(parent_pid):
            os._exit(1)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(description="A pagedserve tensor-parallel worker (one "
                                     "rank). Under torchrun the rank and size come from its "
                                     "environment and the group joins by env://.")
    parser.add_argument("--engine", required=True, help="the engine's address, tcp://HOST:PORT")
    parser.add_argument("--rank", type=int, default=int(env.get("RANK", -1)))
    parser.add_argument("--size", type=int, default=int(env.get("WORLD_SIZE", -1)))
    parser.add_argument("--local-rank", type=int, default=int(env.get("LOCAL_RANK", -1)))
    parser.add_argument("--init-method", default="env://",
                        help="torch.distributed rendezvous (default: env://, as torchrun sets)")
    parser.add_argument("--store", default=None,
                        help="join the group through the engine's open TCPStore, "
                             "tcp://HOST:PORT, instead of --init-method")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is no longer the parent")
    args = parser.parse_args(argv)
    if args.rank < 0 or args.size < 1:
        parser.error("--rank and --size (or torchrun's RANK and WORLD_SIZE) are required")
    if args.local_rank < 0:
        args.local_rank = args.rank
    return args


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    if args.parent_pid is not None:  # Ctrl-C is the engine's to handle: it stops us
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, rank_identity(args.rank))
    set_heartbeat(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    stopping = threading.Event()
    threading.Thread(target=_watch, args=(monitor, args.parent_pid, stopping),
                     daemon=True).start()
    sock.connect(args.engine)
    channel = ipc.Channel(sock, ToWorker)
    channel.send(WorkerHello(args.rank, args.size, os.getpid(), socket.gethostname()))
    worker = Worker(args.rank, args.size, args.local_rank, args.init_method, channel, stopping,
                    args.store)
    try:
        worker.serve()
    except BaseException:  # noqa: BLE001 - whatever it was, the engine must hear of it
        channel.send(WorkerFailure(args.rank, traceback.format_exc()))
        sock.close(linger=2000)  # let the report leave
        os._exit(1)  # a collective may be stuck: no teardown
    sock.close()
    # no destroy_process_group: after CUDA graphs captured NCCL calls it can hang; the
    # process's exit releases the communicator
    os._exit(0)


if __name__ == "__main__":
    main()
