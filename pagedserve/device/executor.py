"""Executors: how the engine core runs model steps, on one device or on a tensor-parallel group.

The engine core schedules once and drives an executor with two verbs, values in and out:
`execute_model(scheduler_output, previous)` queues a step's forward pass and returns its
handle; `sample_tokens(handle, grammar)` queues its sampling (under the step's grammar
bitmask, if it has constrained rows) and returns a pending output, whose `result()` the core
calls later. So async scheduling keeps its shape: launch step N+1, then collect step N.
`previous` is the step in flight (`InFlightStep`), whose sampled tokens are the new step's
placeholders; if it still awaits its bitmask, `execute_model` samples it first, once the new
step's host work is done (the grammar work overlaps that host work).

- `UniprocExecutor` (tensor_parallel_size 1): the ModelRunner in this process.
- `MultiprocExecutor`: one worker process per rank (`worker.py`), each with a ModelRunner over
  its shard of the weights and its KV heads. The scheduler and the KV cache manager stay
  here, so every rank gets the same block tables and slot mapping.

Transport (multiprocess): one ZeroMQ ROUTER socket here, one DEALER per worker (its identity
is its rank), each side an `ipc.Channel` of tagged msgspec Structs (`messages.ToWorker`,
`messages.FromWorker`). Each call is encoded once and sent to every rank. A step's calls
(`SchedulerOutput`, `SampleTokens`) get no answer: a worker keeps the handles of its launched
steps in order and samples the oldest at each `SampleTokens`; `result()` sends
`CollectOutput`, on which every rank hands its sampled tokens to its own requests and rank 0
alone sends them back.
Collect is a call of its own so that each rank makes its runner's calls in exactly the
core's order (launch N+1, then take in N's tokens), as the in-process runner does; a rank
that ran ahead would count its requests' tokens differently. Rank 0 may send N's output
before it is asked, when N's tokens are on the host as N+1 arrives (`worker.py`): the core's
`collect` then finds the answer waiting, and its work on N overlaps the ranks' on N+1.

Why ZeroMQ and not a torch.distributed broadcast of the step: the engine core is then no rank
of the group (it needs no device, and it may run on a host without GPUs, or inside the
server), a send never waits for the ranks (a broadcast returns once every rank has joined
it, and on NCCL stages the bytes through each GPU on the stream the forward pass runs on),
and the collective group carries the model's all-reduces alone.

Sampling is done on every rank: each gathers the full logits and samples with the same
generators (seeded alike, called alike), then takes rank 0's tokens (one broadcast of the
token ids), so every rank holds the same tokens on its device, which it needs for the next
step's placeholder rows; rank 0's are reported. Plain rows (greedy, temperature) gather only
each row's split winners from every rank's vocabulary slice and need no broadcast
(`ModelRunner.vocab_shard`).

Faults: while it waits, the executor watches the workers it started (their exit codes) and
the socket's disconnections (any worker's, torchrun's included). A rank that raises sends
its traceback first. Either way the executor stops every worker and raises
`ExecutorError`; later calls raise it again at once. Workers watch the engine in turn
(`worker.py`) and exit when it is gone.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import zmq
from zmq.utils.monitor import recv_monitor_message

from pagedserve import ipc
from pagedserve.config import EngineConfig
from pagedserve.device import drafter, step_profile
from pagedserve.device.model_runner import ModelRunner, StepHandle
from pagedserve.messages import (
    CollectedOutput, CollectOutput, FromWorker, GrammarBitmask, KVCacheSpec, LoadWeights,
    ModelRunnerOutput, ProfileMemory, ProfileStopped, SampleTokens, SchedulerOutput,
    ShutdownWorker, StartProfile, StopProfile, TierCosts, WorkerBlocks, WorkerBye,
    WorkerFailure, WorkerHello, WorkerInitialized, WorkerLoaded)
from pagedserve.model import parallel
from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import Decoder
from pagedserve.structured.manager import GrammarOutput

logger = logging.getLogger(__name__)

# NVLink SHARP / multicast buffers: GPU memory per communicator, and hangs on some hosts.
WORKER_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
              "NVSHMEM_DISABLE_NVLS": "1"}
HELLO_TIMEOUT_S = 300.0  # workers import torch and connect; torchrun's may start later
POLL_MS = 200  # how often a wait looks at the workers' liveness
STOP_TIMEOUT_S = 10.0  # a worker told to stop gets this long before it is killed
HEARTBEAT_MS = (2000, 10000)  # ZeroMQ heartbeat interval, and silence that drops the peer


class ExecutorError(RuntimeError):
    """The tensor-parallel workers failed (a rank raised, died or never started)."""


class PendingOutput(Protocol):
    def result(self) -> ModelRunnerOutput: ...


@dataclass(frozen=True)
class InFlightStep:
    """A launched step whose tokens have not been read yet: the value the engine's pipelined
    loop hands from one step to the next (`EngineCore.step_pipelined`)."""

    scheduler_output: SchedulerOutput
    step: Any  # the executor's handle of its queued forward pass
    tokens: PendingOutput | None = None  # its sampling; None while it awaits its bitmask
    bitmask: Callable[[], GrammarOutput | None] | None = None  # then: waits for the bitmask

    @property
    def awaits_bitmask(self) -> bool:
        return self.tokens is None


class Executor(ABC):
    """What the engine core needs of whatever runs the model: set-up in three calls
    (`memory_info` for the batch limits, `determine_num_blocks`, `initialize`), then steps."""

    model_config: ModelConfig
    device_type: str  # "cuda" | "cpu"
    device_name: str  # for people: "cuda:0", or "cuda x 2 (tensor parallel)"
    dtype: str  # the weights' and activations' type, e.g. "bfloat16"
    kv_cache_dtype: str  # the KV cache's element type, e.g. "bfloat16"
    quantization: str | None  # of the weights
    block_bytes: int  # one KV block on one rank, all layers (known after determine_num_blocks)

    @abstractmethod
    def memory_info(self) -> tuple[int | None, int]:
        """(the device's total memory, None on the CPU; the bytes of one rank's weights)."""

    @abstractmethod
    def determine_num_blocks(self, config: EngineConfig) -> int:
        """Build the runner(s) with `config` (batch limits resolved) and return how many KV
        blocks fit; with several ranks, the smallest rank's count."""

    @abstractmethod
    def initialize(self, spec: KVCacheSpec) -> TierCosts | None:
        """Allocate the KV cache (and swap space), set up step buffers and CUDA graphs.
        With a host tier, returns what the recall rule weighs (`engine/recall_rule.py`):
        the slowest rank's copy and prefill costs, as the slowest rank paces a step."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput,
                      previous: InFlightStep | None = None) -> tuple[Any, InFlightStep | None]:
        """Queue the step's forward pass after `previous` (the step in flight, if any: its
        sampled tokens fill this step's placeholders). Returns the step's handle for
        `sample_tokens`, and `previous` with its sampling queued: a step awaiting its bitmask
        is sampled here, after this step's host work and before its forward pass."""

    @abstractmethod
    def sample_tokens(self, step: Any, grammar: GrammarOutput | None = None) -> PendingOutput:
        """Queue the sampling of a step `execute_model` launched (steps are sampled in launch
        order), under `grammar`'s bitmask rows if given."""

    def sample_awaiting(self, step: InFlightStep) -> InFlightStep:
        """`step`, sampled: if it awaits its bitmask, sampled now under it."""
        if not step.awaits_bitmask:
            return step
        return replace(step, tokens=self.sample_tokens(step.step, step.bitmask()),
                       bitmask=None)

    @abstractmethod
    def start_profile(self) -> None:
        """Trace the steps that follow (device/step_profile.py): this process's runner, or
        rank 0's."""

    @abstractmethod
    def stop_profile(self, trace_path: str) -> None:
        """Stop tracing once the steps launched so far have run; write the Chrome trace to
        `trace_path` (nothing if no trace was started). Returns once it is written."""

    def check_health(self) -> None:
        """Raise if the executor can no longer run steps (a worker has died); for an idle
        engine, which would otherwise find out only at its next step."""

    def shutdown(self) -> None:
        """Release what the executor holds outside this process (its workers)."""


def weight_bytes(model: Decoder) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def total_memory(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def initialize_runner(runner: ModelRunner, spec: KVCacheSpec) -> TierCosts | None:
    """The runner's set-up once the KV cache is sized, the same on every rank; with a host
    tier, what its recall rule weighs, measured on this rank."""
    runner.initialize_kv_cache(spec.num_blocks)
    if runner.config.preemption_mode == "swap":
        runner.initialize_swap_space(spec.num_cpu_blocks)
    if spec.num_host_tier_blocks:
        runner.initialize_host_tier(spec.num_host_tier_blocks)
    if spec.disk_tier_dir is not None:
        runner.initialize_disk_tier(spec.disk_tier_dir, spec.disk_tier_digest)
    runner.setup(spec.max_model_len)
    if not spec.num_host_tier_blocks:
        return None
    return runner.measure_tier_costs(spec.max_model_len)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class UniprocExecutor(Executor):
    """The ModelRunner in this process, over weights that engines may share."""

    def __init__(self, model: Decoder, model_config: ModelConfig) -> None:
        self.model = model
        self.model_config = model_config
        self.device = next(model.parameters()).device
        self.device_type = self.device.type
        self.device_name = str(self.device)
        self.dtype = dtype_name(model.embed_tokens.weight.dtype)
        self.quantization = model.quantization
        self.model_runner: ModelRunner | None = None
        self.step_profile = step_profile.StepProfile(self.device)

    def memory_info(self) -> tuple[int | None, int]:
        return total_memory(self.device), weight_bytes(self.model)

    def determine_num_blocks(self, config: EngineConfig) -> int:
        self.model_runner = runner = ModelRunner(config, self.model, self.model_config,
                                                 self.device)
        self.block_bytes = runner.block_bytes
        self.kv_cache_dtype = dtype_name(runner.kv_cache_dtype)
        return runner.determine_num_blocks()

    def initialize(self, spec: KVCacheSpec) -> TierCosts | None:
        return initialize_runner(self.model_runner, spec)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      previous: InFlightStep | None = None
                      ) -> tuple[StepHandle, InFlightStep | None]:
        runner = self.model_runner
        prepared = runner.prepare_step(scheduler_output)
        if previous is not None:
            previous = self.sample_awaiting(previous)
        step = runner.launch(prepared, previous.tokens if previous is not None else None)
        return step, previous

    def sample_tokens(self, step: StepHandle,
                      grammar: GrammarOutput | None = None) -> PendingOutput:
        return self.model_runner.sample_tokens(step, grammar)

    def start_profile(self) -> None:
        self.step_profile.start()

    def stop_profile(self, trace_path: str) -> None:
        self.step_profile.stop(trace_path)


class RemoteStep:
    """A step launched on the workers, which keep its handle until it is sampled."""


class RemotePendingOutput:
    """A step sampled on the workers; `result()` collects its tokens (in launch order)."""

    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        self._executor, self._seq = executor, seq

    def result(self) -> ModelRunnerOutput:
        return self._executor.collect(self._seq)


class MultiprocExecutor(Executor):
    """One worker process per rank, started here (`tensor_parallel_address` None) or by
    torchrun elsewhere, connecting to that address."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.size = config.tensor_parallel_size
        self.model_config = model_config
        parallel.check_shardable(model_config, self.size)  # before any worker starts
        drafter.check_shardable(config.speculative_config, self.size)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone rank raises
        set_heartbeat(self._socket)
        self._channel = ipc.RouterChannel(self._socket, FromWorker)
        self._ranks = [rank_identity(rank) for rank in range(self.size)]
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._procs: list[subprocess.Popen] = []
        self._stop = weakref.finalize(self, _stop_workers, self._context, self._channel,
                                      self._procs, self._ranks)
        self._error: str | None = None
        self._launched = self._collected = 0  # steps sampled, steps collected
        self._store: dist.TCPStore | None = None  # the spawned workers' rendezvous (`_spawn`)
        try:
            if config.tensor_parallel_address is None:
                port = self._socket.bind_to_random_port("tcp://127.0.0.1")
                self._spawn(f"tcp://127.0.0.1:{port}", config)
            else:
                self._socket.bind(config.tensor_parallel_address)
                logger.info("waiting for %d tensor-parallel workers at %s", self.size,
                            config.tensor_parallel_address)
            self._await_hellos()
            loaded = self._call(LoadWeights(config), WorkerLoaded)
        except BaseException:
            self.shutdown()
            raise
        self.device_type = loaded[0].device_type
        self.device_name = f"{self.device_type} x {self.size} (tensor parallel)"
        self.dtype = loaded[0].dtype
        self.quantization = loaded[0].quantization
        memories = [r.total_memory for r in loaded if r.total_memory is not None]
        self._memory = (min(memories) if memories else None,
                        max(r.weight_bytes for r in loaded))

    # -- set-up ---------------------------------------------------------------------------

    def _spawn(self, address: str, config: EngineConfig) -> None:
        """Start one worker per rank on this host; they connect to `address` and join the
        group through a TCPStore this process holds open (`self._store`: its port bound
        here, by the OS, before any worker starts; a port probed free and bound by rank 0
        later could be taken in between)."""
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        env = worker_env()
        for rank in range(self.size):
            cmd = ipc.module_command(
                "pagedserve.device.worker", "--engine", address, "--rank", str(rank),
                "--size", str(self.size), "--local-rank", str(rank),
                "--store", f"tcp://127.0.0.1:{self._store.port}",
                "--parent-pid", str(os.getpid()))
            self._procs.append(subprocess.Popen(cmd, env=env))

    def _await_hellos(self) -> None:
        ranks: set[int] = set()
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while len(ranks) < self.size:
            rank, hello = self._receive(deadline)
            if not isinstance(hello, WorkerHello):
                self._fail(f"rank {rank} sent {type(hello).__name__} before its hello")
            if hello.size != self.size or hello.rank != rank:
                self._fail(f"worker {hello.rank} of {hello.size} (pid {hello.pid} on "
                           f"{hello.host}) does not fit a group of {self.size}")
            ranks.add(rank)

    def memory_info(self) -> tuple[int | None, int]:
        return self._memory

    def determine_num_blocks(self, config: EngineConfig) -> int:
        blocks = self._call(ProfileMemory(config), WorkerBlocks)
        self.block_bytes = max(b.block_bytes for b in blocks)
        self.kv_cache_dtype = blocks[0].kv_cache_dtype
        return min(b.num_blocks for b in blocks)  # the smallest rank's

    def initialize(self, spec: KVCacheSpec) -> TierCosts | None:
        costs = [r.tier_costs for r in self._call(spec, WorkerInitialized)]
        if costs[0] is None:
            return None
        return TierCosts(*(max(getattr(c, field) for c in costs)
                           for field in TierCosts.__struct_fields__))

    # -- steps ----------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput,
                      previous: InFlightStep | None = None
                      ) -> tuple[RemoteStep, InFlightStep | None]:
        """Send the step (the workers do its host work when it arrives); the workers take
        the placeholders' tokens from their own latest sampling."""
        if previous is not None:
            previous = self.sample_awaiting(previous)
        self._send_all(scheduler_output)
        return RemoteStep(), previous

    def sample_tokens(self, step: RemoteStep,
                      grammar: GrammarOutput | None = None) -> PendingOutput:
        message = None
        if grammar is not None:
            bitmask = np.ascontiguousarray(grammar.bitmask, dtype=np.int32)
            message = GrammarBitmask(grammar.req_ids, bitmask.tobytes(), bitmask.shape[1])
        self._send_all(SampleTokens(message))
        return self._launch()

    def start_profile(self) -> None:
        self._send_all(StartProfile())

    def stop_profile(self, trace_path: str) -> None:
        self._call(StopProfile(trace_path), ProfileStopped)

    def _launch(self) -> RemotePendingOutput:
        self._launched += 1
        return RemotePendingOutput(self, self._launched)

    def collect(self, seq: int) -> ModelRunnerOutput:
        """Every rank takes in the tokens of its oldest launched step; rank 0 returns them."""
        if seq != self._collected + 1:
            raise RuntimeError(f"step {seq} collected out of order (expected "
                               f"{self._collected + 1})")
        self._send_all(CollectOutput())
        rank, message = self._receive(None)
        if not isinstance(message, CollectedOutput) or rank != 0:
            self._fail(f"unexpected {type(message).__name__} from rank {rank} during a step")
        self._collected = seq
        return message.output

    # -- transport ------------------------------------------------------------------------

    def _send_all(self, message: Any) -> None:
        self._check()
        try:
            self._channel.send_to(self._ranks, message)
        except zmq.ZMQError as e:
            self._check_processes()  # the better message, when the worker is ours
            self._fail(f"cannot reach a tensor-parallel worker ({e}): it has exited")

    def _call(self, message: Any, reply_type: type) -> list:
        """A set-up call every rank answers; the answers in rank order."""
        self._send_all(message)
        answers: dict[int, object] = {}
        while len(answers) < self.size:
            rank, reply = self._receive(None)
            if not isinstance(reply, reply_type):
                self._fail(f"unexpected {type(reply).__name__} from rank {rank} during "
                           f"{type(message).__name__}")
            answers[rank] = reply
        return [answers[r] for r in range(self.size)]

    def _receive(self, deadline: float | None) -> tuple[int, Any]:
        """The next message from any rank, and its rank; a failure report, a worker's death
        or the deadline raise ExecutorError instead."""
        while True:
            events = dict(self._poller.poll(POLL_MS))
            if self._socket in events:
                identity, message = self._channel.receive_from()
                if isinstance(message, WorkerFailure):
                    self._fail_reported(message)
                return int(identity.removeprefix(b"rank")), message
            self._check_processes()
            self._check_disconnected()
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"the {self.size} tensor-parallel workers did not all connect "
                           f"in {HELLO_TIMEOUT_S:.0f} s")

    def _exited(self) -> dict[int, str]:
        """The workers we started that have exited, and how."""
        exited = {}
        for rank, proc in enumerate(self._procs):
            how = ipc.exit_description(proc)
            if how is not None:
                exited[rank] = f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"
        return exited

    def _check_processes(self) -> None:
        """Fail if a worker we started has exited, naming every one that has (the first to
        go takes the others' collectives down with it, whatever the rank order)."""
        exited = self._exited()
        if exited:
            self._fail("; ".join(exited.values()))

    def _fail_reported(self, failure: WorkerFailure) -> None:
        """A rank raised. If another rank has died, that is the cause (a collective with a
        dead peer raises on the living): name it first."""
        time.sleep(POLL_MS / 1000)  # the dead one's exit may not be reaped yet
        causes = [how for rank, how in self._exited().items() if rank != failure.rank]
        self._fail("; ".join(causes + [f"tensor-parallel worker rank {failure.rank} failed:\n"
                                       f"{failure.error}"]))

    def _check(self) -> None:
        if self._error is not None:
            raise ExecutorError(self._error)

    def _check_disconnected(self) -> None:
        """Fail if a worker's connection dropped (torchrun's workers included)."""
        if self._monitor.poll(0):
            recv_monitor_message(self._monitor)
            time.sleep(POLL_MS / 1000)  # a dead worker's exit code makes a better message
            self._check_processes()
            self._fail("a tensor-parallel worker disconnected: its process has died")

    def check_health(self) -> None:
        self._check()
        if self._stop.alive:  # not shut down
            self._check_processes()
            self._check_disconnected()

    def _fail(self, message: str) -> None:
        """Stop at once: ranks blocked in a collective with a dead peer would not answer."""
        self._error = message
        for proc in self._procs:
            proc.kill()
        self.shutdown()
        raise ExecutorError(message)

    def shutdown(self) -> None:
        self._stop()


def _last_words(channel: ipc.RouterChannel) -> Any:
    """A rank's message while stopping; one that cannot be decoded counts as none."""
    try:
        return channel.receive_from()[1]
    except msgspec.DecodeError:
        return None


def worker_env() -> dict[str, str]:
    """This environment, NVLink multicast off, and this pagedserve first on the path."""
    return ipc.child_env(WORKER_ENV)


def rank_identity(rank: int) -> bytes:
    return b"rank%d" % rank


def set_heartbeat(sock: zmq.Socket) -> None:
    """Drop a silent peer (a host gone without closing its connection) after a while, so the
    other side sees it disconnect."""
    interval, timeout = HEARTBEAT_MS
    sock.setsockopt(zmq.HEARTBEAT_IVL, interval)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)


def _stop_workers(context: zmq.Context, channel: ipc.RouterChannel,
                  procs: list[subprocess.Popen], ranks: list[bytes]) -> None:
    """Ask every rank to exit and wait for its goodbye (a worker that saw our socket close
    before it read the request would take it for our death), kill the ones still running,
    close the socket."""
    asked = 0
    for identity in ranks:
        try:
            channel.send_to([identity], ShutdownWorker(), block=False)
            asked += 1
        except zmq.ZMQError:
            pass  # that rank is gone or never came
    deadline = time.monotonic() + STOP_TIMEOUT_S
    byes = 0
    while byes < asked and time.monotonic() < deadline:
        if procs and all(proc.poll() is not None for proc in procs):
            break
        if channel.poll(POLL_MS):
            byes += isinstance(_last_words(channel), WorkerBye)
    for proc in procs:
        ipc.stop_process(proc, None, max(0.0, deadline - time.monotonic()))
    channel.socket.disable_monitor()
    context.destroy(linger=1000)  # the stop calls reach workers started elsewhere
