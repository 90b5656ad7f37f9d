"""The prompt of a chat request with tools: the conversation rendered for a chat template.

The default tool template: SmolLM2's chat template (ChatML) knows no tools, so `tool_conversation`
rewrites the messages into plain system/user/assistant turns any chat template renders (the Hermes
convention that vLLM's `hermes` parser reads; hermes.py). The tools offered (all of them for
`auto`/`required`, the named one only for a named choice, none for `none`) go at the end of the
system turn, after the client's own system message if there is one (as Hermes and Qwen2.5 place
them), else as a new system turn. The exact text, for tool_choice `auto` with parallel calls::

    # Tools

    You may call one or more functions to help with the user's request. The functions are
    described as JSON objects, one per line, within <tools></tools> tags:
    <tools>
    {"type": "function", "function": {"name": "get_weather", "description": "...", "parameters": {...}}}
    </tools>

    To call a function, answer with a JSON object holding its name and arguments within
    <tool_call></tool_call> tags, one block per call:
    <tool_call>
    {"name": <function-name>, "arguments": <arguments-json-object>}
    </tool_call>
    Results come back within <tool_response></tool_response> tags.
    Call a function only when it helps; otherwise answer in plain text.

(each paragraph above is one line; see `tools_system_prompt`). The last line depends on
tool_choice and parallel_tool_calls (`_CHOICE_INSTRUCTIONS`):
    auto:      "Call a function only when it helps; otherwise answer in plain text."
    auto, parallel_tool_calls false: "... Make at most one call."
    required:  "Answer with one or more function calls and no other text."
    required, parallel_tool_calls false: "Answer with exactly one function call and no other text."
    named:     'Answer with one call to the function "NAME" and no other text.'
An assistant message with `tool_calls` becomes an assistant turn: its content (if any) and a
newline, then one block per call, blocks separated by a newline, each
`<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` with ARGS the client's JSON
re-written with json.dumps's separators (what the grammar makes the model write). Consecutive
`role: "tool"` messages become one user turn (ChatML templates like SmolLM2's print any role
name, but the model never saw a `tool` role): each result as
`<tool_response>\\nCONTENT\\n</tool_response>`, joined by a newline.

A chat template given with `--chat-template FILE` that uses a `tools` variable renders tools
itself: `render_chat_prompt` passes it the offered tools (OpenAI's shape) and the messages as
sent, with each call's `arguments` decoded to an object (what HF tool templates iterate over).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from depthserve.errors import InvalidRequestError
from depthserve.server.tool_calls.constraint import offered_tools
from depthserve.server.tool_calls.hermes import CLOSE_TAG, OPEN_TAG, tool_call_block
from depthserve.server.tool_calls.validation import (
    FunctionTool,
    InvalidToolMessageError,
    NamedToolChoice,
    ToolChoice,
)

_CHOICE_INSTRUCTIONS = {
    ("auto", True): "Call a function only when it helps; otherwise answer in plain text.",
    ("auto", False): "Call a function only when it helps; otherwise answer in plain text. Make at most one call.",
    ("required", True): "Answer with one or more function calls and no other text.",
    ("required", False): "Answer with exactly one function call and no other text.",
}


def tools_system_prompt(tools: Sequence[FunctionTool], choice: ToolChoice, parallel_calls: bool = True) -> str:
    """The default tool template's section of the system turn (module docstring)."""
    if isinstance(choice, NamedToolChoice):
        instruction = f'Answer with one call to the function "{choice.name}" and no other text.'
    else:
        instruction = _CHOICE_INSTRUCTIONS[(choice, parallel_calls)]
    described = "\n".join(json.dumps(tool.openai_dict(), ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request. The functions are described as "
        "JSON objects, one per line, within <tools></tools> tags:\n"
        f"<tools>\n{described}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and arguments within "
        "<tool_call></tool_call> tags, one block per call:\n"
        f"{OPEN_TAG}\n"
        '{"name": <function-name>, "arguments": <arguments-json-object>}\n'
        f"{CLOSE_TAG}\n"
        "Results come back within <tool_response></tool_response> tags.\n"
        f"{instruction}"
    )


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, None (""), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidToolMessageError(f"only text parts are supported, not {kind!r}", f"{where}[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidToolMessageError("must be a string or a list of text parts", where)


def _call_arguments(call: Any, where: str) -> tuple[str, Any]:
    """(name, decoded arguments) of one entry of an assistant message's `tool_calls`."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidToolMessageError("must be {\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}", where)
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise InvalidToolMessageError("must be a JSON string", f"{where}.function.arguments")
    try:
        return function["name"], json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise InvalidToolMessageError(f"is not JSON: {exc}", f"{where}.function.arguments") from None



def tool_conversation(messages: Sequence[Mapping[str, Any]], tools: Sequence[FunctionTool] = (),
                      choice: ToolChoice = "none", parallel_calls: bool = True) -> list[dict[str, str]]:
    """The default tool template: the messages as {"role", "content"} turns with text content only."""
    turns: list[dict[str, str]] = []
    tool_results: list[str] = []

    def end_tool_results() -> None:
        if tool_results:
            turns.append({"role": "user", "content": "\n".join(tool_results)})
            tool_results.clear()

    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        text = message_text(message.get("content"), f"{where}.content")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidToolMessageError("a tool message needs the id of the call it answers", f"{where}.tool_call_id")
            tool_results.append(f"<tool_response>\n{text}\n</tool_response>")
            continue
        end_tool_results()
        calls = message.get("tool_calls")
        if calls:
            if role != "assistant":
                raise InvalidToolMessageError("only assistant messages carry tool_calls", f"{where}.tool_calls")
            blocks = [tool_call_block(*_call_arguments(call, f"{where}.tool_calls[{j}]")) for j, call in enumerate(calls)]
            text = (text + "\n" if text else "") + "\n".join(blocks)
        turns.append({"role": role, "content": text})
    end_tool_results()

    shown = offered_tools(tools, choice)
    if shown:
        section = tools_system_prompt(shown, choice, parallel_calls)
        if turns and turns[0]["role"] in ("system", "developer"):
            turns[0] = {"role": turns[0]["role"], "content": f"{turns[0]['content']}\n\n{section}"}
        else:
            turns.insert(0, {"role": "system", "content": section})
    return turns


@lru_cache(maxsize=8)
def template_uses_tools(chat_template: str) -> bool:
    """Whether a Jinja chat template reads a `tools` variable (then it renders tools itself)."""
    import jinja2
    from jinja2 import meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateSyntaxError:  # e.g. HF's {% generation %} tag: fall back to the text
        return re.search(r"\btools\b", chat_template) is not None
    return "tools" in meta.find_undeclared_variables(parsed)


def _messages_for_tool_template(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        copy = dict(message)
        copy["content"] = message_text(message.get("content"), f"messages[{i}].content")
        if message.get("tool_calls"):
            calls = []
            for j, call in enumerate(message["tool_calls"]):
                name, arguments = _call_arguments(call, f"messages[{i}].tool_calls[{j}]")
                calls.append({**call, "function": {"name": name, "arguments": arguments}})
            copy["tool_calls"] = calls
        out.append(copy)
    return out


def render_chat_prompt(tokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[FunctionTool] = (),
                       choice: ToolChoice = "none", parallel_calls: bool = True,
                       chat_template: str | None = None) -> str:
    """The prompt text for a chat request: through a template that renders tools itself (given as
    `chat_template`, e.g. read from --chat-template FILE), or the default tool template and the
    template in use (`chat_template`, else the tokenizer's)."""
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template is None:
        raise InvalidRequestError("this model has no chat template; use /v1/completions")
    if template_uses_tools(template):
        shown = offered_tools(tools, choice)
        return tokenizer.apply_chat_template(
            _messages_for_tool_template(messages), tools=[t.openai_dict() for t in shown] or None,
            chat_template=template, add_generation_prompt=True, tokenize=False)
    conversation = tool_conversation(messages, tools, choice, parallel_calls)
    return tokenizer.apply_chat_template(conversation, chat_template=template, add_generation_prompt=True,
                                         tokenize=False)
