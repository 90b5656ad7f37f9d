"""The engine behind the HTTP server: the step loop runs in a background thread and each
request gets an async stream of its outputs.

Threading model: only the engine thread touches the engine. Callers put commands (admission
calls, aborts) on a queue that the thread drains between steps; outputs travel back to each
request's asyncio queue with `loop.call_soon_threadsafe`. Torch releases the GIL inside its
ops, so the event loop stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from depthserve.config import EngineArgs
from depthserve.depth import DepthParams
from depthserve.engine.context_length import ContextOverflow
from depthserve.engine.llm_engine import LLMEngine
from depthserve.errors import (
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    UnadmittableRequestError,
)
from depthserve.outputs import RequestOutput
from depthserve.sampling_params import SamplingParams
from depthserve.structured import Constraint
from depthserve.structured.backend import CompiledGrammar

logger = logging.getLogger("depthserve.async_llm")
STATS_INTERVAL_S = 10.0  # the periodic stats line while the engine is busy


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Call:
    """A function for the engine thread to run between steps, and the future awaiting its result."""

    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        self.loop.call_soon_threadsafe(_settle_future, self.future, result, error)


def _settle_future(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting task was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


_ABORT, _STOP, _CALL = "abort", "stop", "call"


class AsyncLLM:
    """`async for out in llm.generate(prompt, params, depth, request_id): ...` yields cumulative outputs."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256):
        self.engine = engine
        self.model_info = engine.model_info()  # before the engine thread starts: read-only from here on
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._dead: BaseException | None = None
        self._stopping = False
        self._exited = False  # set by the engine thread on its way out, under _lock
        self._pending_calls: set[_Call] = set()  # guarded by _lock
        self._stats = self._snapshot()
        self._last_stats_line = (time.monotonic(), 0, 0)  # when, prompt tokens, generated tokens
        self._thread = threading.Thread(target=self._run, name="depthserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, max_waiting_requests: int = 256,
                         depth_presets: dict[str, dict] | None = None) -> AsyncLLM:
        """The engine a server runs (`depthserve serve`, each Ray Serve replica): on a GPU its kernels
        compiled now, not in the first client's request; `depth_presets` checked against the model's
        knob ranges (a typed error if one is out of range)."""
        engine = LLMEngine(engine_args)
        if engine.device.type != "cpu":
            logger.info("warming up on %s (kernels compile on first use)", engine.device)
            engine.warm_up()
        llm = cls(engine, max_waiting_requests=max_waiting_requests)
        for settings in (depth_presets or {}).values():
            DepthParams.from_dict(settings).validate(engine.model.depth_knobs(), llm.model_name)
        return llm

    # ---- state the server reads ---------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.model_info.name

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive() and not self._stopping

    def health_message(self) -> str:
        """Why the engine is not serving (for /health), or "ok"."""
        if self._dead is not None:
            return f"the engine loop stopped on a fault no request could be blamed for: {self._dead!r}"
        if self._stopping:
            return "the server is shutting down"
        if not self._thread.is_alive():
            return "the engine loop is not running"
        return "ok"

    @property
    def num_requests(self) -> int:
        with self._lock:
            return len(self._streams)

    def stats(self) -> dict:
        """The engine's counters as of its last step (a snapshot the engine thread publishes, so
        readers on other threads never see the scheduler mid-step)."""
        return self._stats

    # ---- requests ---------------------------------------------------------------------------
    async def add_requests(
        self,
        prompts: list[str | list[int]],
        sampling_params: SamplingParams,
        depth: DepthParams | None,
        request_ids: list[str],
        overflow: ContextOverflow = ContextOverflow.CLAMP,
    ) -> list["RequestStream"]:
        """Admit several prompts (one HTTP request's) as one unit, all or none, and return their
        output streams. `overflow`: what a prompt + max_tokens past the context gets (the server
        refuses it, depthserve/engine/context_length.py).

        Validation and admission run on the engine thread between steps (the only thread that
        touches the engine), and this returns once they have: the request's typed error if a
        prompt is invalid, UnadmittableRequestError if the queue could never hold this many
        prompts, QueueFullError if it cannot now, EngineDeadError if the engine loop is gone.
        Close (or fully iterate) every stream, or its request runs on.
        """
        arrival = time.monotonic()
        grammar = await self.compile_constraint(sampling_params.constraint)
        streams: list[_Stream] = []
        try:
            for request_id in request_ids:
                streams.append(self._open(request_id, arrival))
            await self._call_on_engine_thread(
                lambda: self._admit(prompts, sampling_params, depth, request_ids, arrival, overflow, grammar))
        except BaseException:
            for request_id in request_ids[: len(streams)]:
                self._close(request_id)
                self._send((_ABORT, request_id))  # admitted after all if the caller was cancelled meanwhile
            raise
        return [RequestStream(self, request_id, stream) for request_id, stream in zip(request_ids, streams)]

    async def compile_constraint(self, constraint: Constraint | None) -> CompiledGrammar | None:
        """Compiles a structured-output constraint on a worker thread, never the engine's (it may
        take up to the grammar backend's time bound); the backend caches it. Raises a
        `StructuredOutputError` (a 400) for a constraint that cannot be enforced."""
        if constraint is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.structured.compile, constraint)

    async def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        depth: DepthParams | None,
        request_id: str,
    ) -> "RequestStream":
        """`add_requests` for one prompt."""
        (stream,) = await self.add_requests([prompt], sampling_params, depth, [request_id])
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        depth: DepthParams | None,
        request_id: str,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs. Cancelling or closing the iterator aborts the request."""
        stream = await self.add_request(prompt, sampling_params, depth, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _admit(self, prompts: list[str | list[int]], sampling_params: SamplingParams, depth: DepthParams | None,
               request_ids: list[str], arrival: float, overflow: ContextOverflow, grammar: Any = None) -> None:
        """On the engine thread: validate every prompt, check the queue, then queue them all.

        The queue holds `max_num_seqs` requests that can run plus `max_waiting_requests` that wait
        (a request counts once whatever its n): requests the engine has not started yet count as
        waiting only beyond the free running slots."""
        validated = [self.engine.check_request(prompt, sampling_params, depth, overflow, grammar) for prompt in prompts]
        capacity = self.engine.args.max_num_seqs + self.max_waiting_requests
        if len(prompts) > capacity:
            raise UnadmittableRequestError(
                f"{len(prompts)} prompts in one request can never be admitted: this server holds at most "
                f"{capacity} requests at once ({self.engine.args.max_num_seqs} running + "
                f"{self.max_waiting_requests} waiting); send fewer prompts per request")
        held = self.engine.num_unfinished_requests
        if held + len(prompts) > capacity:
            waiting = max(held - self.engine.args.max_num_seqs, 0)
            raise QueueFullError(f"{waiting} requests are waiting (at most {self.max_waiting_requests}); "
                                 "try again later")
        for request_id, request in zip(request_ids, validated):
            self.engine.add_validated(request_id, request, arrival_time=arrival)

    async def abort(self, request_id: str) -> None:
        self._send((_ABORT, request_id))

    async def reset_prefix_cache(self) -> None:
        """Forget the cached prefix blocks no request holds, on the engine thread between steps."""
        await self._call_on_engine_thread(self.engine.reset_prefix_cache)

    async def _call_on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps and return its result. Raises
        EngineDeadError, never waits forever, if the loop is gone or goes before it runs `fn`."""
        loop = asyncio.get_running_loop()
        call = _Call(fn, loop, loop.create_future())
        with self._lock:
            if self._exited or self._dead is not None:
                raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
            self._pending_calls.add(call)
        self._send((_CALL, call))
        return await call.future

    def _open(self, request_id: str, arrival: float) -> _Stream:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead!r}")
        if self._stopping:
            raise EngineDeadError("the server is shutting down")
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            stream = _Stream(loop=asyncio.get_running_loop(), arrival=arrival)
            self._streams[request_id] = stream
        return stream

    def _close(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def shutdown(self, grace_seconds: float = 5.0) -> None:
        """Stop taking requests, let running ones finish for up to `grace_seconds`, abort the rest."""
        self._stopping = True
        deadline = time.monotonic() + grace_seconds
        while self.num_requests and time.monotonic() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.05)
        with self._lock:
            remaining = list(self._streams)
        for request_id in remaining:
            self._send((_ABORT, request_id))
            self._deliver(request_id, EngineDeadError("the server shut down before the request finished"))
        self._send((_STOP,))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_until_stopped()
        finally:
            with self._lock:
                self._exited = True
                orphaned, self._pending_calls = self._pending_calls, set()
            reason = f"the engine loop failed: {self._dead!r}" if self._dead else "the engine loop has stopped"
            for call in orphaned:
                call.settle(error=EngineDeadError(reason))

    def _loop_until_stopped(self) -> None:
        try:
            while True:
                if not self._drain_commands():
                    return
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.1)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._stats = self._snapshot()
                self._log_stats_now_and_then()
                for out in outputs:
                    failure = None if out.error is None else RequestFailedError(f"the request failed: {out.error}")
                    self._deliver(out.request_id, failure or out)
        except BaseException as exc:  # the loop died: fail every request at once
            logger.exception("engine loop failed")
            self._dead = exc
            with self._lock:
                ids = list(self._streams)
            for request_id in ids:
                self._deliver(request_id, EngineDeadError(f"the engine loop failed: {exc!r}"))

    def _log_stats_now_and_then(self) -> None:
        """While busy, a line every STATS_INTERVAL_S: requests running and waiting, prompt and
        generation throughput since the last line, KV cache use (as vLLM prints)."""
        now = time.monotonic()
        last_time, last_prompt, last_generated = self._last_stats_line
        if now - last_time < STATS_INTERVAL_S:
            return
        stats = self._stats
        span = now - last_time
        logger.info("running %d, waiting %d requests; prompt %.1f tok/s, generation %.1f tok/s; KV cache %.1f%% "
                    "(%d of %d pages); %d preemptions; mean relative compute x%.2f", stats["num_running"],
                    stats["num_waiting"], (stats["prompt_tokens_computed"] - last_prompt) / span,
                    (stats["tokens_generated"] - last_generated) / span,
                    100 * stats["kv_pages_used"] / stats["kv_pages_total"], stats["kv_pages_used"],
                    stats["kv_pages_total"], stats["num_preemptions"], stats["mean_relative_compute"])
        self._last_stats_line = (now, stats["prompt_tokens_computed"], stats["tokens_generated"])

    def _run_call(self, call: _Call) -> None:
        try:
            result = call.fn()
        except Exception as exc:  # the caller's error, not the loop's
            error, result = exc, None
        else:
            error = None
        # Still pending until here: if `fn` killed the loop (a BaseException), the thread's exit fails it.
        with self._lock:
            self._pending_calls.discard(call)
        call.settle(result, error)

    def _snapshot(self) -> dict:
        return self.engine.stats()

    def _drain_commands(self) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._stats = self._snapshot()
                return True
            kind = command[0]
            if kind == _STOP:
                for request_id in list(self.engine._requests):
                    self.engine.abort_request(request_id)
                return False
            if kind == _CALL:
                self._run_call(command[1])
                continue
            if kind == _ABORT:
                out = self.engine.abort_request(command[1])
                if out is not None:
                    self._deliver(command[1], out)


class RequestStream:
    """The outputs of one admitted request, as an async iterator of cumulative RequestOutputs.

    Closing it before the request finished aborts the request (its cache pages are freed at the
    engine's next step); closing it again, or after the end, does nothing."""

    def __init__(self, llm: AsyncLLM, request_id: str, stream: _Stream):
        self.request_id = request_id
        self._llm = llm
        self._stream = stream
        self._done = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    def newest(self) -> AsyncIterator[RequestOutput]:
        """The outputs, each time skipping to the newest one queued: outputs are cumulative, so a
        consumer slower than the engine (a stream sent on to another process) loses nothing but the
        number of chunks."""
        return self._outputs(newest_only=True)

    async def _outputs(self, newest_only: bool = False) -> AsyncIterator[RequestOutput]:
        try:
            while not self._done:
                item = await self._stream.queue.get()
                while (newest_only and not self._stream.queue.empty() and isinstance(item, RequestOutput)
                       and not item.finished):
                    item = self._stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    self._finish()
                    raise item
                if item.finished:
                    self._finish()
                yield item
        finally:
            self.close()

    def _finish(self) -> None:
        self._done = True
        self._llm._close(self.request_id)

    def close(self) -> None:
        if not self._done:
            self._finish()
            self._llm._send((_ABORT, self.request_id))
