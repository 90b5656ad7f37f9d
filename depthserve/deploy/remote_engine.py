"""The server's engine interface (depthserve/engine/client.py) over engine replicas on Ray Serve.

The ingress replica runs the OpenAI app (server/) on a `RemoteEngine`; every prompt it admits is one
`EngineCall` to the engine deployment through a streaming Serve handle, routed by
`PrefixAffinityRouter` (prefix_router.py). An engine replica answers a call with `Admitted` once the
prompt is queued on its engine (or raises the request's typed error, re-raised here as it is), then
with the request's cumulative outputs.

Faults (docs/server.md, "Scaling out"): a call whose replica dies before the request produced an
output is sent again, to another replica (Serve removes the dead one from the router); a stream
whose replica dies after that ends with `ReplicaLostError`, which the server sends as an error event.
Health and the engine gauges come from `ReplicaReport`s: each replica's latest report, asked of every
replica every `report_period_s` and sent with every admission.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from depthserve.depth import DepthParams
from depthserve.engine.context_length import ContextOverflow
from depthserve.engine.llm_engine import ModelInfo
from depthserve.errors import DepthServeError, EngineDeadError
from depthserve.outputs import RequestOutput
from depthserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# the engine replicas that served the HTTP request being handled (ray_serve.ReplicaHeader reads it)
SERVED_BY: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("served_by", default=None)


class ReplicaLostError(DepthServeError):
    """The engine replica running a request stopped after the request had produced output."""

    status = 503
    error_type = "service_unavailable"


@dataclass(frozen=True)
class EngineCall:
    """One prompt for an engine replica: what AsyncLLM.add_requests takes for one prompt."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    depth: DepthParams | None
    overflow: ContextOverflow


@dataclass(frozen=True)
class ReplicaTarget:
    """A call meant for one engine replica (PrefixAffinityRouter routes it there)."""

    replica: str


@dataclass(frozen=True)
class ReplicaReport:
    replica: str
    healthy: bool
    message: str
    stats: dict
    at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Admitted:
    """An engine replica's first answer to an EngineCall: the prompt is queued on its engine."""

    report: ReplicaReport


def replica_lost(exc: BaseException) -> bool:
    """A Ray error meaning the replica (its actor) is gone or unreachable, not the request's fault."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    return isinstance(exc, (RayActorError, ReplicaUnavailableError))


def unwrapped(exc: BaseException) -> BaseException:
    """The engine's own exception inside Ray's wrapper (a typed error keeps its message and status)."""
    from ray.exceptions import RayTaskError

    return exc.cause if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException) else exc


class RemoteEngine:
    """EngineClient over a Serve handle to the engine deployment (module docstring)."""

    def __init__(self, handle, model_info: ModelInfo, attempts: int = 3, report_period_s: float = 2.0,
                 report_timeout_s: float = 10.0, forget_after_s: float = 60.0):
        self._handle = handle
        self.model_info = model_info
        self.attempts = attempts
        self.report_period_s, self.report_timeout_s = report_period_s, report_timeout_s
        self.forget_after_s = forget_after_s
        self._reports: dict[str, ReplicaReport] = {}
        self._last_poll_error: str | None = None
        self._poller: asyncio.Task | None = None

    @classmethod
    async def connect(cls, handle, **kwargs) -> RemoteEngine:
        """Ask an engine replica for the model's description (waits for one to be up), then poll reports."""
        engine = cls(handle, await handle.model_info.remote(), **kwargs)
        engine._poller = asyncio.create_task(engine._poll_reports())
        return engine

    # ---- state the server reads ---------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.model_info.name

    @property
    def is_healthy(self) -> bool:
        return any(report.healthy for report in self._fresh_reports())

    def health_message(self) -> str:
        fresh = self._fresh_reports()
        if any(report.healthy for report in fresh):
            return "ok"
        if fresh:
            return "; ".join(f"engine replica {r.replica}: {r.message}" for r in fresh)
        return f"no engine replica reported in {self.report_timeout_s:.0f} s" + (
            f" ({self._last_poll_error})" if self._last_poll_error else "")

    def stats(self) -> dict:
        """The engine gauges and counters over the replicas' latest reports (merged_stats)."""
        reports = self._fresh_reports()
        return merged_stats([report.stats for report in reports]) if reports else _EMPTY_STATS

    # ---- requests --------------------------------------------------------------------------------
    async def add_requests(self, prompts: list[str | list[int]], sampling_params: SamplingParams,
                           depth: DepthParams | None, request_ids: list[str],
                           overflow: ContextOverflow = ContextOverflow.CLAMP) -> list[RemoteStream]:
        streams: list[RemoteStream] = []
        try:
            for prompt, request_id in zip(prompts, request_ids):
                call = EngineCall(request_id, list(prompt), sampling_params, depth, overflow)
                streams.append(RemoteStream(self, call, *await self._admit(call)))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams

    async def _admit(self, call: EngineCall):
        """(the response generator, the replica) of a call admitted by some replica: sent again
        while replicas die under it, at most `attempts` times."""
        lost: BaseException | None = None
        for _ in range(self.attempts):
            responses = self._handle.options(stream=True).generate.remote(call)
            try:
                admitted = await anext(responses)
            except BaseException as exc:
                responses.cancel()
                if replica_lost(exc):
                    lost = exc
                    continue
                raise unwrapped(exc) from None
            self._take_report(admitted.report)
            served = SERVED_BY.get()
            if served is not None:
                served.append(admitted.report.replica)
            return responses, admitted.report.replica
        raise EngineDeadError(f"no engine replica could take the request ({self.attempts} tried and lost: {lost})")

    async def reset_prefix_cache(self) -> None:
        """Every engine replica that reported lately forgets its cached prefixes (one gone meanwhile:
        the router sends its call to another replica, which answers that it is not the target)."""
        for report in self._fresh_reports():
            await self._handle.reset_prefix_cache.remote(ReplicaTarget(report.replica))

    async def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    # ---- replica reports ---------------------------------------------------------------------------
    def _take_report(self, report: ReplicaReport) -> None:
        self._reports[report.replica] = report

    def _fresh_reports(self) -> list[ReplicaReport]:
        horizon = time.monotonic() - max(self.report_timeout_s, 3 * self.report_period_s)
        return [report for report in self._reports.values() if report.at >= horizon]

    async def _poll_reports(self) -> None:
        while True:
            await self.poll_reports()
            await asyncio.sleep(self.report_period_s)

    async def poll_reports(self) -> None:
        """Ask every replica heard from for a report, and one more call to any replica (how a new one
        is heard from); a replica silent for `forget_after_s` is forgotten."""
        horizon = time.monotonic() - self.forget_after_s
        self._reports = {name: r for name, r in self._reports.items() if r.at >= horizon}
        for target in [None, *self._reports]:
            try:
                call = self._handle.report.remote(None if target is None else ReplicaTarget(target))
                self._take_report(await asyncio.wait_for(call, self.report_timeout_s))
                self._last_poll_error = None
            except Exception as exc:  # noqa: BLE001 - no replica answered: health says so
                self._last_poll_error = f"{type(exc).__name__}: {exc}"


def merged_stats(stats: list[dict]) -> dict:
    """Several engines' stats (LLMEngine.stats) as one engine's: counts and per-kind counts summed, a
    mean (`mean_*`) averaged, the depth policy's level cap the highest, a name the first engine's."""
    merged: dict = {}
    for key in dict.fromkeys(k for s in stats for k in s):
        values = [s[key] for s in stats if key in s]
        if all(isinstance(v, dict) for v in values):
            merged[key] = {k: sum(v.get(k, 0) for v in values) for k in dict.fromkeys(k for v in values for k in v)}
        elif not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            merged[key] = values[0]
        elif key.startswith("mean_"):
            merged[key] = sum(values) / len(values)
        elif key == "depth_policy_target":
            merged[key] = max(values)
        else:
            merged[key] = sum(values)
    return merged


_EMPTY_STATS = {"num_running": 0, "num_waiting": 0, "num_preemptions": 0, "kv_pages_used": 0, "kv_pages_total": 0,
                "kv_bytes_used_by_kind": {}, "prefix_cache_queries": 0, "prefix_cache_hits": 0}


class RemoteStream:
    """One admitted prompt's outputs from its engine replica (an OutputStream)."""

    def __init__(self, engine: RemoteEngine, call: EngineCall, responses, replica: str):
        self.request_id = call.request_id
        self.replica = replica
        self._engine, self._call, self._responses = engine, call, responses
        self._closed = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        delivered = False
        try:
            while True:
                try:
                    async for out in self._responses:
                        delivered = True
                        yield out
                    return
                except BaseException as exc:
                    if not replica_lost(exc):
                        raise unwrapped(exc) from None
                    if delivered:
                        raise ReplicaLostError(f"the engine replica {self.replica} running this request stopped: "
                                               f"{type(exc).__name__}") from None
                    log.warning("engine replica %s lost before %s started; sending it again", self.replica,
                                self.request_id)
                    self._responses, self.replica = await self._engine._admit(self._call)
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the call: the engine replica aborts the request (its cache pages are freed)."""
        if not self._closed:
            self._closed = True
            self._responses.cancel()
