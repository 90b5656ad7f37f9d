"""depthserve on Ray Serve: engine replicas behind one OpenAI endpoint (docs/server.md, "Scaling out").

The engine deployment, and an ingress in front of it:
- the engine (`depthserve-engine`): each replica is one Ray actor that owns one `AsyncLLM` (engine
  thread, model, KV cache, its own depth policy) and answers `EngineCall`s, one prompt each, as a
  stream of outputs. Serve scales it (a fixed count, or autoscaling on ongoing calls) and replaces a
  replica whose `check_health` fails: one whose engine has died (the engine's own `/health` 503).
- the ingress: the same FastAPI app as `depthserve serve` (`server.app.build_app`: routes,
  validation, error bodies, streaming, `/metrics`) on a `RemoteEngine` (remote_engine.py) that sends
  each prompt to an engine replica through a Serve handle routed by `PrefixAffinityRouter`
  (prefix_router.py). Every generation response names the engine replica(s) that produced it in
  `x-depthserve-replica`. `serve --replicas` (`run`) serves it from its own process under the
  one-process server's uvicorn and connection deadlines (server/connections.py), Serve's HTTP proxy
  off; a Serve config (`build`, `application`) makes it the deployment `depthserve`, behind Serve's
  proxy, through `@serve.ingress`.

Ray is an optional dependency (`pip install depthserve[ray]`); nothing else in the package imports
this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from depthserve.config import EngineArgs
from depthserve.deploy.remote_engine import SERVED_BY, Admitted, EngineCall, RemoteEngine, ReplicaReport, ReplicaTarget
from depthserve.engine.llm_engine import ModelInfo
from depthserve.errors import ConfigurationError
from depthserve.outputs import RequestOutput
from depthserve.server.connections import ConnectionLimits, uvicorn_config

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-depthserve-replica"
ENGINE_DEPLOYMENT = "depthserve-engine"
INGRESS_DEPLOYMENT = "depthserve"
APP_NAME = "depthserve"
ROUTINGS = ("prefix", "least-loaded")


@dataclass(frozen=True)
class ReplicaSettings:
    """What one replica builds: its engine and the server options `depthserve serve` takes."""

    engine: EngineArgs
    served_model_name: str | None = None
    api_key: str | None = None
    depth_presets: dict[str, dict] = field(default_factory=dict)
    max_waiting_requests: int = 256
    max_body_bytes: int = 4 << 20
    chat_template: str | None = None


@dataclass(frozen=True)
class Scaling:
    """How many replicas, and the CPUs each reserves from Ray. With `max_replicas` above `replicas`,
    Serve autoscales between them on ongoing requests per replica (`target_ongoing_requests`), after
    `upscale_delay_s` / `downscale_delay_s` of sustained load or idleness."""

    replicas: int = 1
    max_replicas: int | None = None
    cpus_per_replica: float = 1.0
    target_ongoing_requests: float = 4.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    look_back_period_s: float = 10.0  # the window the ongoing requests are averaged over
    metrics_interval_s: float = 2.0  # how often each replica reports them
    health_check_period_s: float = 5.0
    # "prefix": a call goes to the replica holding the longest run of its leading blocks, "least-loaded":
    # to the replica with the fewest calls in flight (both PrefixAffinityRouter, prefix_router.py)
    routing: str = "prefix"

    def check(self) -> None:
        if self.replicas < 1:
            raise ConfigurationError(f"replicas must be at least 1, got {self.replicas}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ConfigurationError(f"max_replicas ({self.max_replicas}) is below replicas ({self.replicas})")
        if self.cpus_per_replica <= 0 or self.target_ongoing_requests <= 0:
            raise ConfigurationError("cpus_per_replica and target_ongoing_requests must be positive")
        if self.routing not in ROUTINGS:
            raise ConfigurationError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")

    def engine_options(self) -> dict[str, Any]:
        """The engine deployment's options (the ingress takes no CPU reservation of its own)."""
        options: dict[str, Any] = {"ray_actor_options": {"num_cpus": self.cpus_per_replica},
                                   "health_check_period_s": self.health_check_period_s,
                                   "max_ongoing_requests": 256,
                                   # no log line per call (the ingress polls reports every 2 s)
                                   "logging_config": {"enable_access_log": False}}
        if self.max_replicas is None or self.max_replicas == self.replicas:
            options["num_replicas"] = self.replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.replicas, "initial_replicas": self.replicas,
                "max_replicas": self.max_replicas, "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s, "metrics_interval_s": self.metrics_interval_s}
        return options


class ReplicaHeader:
    """ASGI middleware: a response names the engine replicas that produced it (those the ingress's
    RemoteEngine admitted the request's prompts on, in the request's context)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        served: list[str] = []
        token = SERVED_BY.set(served)

        async def send_named(message):
            if message["type"] == "http.response.start" and served:
                value = ",".join(dict.fromkeys(served)).encode("latin-1")
                message["headers"] = [*message.get("headers", []), (REPLICA_HEADER.encode(), value)]
            await send(message)

        try:
            await self.app(scope, receive, send_named)
        finally:
            SERVED_BY.reset(token)


def engine_class():
    """The engine deployment's class (built on first use: it needs Ray)."""
    from ray import serve

    class DepthserveEngine:
        def __init__(self, settings: ReplicaSettings):
            from depthserve.engine.async_llm import AsyncLLM

            self.replica = serve.get_replica_context().replica_id.unique_id
            self.llm = AsyncLLM.from_engine_args(settings.engine, settings.max_waiting_requests, settings.depth_presets)
            log.info("engine replica %s serving %s", self.replica, self.llm.model_name)

        def model_info(self) -> ModelInfo:
            return self.llm.model_info

        def report(self, target: ReplicaTarget | None = None) -> ReplicaReport:
            """This replica's report (`target`: the replica the caller meant, for the router)."""
            return ReplicaReport(self.replica, self.llm.is_healthy, self.llm.health_message(), self.llm.stats())

        async def generate(self, call: EngineCall) -> AsyncIterator[Admitted | RequestOutput]:
            """`Admitted` once the prompt is queued (or the request's typed error), then its outputs;
            the caller cancelling the call (its client gone) aborts the request."""
            [stream] = await self.llm.add_requests([call.token_ids], call.params, call.depth, [call.request_id],
                                                   call.overflow)
            try:
                yield Admitted(self.report())
                # each item is a Ray object sent to the ingress: while the ingress is behind, send only
                # the newest cumulative output
                async for out in stream.newest():
                    yield out
            finally:
                stream.close()

        async def reset_prefix_cache(self, target: ReplicaTarget) -> bool:
            """Forget the cached prefixes if this is the target replica; False if it is not."""
            if target.replica != self.replica:
                return False
            await self.llm.reset_prefix_cache()
            return True

        async def check_health(self) -> None:
            """Serve replaces a replica whose check raises: one whose engine has died."""
            if not self.llm.is_healthy:
                raise RuntimeError(f"engine of replica {self.replica} is down: {self.llm.health_message()}")

        async def __del__(self) -> None:
            await self.llm.shutdown()

    return DepthserveEngine


def ingress_app(engine: RemoteEngine, settings: ReplicaSettings):
    """The OpenAI app on a RemoteEngine, naming the engine replicas in its responses."""
    from depthserve.server.app import build_app

    app = build_app(engine, settings.served_model_name, settings.api_key, settings.depth_presets,
                    settings.max_body_bytes, settings.chat_template)
    app.add_middleware(ReplicaHeader)
    return app


def ingress_class():
    """The ingress deployment's class: the OpenAI app on a RemoteEngine, behind Serve's HTTP proxy."""
    from ray import serve

    @serve.ingress()
    class DepthserveIngress:
        async def __init__(self, engine, settings: ReplicaSettings):
            self.settings = settings
            self.engine = await RemoteEngine.connect(engine)

        def __serve_build_asgi_app__(self):
            return ingress_app(self.engine, self.settings)

    return DepthserveIngress


def engine_application(settings: ReplicaSettings, scaling: Scaling):
    """The engine deployment alone, as a Serve application (its callers hold a handle to it)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from depthserve.deploy.prefix_router import PrefixAffinityRouter

    scaling.check()
    router = RequestRouterConfig(request_router_class=PrefixAffinityRouter, request_router_kwargs={
        "block_tokens": settings.engine.block_size, "prefix_affinity": scaling.routing == "prefix"})
    return serve.deployment(engine_class(), name=ENGINE_DEPLOYMENT).options(
        request_router_config=router, **scaling.engine_options()).bind(settings)


def application(settings: ReplicaSettings, scaling: Scaling):
    """The Serve application with its ingress deployment, for Serve's HTTP proxy:
    `serve.run(application(...), route_prefix="/")`."""
    from ray import serve

    ingress = serve.deployment(ingress_class(), name=INGRESS_DEPLOYMENT).options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    return ingress.bind(engine_application(settings, scaling), settings)


def build(args: dict[str, Any]):
    """Serve's application builder, for a Serve config file (`import_path:
    depthserve.deploy.ray_serve:build`, deploy/serve-config.yaml) on an existing Ray cluster. `args`
    holds EngineArgs fields (model, dtype, num_threads, ...), the server's (served_model_name,
    api_key, depth_presets, max_waiting_requests, max_body_bytes, chat_template) and Scaling's
    (replicas, max_replicas, cpus_per_replica, ...); anything else is an error."""
    engine_fields = {f.name for f in fields(EngineArgs)}
    server_fields = {f.name for f in fields(ReplicaSettings)} - {"engine"}
    scaling_fields = {f.name for f in fields(Scaling)}
    unknown = sorted(set(args) - engine_fields - server_fields - scaling_fields)
    if unknown:
        raise ConfigurationError(f"unknown depthserve application args: {', '.join(unknown)}")
    engine = EngineArgs(**{k: v for k, v in args.items() if k in engine_fields})
    engine.validate()
    settings = ReplicaSettings(engine, **{k: v for k, v in args.items() if k in server_fields})
    scaling = Scaling(**{k: v for k, v in args.items() if k in scaling_fields})
    return application(settings, scaling)


async def serve_http(settings: ReplicaSettings, host: str, port: int, log_level: str = "info",
                     limits: ConnectionLimits = ConnectionLimits()) -> None:
    """The ingress in this process: the OpenAI app on a RemoteEngine over a handle to the engine
    deployment of the running application APP_NAME, under the one-process server's uvicorn and
    connection deadlines (server/connections.py), until SIGINT or SIGTERM."""
    import uvicorn
    from ray import serve

    engine = await RemoteEngine.connect(serve.get_deployment_handle(ENGINE_DEPLOYMENT, APP_NAME))
    app = ingress_app(engine, settings)
    log.info("serving %s at http://%s:%d through Ray Serve engine replicas", engine.model_name, host, port)
    await uvicorn.Server(uvicorn_config(app, host, port, log_level, limits)).serve()


def run(settings: ReplicaSettings, scaling: Scaling, host: str, port: int, num_cpus: int | None = None,
        log_level: str = "info", limits: ConnectionLimits = ConnectionLimits()) -> None:
    """Start a local Ray cluster and the engine replicas, serve HTTP from this process (serve_http)
    until SIGINT or SIGTERM, then stop the cluster and every process it started."""
    import ray
    from ray import serve

    # Ray starts its workers at nice 15, below every other process of the machine: an engine replica
    # would then lose its cores to anything else running (on 2 cores, to the benchmark's own client).
    # The local cluster is the engine's.
    os.environ.setdefault("RAY_worker_niceness", "0")
    stop = StopRequest()
    try:
        signal.signal(signal.SIGINT, stop.interrupt)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
        signal.signal(signal.SIGTERM, stop.interrupt)  # after ray.init's own handler: SIGTERM is a Ctrl-C
        # Serve's HTTP proxy has no connection deadlines of ours: this process serves HTTP instead
        serve.start(proxy_location="Disabled")
        serve.run(engine_application(settings, scaling), name=APP_NAME, route_prefix=None)
        if not stop.requested:  # (Ray's start-up code may swallow the KeyboardInterrupt)
            asyncio.run(serve_http(settings, host, port, log_level, limits))
    except KeyboardInterrupt:
        pass  # uvicorn has stopped serving; a signal before it started lands here
    finally:
        stop_local_cluster()


class StopRequest:
    """SIGINT or SIGTERM received: noted, and raised as KeyboardInterrupt (uvicorn, while it serves,
    takes both signals itself and calls this handler again once it has stopped)."""

    def __init__(self) -> None:
        self.requested = False

    def interrupt(self, *_) -> None:
        self.requested = True
        raise KeyboardInterrupt


def stop_local_cluster(grace_s: float = 3.0) -> None:
    """Stop the Ray cluster this process started and wait for its processes to go: `ray.shutdown()`
    stops the ones ray.init started (GCS, raylet), and those the raylet started (workers, the dashboard
    and runtime-env agents), which otherwise outlive it for a minute or more, get SIGTERM after
    `grace_s`, then SIGKILL. A second Ctrl-C meanwhile is ignored: it would leave them running."""
    import ray

    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        started = descendants(os.getpid())
        ray.shutdown()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not _wait_gone(started, grace_s):
                for pid in still_running(started):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sig)
        if still_running(started):
            log.warning("Ray processes still running after shutdown: %s", sorted(still_running(started)))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def descendants(pid: int) -> dict[int, str]:
    """The processes below `pid` (children, theirs, ...), each with its start time (a pid is only
    the same process while its start time is), read from /proc; none where there is no /proc."""
    parents: dict[int, int] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields_after_name = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parents[int(entry.name)] = int(fields_after_name[1])  # field 4: ppid
        starts[int(entry.name)] = fields_after_name[19]  # field 22: start time
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = starts[child]
                frontier.append(child)
    return found


def still_running(processes: dict[int, str]) -> list[int]:
    """Those of `processes` still running as the same process (a zombie has exited)."""
    alive = []
    for pid, start in processes.items():
        try:
            fields_after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields_after_name[19] == start and fields_after_name[0] != "Z":
            alive.append(pid)
    return alive


def _wait_gone(processes: dict[int, str], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while still_running(processes):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
