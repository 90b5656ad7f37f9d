"""OpenAI tool calling for chat completions: the request's `tools`/`tool_choice` checked and mapped to
a grammar constraint, the conversation rendered for a chat template, and the model's output parsed
back into `tool_calls`, whole or as a stream of deltas.

One module a job:
    validation.py  the request's `tools` and `tool_choice` checked (400s that name the field), and a
                   parsed call checked against the tools (`tool_call_problem`);
    constraint.py  the tools a request offers and the grammar constraint they make (`ToolSetup`);
    hermes.py      the `<tool_call>` block format both sides share;
    rendering.py   the prompt: the default tool template, or a chat template that renders tools;
    deltas.py      parsed calls and the stream's deltas, as the server sends them;
    streaming.py   the output parser, whole (`parse_tool_calls`) or streamed (`ToolCallStreamParser`).

Import from this package: it re-exports each module's public names.
"""

from depthserve.server.tool_calls.constraint import (
    NO_TOOLS,
    ToolSetup,
    offered_tools,
    tool_call_constraint,
    tool_setup,
)
from depthserve.server.tool_calls.deltas import (
    ContentDelta,
    ParsedToolCall,
    StreamDelta,
    StreamEnd,
    ToolCallDelta,
    new_tool_call_id,
    reassemble,
)
from depthserve.server.tool_calls.hermes import CLOSE_TAG, OPEN_TAG, tool_call_block
from depthserve.server.tool_calls.rendering import (
    message_text,
    render_chat_prompt,
    template_uses_tools,
    tool_conversation,
    tools_system_prompt,
)
from depthserve.server.tool_calls.streaming import ToolCallStreamParser, parse_tool_calls
from depthserve.server.tool_calls.validation import (
    MAX_TOOLS,
    TOOL_NAME_RE,
    FunctionTool,
    InvalidToolChoiceError,
    InvalidToolMessageError,
    NamedToolChoice,
    ToolChoice,
    parse_tool_choice,
    parse_tools,
    tool_call_problem,
)

__all__ = [
    "CLOSE_TAG", "MAX_TOOLS", "NO_TOOLS", "OPEN_TAG", "TOOL_NAME_RE",
    "ContentDelta", "FunctionTool", "InvalidToolChoiceError", "InvalidToolMessageError", "NamedToolChoice",
    "ParsedToolCall", "StreamDelta", "StreamEnd", "ToolCallDelta", "ToolCallStreamParser", "ToolChoice",
    "ToolSetup",
    "message_text", "new_tool_call_id", "offered_tools", "parse_tool_calls", "parse_tool_choice", "parse_tools",
    "reassemble", "render_chat_prompt", "template_uses_tools", "tool_call_block", "tool_call_constraint",
    "tool_call_problem", "tool_conversation", "tool_setup", "tools_system_prompt",
]
