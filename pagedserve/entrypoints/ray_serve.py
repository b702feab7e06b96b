"""N pagedserve engines as Ray Serve replicas behind one OpenAI endpoint, each request sent
to the replica that caches the longest prefix of its prompt.

    pagedserve serve-ray --num-replicas 2 [engine options]
    python -m pagedserve.entrypoints.ray_serve --num-replicas 2 [engine options]

Two deployments. `EngineReplica` runs one `pagedserve serve` (every endpoint and option of
the single server, tensor parallelism inside included) on a port of its own, with KV events
and their replay on ports of its own, and relays requests to it; it reports the event
endpoints in its routing stats and fails its health check once its server has exited, so
Ray Serve reports the replica dead and starts another. `OpenAIIngress` is the HTTP entry:
it tokenizes each completion or chat prompt as the server will (the model's tokenizer and
chat template), hashes its full blocks with the fleet's shared `prefix_caching_hash_seed`
(one is drawn for the fleet if none is given) and hands them to the engine deployment's
request router (`ray_router.PrefixAwareRouter`), which matches them against the replicas'
KV events. The answer names the replica that served it (the `x-pagedserve-replica` header).

Replica counts and autoscaling are Ray Serve's own settings, passed through
(`--num-replicas`, or `--autoscaling-config` as JSON: min_replicas, max_replicas,
target_ongoing_requests ...). On several hosts, start a Ray cluster first (`ray start`) and
run this on its head node: replicas are placed by Ray, and the events are read over TCP.
"""

# no `from __future__ import annotations`: FastAPI reads the route's annotations at runtime
import argparse
import asyncio
import json
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import httpx
import ray
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from pagedserve.entrypoints.chat_template import encode_chat
from pagedserve.entrypoints.engine_args import add_engine_args
from pagedserve.entrypoints.ray_router import ROUTINGS
from pagedserve.ipc import child_env, die_with_parent, exit_description, module_command, \
    stop_process
from pagedserve.kv_cache.events import external_hash
from pagedserve.kv_cache.hashing import get_hash_fn

REPLICA_HEADER = "x-pagedserve-replica"
START_TIMEOUT_S = 900  # a replica's server loading its model (a first GGUF conversion)
ROUTED_PATHS = {"/v1/completions", "/v1/chat/completions"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


class EngineReplica:
    """One `pagedserve serve` process and the relay to it (see the module doc)."""

    def __init__(self, server_args: list[str]) -> None:
        port, events, replay = _free_port(), _free_port(), _free_port()
        self._process = subprocess.Popen(
            module_command("pagedserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
                           "--port", str(port), "--kv-events-endpoint", f"tcp://*:{events}",
                           "--kv-events-replay-endpoint", f"tcp://*:{replay}", *server_args),
            env=child_env(), preexec_fn=die_with_parent)
        self._client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=None)
        self._wait_ready(port)
        node = ray.util.get_node_ip_address()
        self._name = serve.get_replica_context().replica_tag
        self._stats = {"kv_events": f"tcp://{node}:{events}",
                       "kv_replay": f"tcp://{node}:{replay}"}

    def _wait_ready(self, port: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            died = exit_description(self._process)
            if died is not None:
                raise RuntimeError(f"the replica's pagedserve server {died} while starting")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self._stop()
        raise RuntimeError(f"the replica's pagedserve server was not ready in "
                           f"{START_TIMEOUT_S} s")

    async def forward(self, method: str, path: str, body: bytes, headers: dict[str, str],
                      block_hashes: list[int] | None = None) -> AsyncIterator:
        """Relay one HTTP request: yields (status, content type, replica), then the body's
        chunks as the server sends them. `block_hashes` are for the router, not used here."""
        async with self._client.stream(method, path, content=body, headers=headers) as reply:
            yield reply.status_code, reply.headers.get("content-type", ""), self._name
            async for chunk in reply.aiter_raw():
                yield chunk

    def record_routing_stats(self) -> dict:
        return self._stats

    def check_health(self) -> None:
        died = exit_description(self._process)
        if died is not None:
            raise RuntimeError(f"replica {self._name}: its pagedserve server {died}")

    def _stop(self) -> None:
        stop_process(self._process, self._process.terminate, timeout=30)

    def __del__(self) -> None:  # Ray Serve calls it when it stops the replica
        if hasattr(self, "_process"):  # not when the constructor failed before the start
            self._stop()


app = FastAPI(title="pagedserve on Ray Serve")


def _query(request: Request) -> str:
    return f"?{request.url.query}" if request.url.query else ""


async def _rest(stream) -> AsyncIterator[bytes]:
    async for chunk in stream:
        yield chunk


@serve.ingress(app)  # here, not in build_app: a replica rebuilds the app by importing this
class OpenAIIngress:
    """The fleet's HTTP endpoint: every path relayed to an engine replica; completion and
    chat requests carry their prompt's block hashes for the router."""

    def __init__(self, engine: DeploymentHandle, tokenizer_source: str, block_size: int,
                 hash_algo: str, hash_seed: str) -> None:
        from pagedserve.model.loader import load_tokenizer  # torch: in the ingress only

        self._engine = engine.options(stream=True)
        self._tokenizer = load_tokenizer(tokenizer_source)
        self._block_size = block_size
        self._hasher = get_hash_fn(hash_algo, hash_seed)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def relay(self, path: str, request: Request) -> StreamingResponse:
        body = await request.body()
        route = "/" + path
        hashes = self._block_hashes(body) if route in ROUTED_PATHS else []
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("content-type", "authorization", "accept")}
        stream = self._engine.forward.remote(request.method, route + _query(request), body,
                                             headers, block_hashes=hashes)
        status, media_type, replica = await stream.__anext__()
        return StreamingResponse(_rest(stream), status_code=status, media_type=media_type,
                                 headers={REPLICA_HEADER: replica})

    def _block_hashes(self, body: bytes) -> list[int]:
        """The external hashes of the prompt's full blocks; [] where the prompt cannot be
        read here (the replica's server answers the request itself, and says what is
        wrong): such a request is routed by load alone. A request's `cache_salt` is not
        hashed in: salted prompts match nowhere and are routed by load too."""
        try:
            tokens = self._prompt_tokens(json.loads(body))
        except Exception:  # noqa: BLE001 - only the routing hint is lost
            return []
        size = self._block_size
        num_blocks = len(tokens) // size
        if num_blocks == 0:
            return []
        chain = self._hasher.chain(None, tokens[:num_blocks * size], size, [None] * num_blocks)
        return [external_hash(h) for h in chain]

    def _prompt_tokens(self, request: dict) -> list[int]:
        if "messages" in request:
            return encode_chat(self._tokenizer, request["messages"],
                               tools=request.get("tools"),
                               template_kwargs=request.get("chat_template_kwargs"))
        prompt = request["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return prompt
        return self._tokenizer.encode(prompt if isinstance(prompt, str) else prompt[0])


def build_app(server_args: list[str], num_replicas: int | None = 1,
              autoscaling_config: dict | None = None, routing: str = "prefix",
              replica_cpus: float = 1.0, replica_gpus: float = 0.0,
              max_ongoing_requests: int = 64, health_check_period_s: float = 10.0):
    """The Ray Serve application: the ingress over `num_replicas` engine replicas (or
    `autoscaling_config`), each a `pagedserve serve` with `server_args`."""
    options = _engine_options(server_args)
    if options.prefix_caching_hash_seed is None:  # the fleet must share one
        options.prefix_caching_hash_seed = secrets.token_hex(16)
        server_args = [*server_args, "--prefix-caching-hash-seed",
                       options.prefix_caching_hash_seed]
    engine = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas="auto" if autoscaling_config else num_replicas,
        autoscaling_config=autoscaling_config, max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=health_check_period_s,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        request_router_config=RequestRouterConfig(
            request_router_class="pagedserve.entrypoints.ray_router.PrefixAwareRouter",
            request_router_kwargs={"routing": routing},
            request_routing_stats_period_s=1.0))
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress",
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(server_args), _tokenizer_source(options),
                        options.block_size, options.prefix_caching_hash_algo,
                        options.prefix_caching_hash_seed)


def _engine_options(server_args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return parser.parse_known_args(server_args)[0]


def _tokenizer_source(options: argparse.Namespace) -> str:
    from pagedserve.model.loader import model_path

    return options.tokenizer or str(model_path(options.model))


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Ray Serve")
    group.add_argument("--host", default="127.0.0.1", help="the endpoint's address")
    group.add_argument("--port", type=int, default=8000, help="the endpoint's port")
    group.add_argument("--num-replicas", type=int, default=1, help="engine replicas")
    group.add_argument("--autoscaling-config", type=json.loads, default=None,
                       help="Ray Serve's autoscaling_config as JSON, e.g. "
                       '\'{"min_replicas": 1, "max_replicas": 4, '
                       '"target_ongoing_requests": 8}\' (instead of --num-replicas)')
    group.add_argument("--routing", choices=ROUTINGS, default="prefix",
                       help="prefix: the replica caching the longest prefix, then the least "
                       "loaded; round_robin: in turn")
    group.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves "
                       "per replica")
    group.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica "
                       "(its --tensor-parallel-size)")
    group.add_argument("--max-ongoing-requests", type=int, default=64,
                       help="requests a replica takes at once before the router looks "
                       "elsewhere")
    group.add_argument("--ray-address", default=None, help="a running Ray cluster "
                       "(default: start a local one)")


def run(args: argparse.Namespace, server_args: list[str]) -> int:
    """Start (or join) Ray, deploy, and serve until interrupted."""
    ray.init(address=args.ray_address)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(server_args, args.num_replicas, args.autoscaling_config, args.routing,
                        args.replica_cpus, args.replica_gpus, args.max_ongoing_requests),
              name="pagedserve", route_prefix="/")
    print(f"pagedserve on Ray Serve: http://{args.host}:{args.port}/v1", flush=True)
    try:
        asyncio.run(asyncio.Event().wait())
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve serve-ray", description=__doc__.split(
        "\n\n")[0], epilog="Other options go to each replica's `pagedserve serve`.")
    add_ray_args(parser)
    args, server_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return run(args, server_args)


if __name__ == "__main__":
    sys.exit(main())
