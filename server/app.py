"""FastAPI app: routes, auth, request ids, error mapping; `run_server` starts uvicorn."""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from depthserve.engine.async_llm import AsyncLLM, QueueFullError
from depthserve.errors import DepthServeError, EngineDeadError, InvalidRequestError
from depthserve.server.metrics import ServerMetrics
from depthserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from depthserve.server.serving import ADMITTED, ModelNotFoundError, OpenAIServing, sse

logger = logging.getLogger("depthserve.server")
RETRY_AFTER_SECONDS = 1
_OPEN_PATHS = ("/health", "/metrics")


def _error(status: int, message: str, err_type: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, status, param), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        message = f"unknown field '{param}'"
    return (f"{param}: {message}" if param and first.get("type") != "extra_forbidden" else message), param


def build_app(llm: AsyncLLM, served_model_name: str | None = None, api_key: str | None = None,
              depth_presets: dict[str, dict] | None = None) -> FastAPI:
    metrics = ServerMetrics(llm.stats)
    serving = OpenAIServing(llm, served_model_name or llm.model_name, depth_presets, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await llm.shutdown()

    app = FastAPI(title="depthserve", lifespan=lifespan)
    # A plain ASGI middleware: unlike @app.middleware("http") it leaves the client's disconnect
    # visible to the route, which must abort a non-streaming request whose client went away.
    app.add_middleware(RequestIdAndAuth, api_key=api_key)
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.llm = llm

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(_: Request, exc: InvalidRequestError):
        return _error(400, str(exc), "invalid_request_error")

    @app.exception_handler(ModelNotFoundError)
    async def on_model_not_found(_: Request, exc: ModelNotFoundError):
        return _error(404, str(exc.args[0]), "not_found_error", "model")

    @app.exception_handler(QueueFullError)
    async def on_queue_full(_: Request, exc: QueueFullError):
        return _error(503, str(exc), "server_overloaded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, exc: EngineDeadError):
        return _error(503, str(exc), "service_unavailable")

    @app.exception_handler(DepthServeError)
    async def on_engine_error(_: Request, exc: DepthServeError):
        return _error(400, str(exc), "invalid_request_error")

    @app.get("/health")
    async def health():
        if llm.is_healthy:
            return {"status": "ok"}
        return _error(503, "the engine loop is not running", "service_unavailable")

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await llm.reset_prefix_cache()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return serving.list_models()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            serving.preset_depth(body.model)
        return serving.tokenize(body.prompt, body.messages, body.add_special_tokens)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return serving.detokenize(body.tokens)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        request_id = f"cmpl-{request.state.request_id}-{uuid.uuid4().hex[:8]}"
        if body.stream:
            jobs, params, depth = serving.completion_jobs(body)
            return await _stream(serving.completion_stream(body, request_id, jobs, params, depth))
        return await _unless_disconnected(request, serving.completion(body, request_id))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        request_id = f"chatcmpl-{request.state.request_id}-{uuid.uuid4().hex[:8]}"
        if body.stream:
            jobs, params, depth = serving.chat_jobs(body)
            return await _stream(serving.chat_stream(body, request_id, jobs, params, depth))
        return await _unless_disconnected(request, serving.chat(body, request_id))

    return app


class RequestIdAndAuth:
    """Keeps (or makes) the request id, echoes it in X-Request-Id, logs it; checks the API key (_needs_key)."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        request_id = headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        status = []

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        if self.api_key and _needs_key(scope["path"]) and not _authorized(headers, self.api_key):
            response = _error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
            await response(scope, receive, send_with_id)
        else:
            await self.app(scope, receive, send_with_id)
        logger.info("%s %s %s -> %s", request_id, scope.get("method"), scope["path"], status[0] if status else "-")


def _needs_key(path: str) -> bool:
    """The API and the admin routes; /health, /metrics and the tokenizer routes stay open."""
    return path.startswith("/v1") or path == "/reset_prefix_cache"


def _authorized(headers: dict[str, str], api_key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip(), api_key)


async def _stream(chunks: AsyncGenerator[str, None]) -> StreamingResponse:
    """SSE response. The generator's first item (ADMITTED) is taken here, before the response
    starts: admission errors (queue full, engine dead) become HTTP errors, and from then on the
    generator is running, so closing it (client gone, or the response dropped) aborts the request."""
    first = await anext(chunks)
    assert first == ADMITTED, "SSE generators start by admitting their prompts"
    return StreamingResponse(_errors_as_events(chunks), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _errors_as_events(chunks: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """Once a stream has started its status is sent: a failure mid-stream (the engine died, the
    server shuts down) ends it with an error event (and no [DONE]) instead of a cut connection."""
    try:
        async for chunk in chunks:
            yield chunk
    except EngineDeadError as exc:
        yield sse(error_body(str(exc), "service_unavailable", 503))
    except DepthServeError as exc:
        yield sse(error_body(str(exc), "internal_error", 500))
    finally:
        await chunks.aclose()


async def _unless_disconnected(request: Request, work: Awaitable[dict]) -> dict | Response:
    """Run a non-streaming request; abort it (freeing its cache) if the client disconnects."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            return Response(status_code=499)


def run_server(llm: AsyncLLM, host: str, port: int, served_model_name: str | None = None,
               api_key: str | None = None, depth_presets: dict[str, dict] | None = None,
               log_level: str = "info") -> None:
    import uvicorn

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO))
    app = build_app(llm, served_model_name, api_key, depth_presets)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
