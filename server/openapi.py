"""The OpenAPI schema says what the server really answers: the error statuses of each route with
the OpenAI error body (FastAPI's default 422 and its `{"detail": ...}` schema never occur here),
and the streaming media type of the completion routes."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every non-2xx answer of this server."""

    error: ErrorDetail


_WHEN = {
    400: "Invalid request (wrong type, out of range, unknown field, prompt too long, never admittable)",
    401: "Missing or wrong API key (only when the server has one)",
    404: "Unknown model id",
    413: "Request body over the server's limit",
    500: "The request failed while running (the fault was traced to it; the server goes on)",
    503: "Queue full (with Retry-After), or the engine has stopped",
}
_API = (400, 401, 413)
_ROUTE_ERRORS: dict[str, tuple[int, ...]] = {
    "/v1/completions": (*_API, 404, 500, 503),
    "/v1/chat/completions": (*_API, 404, 500, 503),
    "/v1/models": (401,),
    "/tokenize": (*_API, 404),
    "/detokenize": _API,
    "/reset_prefix_cache": (401, 503),
    "/health": (503,),
}
_STREAMING = ("/v1/completions", "/v1/chat/completions")


def document_errors(app: FastAPI) -> None:
    """Replace `app.openapi` with one that documents this server's real statuses."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _rewrite(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _rewrite(schema: dict[str, Any]) -> None:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for model in (ErrorDetail, ErrorResponse):
        components[model.__name__] = model.model_json_schema(ref_template="#/components/schemas/{model}")
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in _ROUTE_ERRORS.get(path, ()):
                responses[str(status)] = {"description": _WHEN[status],
                                          "content": {"application/json": {"schema": error_ref}}}
            if path in _STREAMING:
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {})["text/event-stream"] = {
                    "schema": {"type": "string", "description": "with stream: true, SSE chunks ending in [DONE]"}}
