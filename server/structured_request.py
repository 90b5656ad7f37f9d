"""A request's structured-output fields, checked and turned into the one constraint the engine
enforces (docs/server.md, "Structured outputs and tools"):

- `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- vLLM's `structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object"}`, and its
  older names `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- a chat request's tool constraint (server/tool_calls/).

At most one of them may constrain a request. Each error is a 400 naming the field it came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from depthserve.structured import (
    Constraint,
    InvalidJsonSchemaError,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    StructuredOutputError,
    StructuredOutputsParams,
)
from depthserve.structured.params import FIELDS as STRUCTURED_OUTPUTS_FIELDS

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


@dataclass(frozen=True)
class RequestConstraint:
    """The constraint a request asks for and the field it came from (400s name it)."""

    constraint: Constraint
    field: str


def request_constraint(req: Any, tools: RequestConstraint | None = None) -> RequestConstraint | None:
    """The one constraint of a completion or chat request body (`tools`: its tool constraint)."""
    found = [c for c in (_response_format(req.response_format), _structured_outputs(req.structured_outputs),
                         _guided(req), tools) if c is not None]
    if len(found) > 1:
        raise StructuredOutputError(
            "a request may be constrained one way only; got " + ", ".join(c.field for c in found), found[1].field)
    return found[0] if found else None


def _response_format(value: Mapping[str, Any] | None) -> RequestConstraint | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise StructuredOutputError(f"must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}",
                                    "response_format.type")
    extra = set(value) - ({"type", "json_schema"} if kind == "json_schema" else {"type"})
    if extra:
        raise StructuredOutputError(f"unknown field(s) {', '.join(sorted(extra))} for type {kind!r}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return RequestConstraint(JsonObjectConstraint(), "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise InvalidJsonSchemaError("must be an object {\"name\", \"schema\", \"strict\"}", "response_format.json_schema")
    unknown = set(spec) - set(JSON_SCHEMA_KEYS)
    if unknown:
        raise InvalidJsonSchemaError(f"unknown field(s) {', '.join(sorted(unknown))}", "response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidJsonSchemaError("a name is required", "response_format.json_schema.name")
    schema = spec.get("schema", {"type": "object"})  # OpenAI's default: any object
    if not isinstance(schema, (Mapping, bool)):
        raise InvalidJsonSchemaError(f"must be a JSON schema object, not {type(schema).__name__}",
                                     "response_format.json_schema.schema")
    return RequestConstraint(JsonSchemaConstraint(schema), "response_format.json_schema.schema")


def _structured_outputs(value: Mapping[str, Any] | None) -> RequestConstraint | None:
    if value is None:
        return None
    unknown = set(value) - set(STRUCTURED_OUTPUTS_FIELDS)
    if unknown:
        raise StructuredOutputError(f"unknown field(s) {', '.join(sorted(unknown))}; expected one of "
                                    f"{', '.join(STRUCTURED_OUTPUTS_FIELDS)}", "structured_outputs")
    given = [name for name in STRUCTURED_OUTPUTS_FIELDS if value.get(name) not in (None, False)]
    field = f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
    return RequestConstraint(_located(lambda: StructuredOutputsParams(**value).constraint(), field), field)


def _guided(req: Any) -> RequestConstraint | None:
    given = {name: getattr(req, name) for name in GUIDED_FIELDS if getattr(req, name) is not None}
    if not given:
        return None
    if len(given) > 1:
        raise StructuredOutputError(f"set one of {', '.join(GUIDED_FIELDS)}; got {', '.join(given)}",
                                    next(iter(given)))
    (name, value), = given.items()
    params = StructuredOutputsParams(**{GUIDED_FIELDS[name]: value})
    return RequestConstraint(_located(params.constraint, name), name)


def _located(build, field: str) -> Constraint:
    try:
        return build()
    except StructuredOutputError as exc:
        raise exc.located(field) from None
