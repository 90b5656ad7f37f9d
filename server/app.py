"""FastAPI app: routes (and the playground page at /, from static/), auth, request ids, body limit,
error mapping; `run_server` starts uvicorn.

Every non-2xx answer has the OpenAI error body (`protocol.error_body`): validation errors,
typed engine errors (each `DepthServeError` carries its status), Starlette's 404/405, an
oversized body (413) and, as a last resort, any unexpected exception (500, logged with its
traceback; the connection stays usable).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.resources
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from depthserve.engine.async_llm import AsyncLLM
from depthserve.engine.client import EngineClient
from depthserve.errors import DepthServeError
from depthserve.server.connections import (MAX_HEADER_BYTES, ConnectionLimits, head_too_large_message, request_head_bytes,
                                          uvicorn_config)
from depthserve.server.metrics import ServerMetrics
from depthserve.server.openapi import document_errors
from depthserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    error_body,
)
from depthserve.server.serving_chat import OpenAIServingChat
from depthserve.server.serving_completion import OpenAIServingCompletion
from depthserve.server.serving_engine import ADMITTED, OpenAIServing, sse
from depthserve.server.tokenization import TokenizerWorker

logger = logging.getLogger("depthserve.server")
DEFAULT_MAX_BODY_BYTES = 4 << 20
_HTTP_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error"}
# The playground (GET /): plain HTML, CSS and JavaScript shipped in the package, nothing fetched from elsewhere.
STATIC_DIR = Path(__file__).resolve().parent / "static"


def _error(status: int, message: str, err_type: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, status, param), status_code=status, headers=headers)


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def error_response(exc: DepthServeError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return _error(exc.status, str(exc), exc.error_type, getattr(exc, "param", None), headers)


def _validation_message(exc: RequestValidationError, content_type: str) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    kind, where = first.get("type"), tuple(first.get("loc", ()))
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if kind == "json_invalid":  # loc is ("body", character offset): the offset is no parameter
        reason = str(first.get("ctx", {}).get("error", message)).removesuffix(" at").strip()
        offset = where[1] if len(where) > 1 else "?"
        return f"the body is not valid JSON: {reason} at character {offset}", None
    if where == ("body",) and kind in ("missing", "model_attributes_type", "dict_type", "model_type"):
        # no body, or one that is not a JSON object
        if not content_type.startswith("application/json"):
            return f"the body must be a JSON object sent as application/json, not {content_type or 'no content type'}", None
        return "the body must be a JSON object" + (" (it is empty)" if kind == "missing" else ""), None
    param = ".".join(str(part) for part in where if part != "body") or None
    if kind == "extra_forbidden":
        return f"unknown field '{param}'", param
    return (f"{param}: {message}" if param else message), param


def build_app(llm: EngineClient, served_model_name: str | None = None, api_key: str | None = None,
              depth_presets: dict[str, dict] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              chat_template: str | None = None) -> FastAPI:
    """The app. `chat_template` (Jinja text, `--chat-template FILE`) replaces the model's chat template
    in this app's copy of the tokenizer."""
    tokenizer = llm.model_info.tokenizer
    if chat_template is not None:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = chat_template
    metrics = ServerMetrics(llm.stats, served_model_name or llm.model_name, llm.model_info.depth_knobs)
    worker = TokenizerWorker(tokenizer, llm.model_info.max_model_len)
    shared = (llm, served_model_name or llm.model_name, depth_presets, metrics, worker)
    serving = OpenAIServing(*shared)
    completions = OpenAIServingCompletion(*shared)
    chats = OpenAIServingChat(*shared)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await llm.shutdown()
        worker.shutdown()

    app = FastAPI(title="depthserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    # A plain ASGI middleware: unlike @app.middleware("http") it leaves the client's disconnect
    # visible to the route, which must abort a non-streaming request whose client went away.
    app.add_middleware(RequestIdAuthAndLimit, api_key=api_key, max_body_bytes=max_body_bytes)
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.llm = llm

    def count_refused(request: Request, status: int) -> None:
        """A generation request answered 4xx (bad body, unknown model, bad depth) is a finished
        request too: outcome "invalid" (refused at admission for load: "rejected")."""
        if 400 <= status < 500 and request.url.path in GENERATION_PATHS:
            metrics.requests.labels(outcome="invalid").inc()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc, request.headers.get("content-type", ""))
        count_refused(request, 400)
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(DepthServeError)
    async def on_engine_error(request: Request, exc: DepthServeError):
        count_refused(request, exc.status)
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException):
        if isinstance(exc, _BodyTooLarge):
            return _too_large(max_body_bytes)
        err_type = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        return _error(exc.status_code, str(exc.detail), err_type, headers=exc.headers)

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    add_api_docs(app)

    @app.get("/health")
    async def health():
        if llm.is_healthy:
            return {"status": "ok"}
        return _error(503, llm.health_message(), "service_unavailable")

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await llm.reset_prefix_cache()
        return {"status": "ok"}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return serving.list_models()

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str):
        return serving.retrieve_model(model_id)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            serving.preset_depth(body.model)
        return await serving.tokenize(body.prompt, body.messages, body.add_special_tokens)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest):
        return await serving.detokenize(body.tokens)

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completion(body: CompletionRequest, request: Request):
        request_id = f"cmpl-{request.state.request_id}-{uuid.uuid4().hex[:8]}"
        if body.stream:
            return await _stream(completions.stream(body, request_id, await completions.prepare(body)))
        return await _unless_disconnected(request, completions.complete(body, request_id))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat(body: ChatCompletionRequest, request: Request):
        request_id = f"chatcmpl-{request.state.request_id}-{uuid.uuid4().hex[:8]}"
        if body.stream:
            return await _stream(chats.stream(body, request_id, await chats.prepare(body)))
        return await _unless_disconnected(request, chats.complete(body, request_id))

    document_errors(app)
    return app


class RequestIdAuthAndLimit:
    """Keeps (or makes) the request id, echoes it in X-Request-Id, logs it; checks the API key
    (_needs_key); refuses a body over `max_body_bytes` with 413, by its Content-Length before
    reading anything or, sent without one, as soon as it passes the limit; answers an exception
    that escaped every handler with a 500 error body instead of a dropped connection.

    (FastAPI's own `max_body_size` would answer a declared oversize length with Starlette's
    plain-text 413 in place of any response the app sends: not the OpenAI error body.)"""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        request_id = _client_request_id(headers.get("x-request-id")) or f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        status = []
        started = time.monotonic()
        reason = []  # an error body's message, for the access line

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            elif message["type"] == "http.response.body" and status and status[0] >= 400 and not reason:
                reason.append(_error_message(message.get("body", b"")))
            await send(message)

        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise _BodyTooLarge()  # an HTTPException: FastAPI passes it to the handler above
            return message

        refusal = _auth_refusal(scope, headers, self.api_key) if self.api_key and _needs_key(scope["path"]) else None
        if request_head_bytes(scope) > MAX_HEADER_BYTES:  # one that arrived in pieces never gets here (h11)
            await _error(431, head_too_large_message(), "request_header_fields_too_large")(scope, receive, send_with_id)
        elif refusal is not None:
            await refusal(scope, receive, send_with_id)
        elif _declared_length(headers) > self.max_body_bytes:
            await _too_large(self.max_body_bytes)(scope, receive, send_with_id)
        else:
            try:
                await self.app(scope, receive_within_limit, send_with_id)
            except ClientDisconnect:  # gone, or closed by the body deadline (server/connections.py): no answer
                reason.append("the connection closed before the request body arrived")
            except Exception:
                logger.exception("%s %s %s failed", request_id, scope.get("method"), scope["path"])
                if status:  # the response has started: nothing better to send than a cut connection
                    raise
                response = _error(500, "internal server error (logged on the server)", "internal_error")
                await response(scope, receive, send_with_id)
        # One access line per request (polls of /health and /metrics only at debug level).
        level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
        logger.log(level, "%s %s %s %s in %.0f ms%s", request_id, scope.get("method"), scope["path"],
                   status[0] if status else "-", 1000 * (time.monotonic() - started),
                   f": {reason[0]}" if reason and reason[0] else "")


def add_api_docs(app: FastAPI) -> None:
    """Swagger UI 5 at /docs from the assets the `swagger-ui-py` package ships, served by this server:
    FastAPI's default page loads them from a CDN and is blank offline. No validator badge either
    (Swagger UI would send the schema to validator.swagger.io)."""
    from fastapi.openapi.docs import get_swagger_ui_html

    assets = importlib.resources.files("swagger_ui") / "static"
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(assets)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def api_docs():
        return get_swagger_ui_html(
            openapi_url=app.openapi_url, title=f"{app.title} API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png", swagger_ui_parameters={"validatorUrl": None})


DOCS_ASSETS = "/docs-assets"
QUIET_PATHS = ("/health", "/metrics")


MAX_REQUEST_ID_CHARS = 128  # a client's X-Request-Id longer than this is cut, in the reply and the logs


def _client_request_id(value: str | None) -> str | None:
    """The client's request id as echoed and logged: at most MAX_REQUEST_ID_CHARS printable characters."""
    if not value:
        return None
    kept = "".join(c for c in value[:MAX_REQUEST_ID_CHARS] if c.isprintable())
    return kept or None


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self) -> None:
        super().__init__(status_code=413)


def _too_large(max_body_bytes: int) -> JSONResponse:
    return _error(413, f"the request body is larger than this server's limit of {max_body_bytes} bytes "
                  "(serve --max-body-mb)", "request_too_large")


def _declared_length(headers: dict[str, str]) -> int:
    try:
        return int(headers.get("content-length", "0"))
    except ValueError:
        return 0


def _needs_key(path: str) -> bool:
    """The API, the tokenizer routes and the admin route; /health and /metrics stay open."""
    return path.startswith("/v1") or path in ("/tokenize", "/detokenize", "/reset_prefix_cache")


def _auth_refusal(scope, headers: dict[str, str], api_key: str) -> JSONResponse | None:
    """The answer to a request without the key: a 401; a 400 for more than one Authorization header,
    since which one would count is ambiguous (proxies and frameworks differ; docs/server.md, "Errors")."""
    count = sum(1 for name, _ in scope.get("headers", []) if name.lower() == b"authorization")
    if count > 1:
        return _error(400, f"{count} Authorization headers: send exactly one", "invalid_request_error",
                      "Authorization")
    if not _authorized(headers, api_key):
        return _error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
    return None


def _authorized(headers: dict[str, str], api_key: str) -> bool:
    """Compared as bytes: a token with non-ASCII bytes (the header decoded as latin-1) is simply wrong
    (hmac.compare_digest refuses non-ASCII str)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    sent = token.strip().encode("latin-1")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, api_key.encode("utf-8"))


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
    except DepthServeError as exc:
        yield sse(error_body(str(exc), exc.error_type, exc.status))
    finally:
        await chunks.aclose()


async def _unless_disconnected(request: Request, work: Awaitable[BaseModel]) -> BaseModel | Response:
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
               log_level: str = "info", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               chat_template: str | None = None, limits: ConnectionLimits = ConnectionLimits()) -> None:
    import uvicorn

    configure_logging(log_level)
    app = build_app(llm, served_model_name, api_key, depth_presets, max_body_bytes, chat_template)
    names = [served_model_name or llm.model_name]
    names += [f"{names[0]}:{preset}" for preset in depth_presets or {}]
    logger.info("serving %s at http://%s:%d (OpenAI API under /v1, API docs at /docs)%s", ", ".join(names),
                host, port, "; API key required" if api_key else "")
    uvicorn.Server(uvicorn_config(app, host, port, log_level, limits)).run()


def configure_logging(log_level: str) -> None:
    """depthserve's log lines on stderr (done before the model loads, so its start-up lines show)."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
