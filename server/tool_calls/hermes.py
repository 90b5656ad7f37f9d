"""The Hermes tool-call format, which the prompt (rendering.py) teaches, the grammar enforces and the
parser (streaming.py) reads back: one block per call,

    <tool_call>
    {"name": NAME, "arguments": ARGUMENTS}
    </tool_call>

with the JSON written by json.dumps's separators (what the grammar makes the model write)."""

from __future__ import annotations

import json
from typing import Any

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


def tool_call_block(name: str, arguments: Any) -> str:
    """One call as the model writes it under the grammar (json.dumps's separators)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}"

