"""depthserve replicas on Ray Serve behind one OpenAI endpoint (docs/server.md, "Scaling out").

Each replica is one Ray actor that owns one `AsyncLLM` (engine thread, model, KV cache) and serves
the same FastAPI app as `depthserve serve` (`server.app.build_app`: routes, validation, error
bodies, streaming, `/metrics` of that replica), handed to Serve through `@serve.ingress` with the
app built in the replica. Serve's proxy takes the HTTP requests and its router sends each to a
replica (power of two choices on queue length); every response names its replica in the
`x-depthserve-replica` header. Serve checks each replica through `check_health`, which fails once
the engine has died (the engine's own `/health` 503), so Serve replaces that replica.

Ray is an optional dependency (`pip install depthserve[ray]`); nothing else in the package imports
this module.
"""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass, field, fields
from typing import Any

from depthserve.config import EngineArgs
from depthserve.errors import ConfigurationError

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-depthserve-replica"
DEPLOYMENT_NAME = "depthserve"
APP_NAME = "depthserve"


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

    def check(self) -> None:
        if self.replicas < 1:
            raise ConfigurationError(f"replicas must be at least 1, got {self.replicas}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ConfigurationError(f"max_replicas ({self.max_replicas}) is below replicas ({self.replicas})")
        if self.cpus_per_replica <= 0 or self.target_ongoing_requests <= 0:
            raise ConfigurationError("cpus_per_replica and target_ongoing_requests must be positive")

    def deployment_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"ray_actor_options": {"num_cpus": self.cpus_per_replica},
                                   "health_check_period_s": self.health_check_period_s,
                                   "max_ongoing_requests": 256}
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
    """ASGI middleware: every response names the replica that produced it."""

    def __init__(self, app, replica: str):
        self.app, self.replica = app, replica.encode("latin-1")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica)]
            await send(message)

        await self.app(scope, receive, send_named)


def replica_class():
    """The deployment's class (built on first use: it needs Ray)."""
    from ray import serve

    @serve.ingress()
    class DepthserveReplica:
        def __init__(self, settings: ReplicaSettings):
            from depthserve.engine.async_llm import AsyncLLM

            self.settings = settings
            self.replica = serve.get_replica_context().replica_id.unique_id
            self.llm = AsyncLLM.from_engine_args(settings.engine, settings.max_waiting_requests, settings.depth_presets)
            log.info("replica %s serving %s", self.replica, self.llm.model_name)

        def __serve_build_asgi_app__(self):
            from depthserve.server.app import build_app

            s = self.settings
            app = build_app(self.llm, s.served_model_name, s.api_key, s.depth_presets, s.max_body_bytes,
                            s.chat_template)
            app.add_middleware(ReplicaHeader, replica=self.replica)
            return app

        async def check_health(self) -> None:
            """Serve replaces a replica whose check raises: one whose engine has died."""
            if not self.llm.is_healthy:
                raise RuntimeError(f"engine of replica {self.replica} is down: {self.llm.health_message()}")

    return DepthserveReplica


def application(settings: ReplicaSettings, scaling: Scaling):
    """The Serve application: `serve.run(application(...), route_prefix="/")`."""
    from ray import serve

    scaling.check()
    deployment = serve.deployment(replica_class(), name=DEPLOYMENT_NAME)
    return deployment.options(**scaling.deployment_options()).bind(settings)


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


def run(settings: ReplicaSettings, scaling: Scaling, host: str, port: int, num_cpus: int | None = None) -> None:
    """Start a local Ray cluster, the replicas and one HTTP endpoint, and serve until interrupted."""
    import ray
    from ray import serve

    # SIGTERM (a process manager, `kill`) stops the replicas and the local cluster as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(settings, scaling), name=APP_NAME, route_prefix="/", blocking=True)
    finally:
        serve.shutdown()
        ray.shutdown()
