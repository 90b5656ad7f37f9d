"""Checks of what a client sends and of what the model wrote: the request's `tools` and
`tool_choice` (`parse_tools`, `parse_tool_choice`, raising a 400 that names the field) and a parsed
call against the tools it may call (`tool_call_problem`)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

from depthserve.server.tool_calls.deltas import ParsedToolCall
from depthserve.structured import InvalidToolError, StructuredOutputError

TOOL_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128  # OpenAI's limit; it also bounds the grammar a request can make the server compile


class InvalidToolChoiceError(StructuredOutputError):
    """`tool_choice` is not none/auto/required/a named function, or names a function not in `tools`."""


class InvalidToolMessageError(StructuredOutputError):
    """A message's `tool_calls` or a `role: "tool"` message is malformed."""


@dataclass(frozen=True)
class FunctionTool:
    """One entry of `tools`, checked: `{"type": "function", "function": {...}}`."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    strict: bool = False

    def openai_dict(self) -> dict[str, Any]:
        """The tool as the client sent it, less `strict` (which means nothing to the model)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class NamedToolChoice:
    """`tool_choice: {"type": "function", "function": {"name": NAME}}`."""

    name: str


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


def parse_tools(raw: Any) -> tuple[FunctionTool, ...]:
    """The request's `tools`, checked (None or [] -> no tools)."""
    if raw is None:
        return ()
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise InvalidToolError("must be a list of tools", "tools")
    if len(raw) > MAX_TOOLS:
        raise InvalidToolError(f"{len(raw)} tools: at most {MAX_TOOLS}", "tools")
    tools = tuple(_parse_tool(entry, f"tools[{i}]") for i, entry in enumerate(raw))
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise InvalidToolError(f"the name {tool.name!r} is used by another tool", f"tools[{i}].function.name")
        seen.add(tool.name)
    return tools


def _parse_tool(entry: Any, where: str) -> FunctionTool:
    if not isinstance(entry, Mapping):
        raise InvalidToolError("must be an object", where)
    if entry.get("type") != "function":
        raise InvalidToolError(f"type must be 'function', got {entry.get('type')!r}", f"{where}.type")
    function = entry.get("function")
    if not isinstance(function, Mapping):
        raise InvalidToolError("must be an object with a name", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
        raise InvalidToolError(f"{name!r} is not a function name (letters, digits, '_' and '-', 1 to 64 of them)",
                               f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidToolError("must be a string", f"{where}.function.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidToolError("must be true or false", f"{where}.function.strict")
    parameters = function.get("parameters")
    if parameters is not None:
        _check_parameters_schema(parameters, f"{where}.function.parameters")
    return FunctionTool(name, description, parameters, bool(strict))


def _check_parameters_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, Mapping):
        raise InvalidToolError(f"must be a JSON schema object, not {type(schema).__name__}", where)
    if schema.get("type", "object") != "object":
        raise InvalidToolError(f"must describe an object (type 'object'), got type {schema.get('type')!r}", where)
    if "properties" in schema and not isinstance(schema["properties"], Mapping):
        raise InvalidToolError("properties must be an object", where)
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise InvalidToolError("required must be a list of property names", where)
    try:
        import jsonschema
    except ImportError:  # optional: the grammar compile still rejects a broken schema it has to enforce
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p!r}]" for p in exc.path)
        raise InvalidToolError(f"not a valid JSON schema{' at ' + path if path else ''}: {exc.message}", where) from None


def parse_tool_choice(raw: Any, tools: Sequence[FunctionTool]) -> ToolChoice:
    """The request's `tool_choice`, checked against its tools. Absent: "auto" with tools, else "none"."""
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("none", "auto"):
        return "none" if not tools else raw
    if raw == "required":
        if not tools:
            raise InvalidToolChoiceError("'required' needs a non-empty tools list", "tool_choice")
        return "required"
    if isinstance(raw, Mapping):
        if raw.get("type") != "function":
            raise InvalidToolChoiceError(f"type must be 'function', got {raw.get('type')!r}", "tool_choice.type")
        function = raw.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise InvalidToolChoiceError("must name a function: {\"name\": ...}", "tool_choice.function")
        if name not in {tool.name for tool in tools}:
            raise InvalidToolChoiceError(f"names {name!r}, which is not in tools", "tool_choice.function.name")
        return NamedToolChoice(name)
    raise InvalidToolChoiceError(f"must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                                 f"{{\"name\": ...}}}}, got {raw!r}", "tool_choice")


def tool_call_problem(call: ParsedToolCall, tools: Sequence[FunctionTool]) -> str | None:
    """Why a parsed call is not a valid call of one of `tools`, or None. Arguments are checked
    against the schema of `strict` tools (with jsonschema where it is installed); of the others,
    only that they are a JSON object."""
    tool = next((t for t in tools if t.name == call.name), None)
    if tool is None:
        return f"calls {call.name!r}, which is not one of the tools"
    try:
        arguments = json.loads(call.arguments_json)
    except json.JSONDecodeError as exc:
        return f"the arguments of {call.name!r} are not JSON: {exc}"
    if not isinstance(arguments, dict):
        return f"the arguments of {call.name!r} are not a JSON object"
    if not tool.strict:
        return None
    schema = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {},
                                                                   "additionalProperties": False}
    try:
        import jsonschema
    except ImportError:
        return None
    error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(arguments))
    if error is None:
        return None
    path = "".join(f"[{p!r}]" for p in error.absolute_path)
    return f"the arguments of {call.name!r} do not match its parameters{' at ' + path if path else ''}: {error.message}"
