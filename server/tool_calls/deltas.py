"""What the output side hands the server: parsed calls (`ParsedToolCall`), the deltas of a stream
(`ContentDelta`, `ToolCallDelta`, `StreamEnd`) and `reassemble`, which puts deltas back together as
a client does."""

from __future__ import annotations

import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

_ID_ALPHABET = string.ascii_letters + string.digits


def new_tool_call_id() -> str:
    """An id like OpenAI's: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments_json: str  # compact JSON, as OpenAI's `function.arguments`

    def openai_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass(frozen=True)
class ContentDelta:
    text: str

    def openai_delta(self) -> dict[str, Any]:
        return {"content": self.text}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`: its first carries `id` and `name`, the rest argument text only."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai_delta(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            entry["id"] = self.id
            entry["type"] = "function"
            entry["function"] = {"name": self.name, "arguments": self.arguments}
        else:
            entry["function"] = {"arguments": self.arguments}
        return {"tool_calls": [entry]}


StreamDelta = Union[ContentDelta, ToolCallDelta]


@dataclass(frozen=True)
class StreamEnd:
    deltas: list[StreamDelta]  # what was still held back (whitespace, a tag that never completed)
    tool_called: bool  # any call was emitted: finish_reason "tool_calls" (unless cut off: "length")


def reassemble(deltas: Sequence[StreamDelta]) -> tuple[str | None, list[ParsedToolCall]]:
    """What a client assembles from the deltas: (content or None, calls)."""
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: list[dict[str, str]] = []
    for delta in deltas:
        if isinstance(delta, ToolCallDelta):
            if delta.id is not None:
                assert delta.index == len(calls), "a call's first delta comes in index order"
                calls.append({"id": delta.id, "name": delta.name, "arguments": ""})
            calls[delta.index]["arguments"] += delta.arguments
    return content or None, [ParsedToolCall(c["id"], c["name"], c["arguments"]) for c in calls]
