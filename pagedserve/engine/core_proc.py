"""The engine-core process: an `EngineCore` stepped in a busy loop behind two ZeroMQ sockets.

Why a process of its own: in one process the HTTP event loop, pydantic, SSE chunks and
detokenization share the interpreter lock with the engine, so between two model steps the
device waits for Python work that has nothing to do with the step. Here the process does
nothing but scheduling and launching steps; the API process (`core_client.py`) keeps
tokenization, detokenization, stop strings, logprob formatting and HTTP.

Wire protocol: `ipc.Channel` over each socket, every message one frame, a tagged msgspec
Struct of `messages.py`.

    frontend -> core (PUSH -> PULL)   EngineCoreRequest
                                      AbortRequests
                                      ShutdownCore
    core -> frontend (PUSH -> PULL)   EngineCoreReady, once, when the model is loaded
                                      EngineCoreOutputs, once per step for the batch
                                      EngineCoreFailed, then the process exits 1

The loop drains every queued input without blocking, runs one step when there is work and
sends that step's outputs in one message; with no work it blocks on the input socket (with
only requests whose grammar compiles, for a few ms at a time: no spinning on empty steps). It
leaves when told to (SHUTDOWN) and when its parent is gone (`os.getppid()` changes; on Linux
the kernel also kills it at once, `PR_SET_PDEATHSIG`), so it never outlives the server.
SIGINT and SIGTERM are ignored: a Ctrl-C reaches the whole process group and a service
manager (systemd) signals every process of the service, and the parent decides how the core
stops, after its graceful shutdown, so that in-flight streams still end cleanly. (SIGKILL, or
the parent's death, still ends it at once.)
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING

import zmq

from pagedserve import ipc
from pagedserve.config import EngineConfig
from pagedserve.messages import (AbortRequests, EngineCoreFailed, EngineCoreOutputs,
                                 EngineCoreReady, EngineCoreRequest, ToEngineCore)

if TYPE_CHECKING:
    from pagedserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # an idle core wakes this often to check that its parent is alive
_GRAMMAR_POLL_MS = 5  # a core whose requests all wait for a grammar looks this often

# start-up errors whose message is the whole story (bad options, a missing file)
_USER_ERRORS = (ValueError, FileNotFoundError)


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    parent_pid: int, log_level: int) -> None:
    """The process's entry point (a `multiprocessing` spawn target): build the core, report
    READY or FAILED to the parent, then serve until shutdown. Exits 1 after a failure."""
    ipc.ignore_stop_signals()
    ipc.die_with_parent()  # started from the client's main thread
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    inputs = ipc.Channel(context.socket(zmq.PULL), ToEngineCore)
    inputs.socket.connect(input_address)
    outputs = ipc.Channel(context.socket(zmq.PUSH))
    outputs.socket.connect(output_address)
    try:
        # imported here, in the child: the API process, which imports this module for its
        # wire names, then never loads the model code, torch's kernels or the sampler
        from pagedserve.engine.core import EngineCore

        core = EngineCore(config)
    except Exception as exc:  # noqa: BLE001 - every start-up failure reaches the parent
        _fail(outputs, exc, "the engine core failed to start")
    outputs.send(ready_message(core))
    try:
        EngineCoreProc(core, inputs, outputs, parent_pid).run()
    except Exception as exc:  # noqa: BLE001 - a failed step: say why, then exit 1
        _fail(outputs, exc, "the engine core failed")
    finally:
        context.destroy(linger=0)


def ready_message(core: EngineCore) -> EngineCoreReady:
    config, executor = core.config, core.executor  # one process, or tensor-parallel workers
    kv = executor.kv_cache_dtype
    return EngineCoreReady(
        tokenizer=core.tokenizer_source,
        vocab_size=core.model_config.vocab_size, max_model_len=core.max_model_len,
        num_gpu_blocks=core.num_blocks, block_size=config.block_size,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_dtype="fp8_e4m3" if kv == "float8_e4m3fn" else kv,
        quantization=executor.quantization, device=executor.device_name,
        max_lora_rank=config.max_lora_rank if config.enable_lora else 0,
        model_config=core.model_config.to_json() if config.enable_lora else "")


class EngineCoreProc:
    """The busy loop: inputs, a step when there is work, that step's outputs."""

    def __init__(self, core: EngineCore, inputs: ipc.Channel, outputs: ipc.Channel,
                 parent_pid: int) -> None:
        self.core, self.inputs, self.outputs = core, inputs, outputs
        self.parent_pid = parent_pid
        self._stats_sent = True  # the frontend's view of the core's stats is current

    def run(self) -> None:
        core, poller = self.core, zmq.Poller()
        poller.register(self.inputs.socket, zmq.POLLIN)
        while True:
            if not core.has_unfinished_requests():
                self._send_idle_stats()
                poller.poll(_IDLE_POLL_MS)
                core.check_health()  # a dead tensor-parallel worker fails the core now
            if not self._drain_inputs() or ipc.parent_gone(self.parent_pid):
                return
            if core.waits_for_grammars_only():  # until an input comes or a compile ends
                poller.poll(_GRAMMAR_POLL_MS)
                if not self._drain_inputs():
                    return
            if core.has_unfinished_requests():
                self.outputs.send(core.step())
                self._stats_sent = True  # a step's message carries its stats

    def _drain_inputs(self) -> bool:
        """Apply every queued message; False once told to shut down."""
        while True:
            try:
                message = self.inputs.receive(block=False)
            except zmq.Again:
                return True
            if isinstance(message, EngineCoreRequest):
                self.core.add_request(message)
            elif isinstance(message, AbortRequests):
                self.core.abort_requests(message.request_ids)
            else:  # ShutdownCore
                return False
            self._stats_sent = False

    def _send_idle_stats(self) -> None:
        """Once the core goes idle, the stats after its last change (an abort between steps
        changes them without a step), so the frontend's metrics do not show stale counts."""
        if not self._stats_sent:
            message = EngineCoreOutputs([], self.core.make_stats(), time.time())
            self.outputs.send(message)
            self._stats_sent = True


def _fail(outputs: ipc.Channel, exc: Exception, what: str) -> None:
    """Report `exc` to the parent and exit 1. A user error's message is the whole story; any
    other failure is also logged here with its traceback."""
    if not isinstance(exc, _USER_ERRORS):
        logger.exception(what)
    outputs.send(EngineCoreFailed(str(exc) or type(exc).__name__))
    outputs.socket.close(linger=5000)  # the message must leave before the process does
    sys.exit(1)

