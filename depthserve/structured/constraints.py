"""What a request asks its output to match, as plain frozen data: one class per kind of constraint.

The server builds these from `response_format`, `tools`/`tool_choice` and `structured_outputs`;
a grammar backend compiles them (`GrammarBackend.compile`). They hold no backend objects, so the
same constraint can be compiled by llguidance today and by another engine later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

# OpenAI's rule for function names; it also keeps a name safe to splice into a grammar literal.
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


@dataclass(frozen=True)
class JsonSchemaConstraint:
    """The output is one JSON value valid against `schema` (a JSON schema: an object or a boolean)."""

    schema: Mapping[str, Any] | bool


@dataclass(frozen=True)
class JsonObjectConstraint:
    """The output is any JSON object (`response_format: {"type": "json_object"}`)."""


@dataclass(frozen=True)
class RegexConstraint:
    """The whole output matches `pattern` (Rust `regex` syntax: no look-around, no backreferences)."""

    pattern: str


@dataclass(frozen=True)
class ChoiceConstraint:
    """The output is exactly one of `choices`."""

    choices: tuple[str, ...]


@dataclass(frozen=True)
class GrammarConstraint:
    """The output is a sentence of a context-free grammar, in llguidance's Lark syntax or in GBNF."""

    grammar: str


@dataclass(frozen=True)
class ToolSpec:
    """One callable function: its name and the JSON schema of its arguments (None: no arguments)."""

    name: str
    parameters: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ToolCallConstraint:
    """The output is tool calls in the Hermes convention:
    `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, one block per call (blocks
    separated by a newline when `parallel_calls`), each naming one of `tools` with arguments valid
    against that tool's schema.

    `require_call` (tool_choice `required` or a named tool): the output is the calls and nothing
    else. Without it (tool_choice `auto` with strict tools): free text, which may end in calls; once
    `<tool_call>` is written, what follows is enforced.
    """

    tools: tuple[ToolSpec, ...]
    require_call: bool = True
    parallel_calls: bool = True
    tags: tuple[str, str] = field(default=("<tool_call>", "</tool_call>"))


Constraint = Union[JsonSchemaConstraint, JsonObjectConstraint, RegexConstraint, ChoiceConstraint,
                   GrammarConstraint, ToolCallConstraint]
