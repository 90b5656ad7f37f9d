"""What a chat request's checked tools make of it: the tools its prompt offers and the grammar
constraint the structured-output backend enforces.

`tool_call_constraint(tools, choice, parallel_calls)` -> the `ToolCallConstraint`: `none` (or no
tools): None; `auto`: free text that may end in calls, the arguments of `strict` tools held to their
schema, the others to any JSON object; `required`: one or more calls, arguments valid against their
schemas; a named tool: exactly one call to it. `tool_setup(...)` checks a request's three tool
fields at once (validation.py) into a `ToolSetup`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from depthserve.server.tool_calls.validation import (
    FunctionTool,
    NamedToolChoice,
    ToolChoice,
    parse_tool_choice,
    parse_tools,
)
from depthserve.structured import ToolCallConstraint, ToolSpec

def offered_tools(tools: Sequence[FunctionTool], choice: ToolChoice) -> tuple[FunctionTool, ...]:
    """The tools the prompt shows: none for "none", the named one for a named choice, else all."""
    if choice == "none":
        return ()
    if isinstance(choice, NamedToolChoice):
        return tuple(tool for tool in tools if tool.name == choice.name)
    return tuple(tools)


# Any object: what a non-strict tool's arguments are held to under "auto".
_ANY_OBJECT_SCHEMA: Mapping[str, Any] = {"type": "object"}


def tool_call_constraint(tools: Sequence[FunctionTool], choice: ToolChoice,
                         parallel_calls: bool = True) -> ToolCallConstraint | None:
    """The grammar constraint for a request's tools, or None where nothing is enforced."""
    shown = offered_tools(tools, choice)
    if not shown:
        return None
    if choice == "auto":
        # Once the model opens a call, it is held to a parseable one; a schema only where the client asked.
        specs = tuple(ToolSpec(t.name, t.parameters if t.strict else _ANY_OBJECT_SCHEMA) for t in shown)
        return ToolCallConstraint(specs, require_call=False, parallel_calls=parallel_calls)
    specs = tuple(ToolSpec(t.name, t.parameters) for t in shown)
    if isinstance(choice, NamedToolChoice):
        return ToolCallConstraint(specs, require_call=True, parallel_calls=False)
    return ToolCallConstraint(specs, require_call=True, parallel_calls=parallel_calls)


@dataclass(frozen=True)
class ToolSetup:
    """A chat request's tools, checked: what its prompt offers and what its grammar enforces."""

    tools: tuple[FunctionTool, ...] = ()
    choice: ToolChoice = "none"
    parallel_calls: bool = True

    @property
    def offered(self) -> bool:
        """Tools are offered: the reply is parsed for calls."""
        return bool(offered_tools(self.tools, self.choice))

    def constraint(self) -> ToolCallConstraint | None:
        return tool_call_constraint(self.tools, self.choice, self.parallel_calls)


NO_TOOLS = ToolSetup()


def tool_setup(tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolSetup:
    """A request's `tools`, `tool_choice` and `parallel_tool_calls`, checked (400s name the field)."""
    parsed = parse_tools(tools)
    return ToolSetup(parsed, parse_tool_choice(tool_choice, parsed), parallel_tool_calls is not False)
