"""OpenAI tool calling for chat completions: the request's `tools`/`tool_choice` checked and mapped to
a grammar constraint, the conversation rendered for a chat template, and the model's output parsed
back into `tool_calls`, whole or as a stream of deltas.

Request side
    `parse_tools(body["tools"])` -> `FunctionTool`s, `parse_tool_choice(body["tool_choice"], tools)`
    -> "none" | "auto" | "required" | `NamedToolChoice`, both raising a 400 that names the field.
    `tool_call_constraint(tools, choice, parallel_calls)` -> the `ToolCallConstraint` the grammar
    backend enforces: `none` (or no tools): None; `auto`: free text that may end in calls, the
    arguments of `strict` tools held to their schema, the others to any JSON object;
    `required`: one or more calls, arguments valid against their schemas; a named tool: exactly
    one call to it.

Prompt side: the default tool template
    SmolLM2's chat template (ChatML) knows no tools, so `tool_conversation` rewrites the messages
    into plain system/user/assistant turns any chat template renders (the Hermes convention that
    vLLM's `hermes` parser reads). The tools offered (all of them for `auto`/`required`, the named
    one only for a named choice, none for `none`) go at the end of the system turn, after the
    client's own system message if there is one (as Hermes and Qwen2.5 place them), else as a new
    system turn. The exact text, for tool_choice `auto` with parallel calls::

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

Output side
    `parse_tool_calls(text)` -> (content or None, [ParsedToolCall]) for a finished completion;
    `ToolCallStreamParser.feed(delta)` -> OpenAI-shaped deltas as text arrives, `finish()` at the
    end. Both are the same state machine, so a stream's deltas always reassemble to the whole
    text's parse. A block is a call once its head `<tool_call>{"name": "NAME", "arguments": {` is
    complete (whitespace allowed between the pieces); from there the arguments stream as written,
    less the whitespace outside strings (compact JSON, the model's own escapes kept), up to the
    brace that closes them; then `}` and `</tool_call>` are expected. A head that cannot complete
    (not JSON, other keys, arguments not an object) leaves the block in the content. Whitespace
    touching a call is dropped; any other text is content. A completion cut off inside a call
    (max_tokens) keeps the call with the arguments written so far (as OpenAI does, with
    finish_reason "length"); `tool_call_problem` then reports them as not JSON.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, Union

from depthserve.errors import InvalidRequestError
from depthserve.structured import InvalidToolError, StructuredOutputError, ToolCallConstraint, ToolSpec

TOOL_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128  # OpenAI's limit; it also bounds the grammar a request can make the server compile
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


# ==== request side ===============================================================================
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


# ==== prompt side ================================================================================
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


def tool_call_block(name: str, arguments: Any) -> str:
    """One call as the model writes it under the grammar (json.dumps's separators)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}"


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


# ==== output side ================================================================================
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


_JSON_WS = " \t\n\r"


class _Piece(enum.Enum):
    WS = "ws"
    NAME = "name"


# The head of a call up to the arguments' opening brace, and its tail after them.
_HEAD = (OPEN_TAG, _Piece.WS, "{", _Piece.WS, '"name"', _Piece.WS, ":", _Piece.WS, _Piece.NAME, _Piece.WS, ",",
         _Piece.WS, '"arguments"', _Piece.WS, ":", _Piece.WS, "{")
_TAIL = (_Piece.WS, "}", _Piece.WS, CLOSE_TAG)
# A head or tail longer than this is not one (bounds the text re-read after a mismatch).
_MAX_MATCH_CHARS = 256


class _Matcher:
    """Matches a sequence of pieces char by char: literals, optional JSON whitespace, a quoted name
    (no escapes, no '<', so a failed head never hides the start of a later tag)."""

    def __init__(self, pieces: tuple[Any, ...]):
        self.pieces = pieces
        self.piece = 0
        self.offset = 0  # within a literal, or 1 + characters read of a name
        self.name = ""
        self.consumed = ""

    def step(self, char: str) -> bool | None:
        """True: matched through `char`; False: `char` cannot continue; None: more is needed."""
        self.consumed += char
        if len(self.consumed) > _MAX_MATCH_CHARS:
            return False
        while True:
            piece = self.pieces[self.piece]
            if piece is _Piece.WS:
                if char in _JSON_WS:
                    return None
                self.piece += 1
                continue
            if piece is _Piece.NAME:
                if self.offset == 0:
                    if char != '"':
                        return False
                    self.offset = 1
                    return None
                if char == '"':
                    if not self.name:
                        return False
                    return self._next()
                if char in '\\<' or char < " ":
                    return False
                self.name += char
                return None
            if char != piece[self.offset]:
                return False
            self.offset += 1
            return self._next() if self.offset == len(piece) else None

    def _next(self) -> bool | None:
        self.piece += 1
        self.offset = 0
        return True if self.piece == len(self.pieces) else None


class _Mode(enum.Enum):
    CONTENT = "content"
    HEAD = "head"
    ARGUMENTS = "arguments"
    TAIL = "tail"


class ToolCallStreamParser:
    """Splits a completion, fed as text deltas, into content and Hermes tool calls (module docstring)."""

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id):
        self._make_id = make_id
        self._mode = _Mode.CONTENT
        self._held_space = ""  # whitespace in content: dropped if it touches a call
        self._after_call = False  # no content since the last call ended
        self._matcher: _Matcher | None = None
        self._depth = 0  # of the arguments' brackets
        self._in_string = False
        self._escaped = False
        self._calls: list[tuple[str, str, list[str]]] = []  # (id, name, argument pieces)
        # Deltas being built: [index or None for content, id, name, text pieces] (no quadratic copying).
        self._out: list[list[Any]] = []
        self._finished = False

    @property
    def tool_called(self) -> bool:
        return bool(self._calls)

    @property
    def calls(self) -> list[ParsedToolCall]:
        return [ParsedToolCall(call_id, name, "".join(pieces)) for call_id, name, pieces in self._calls]

    def feed(self, text: str) -> list[StreamDelta]:
        if self._finished:
            raise RuntimeError("feed after finish")
        self._run(text)
        return self._take()

    def finish(self) -> StreamEnd:
        if not self._finished:
            self._finished = True
            self._run("")
            if self._mode is _Mode.CONTENT and not self._after_call:
                self._emit_content(self._held_space)
            self._held_space = ""
        return StreamEnd(self._take(), self.tool_called)

    # ---- the state machine -------------------------------------------------------------------
    def _run(self, text: str) -> None:
        pending = text
        while True:
            rest = self._consume(pending)
            if rest is not None:  # a head or tail failed: re-read from where it went wrong
                pending = rest
                continue
            if not self._finished or self._mode not in (_Mode.HEAD, _Mode.TAIL):
                return
            # The text ended inside a head (it never completed) or a tail (the call stands).
            matcher, self._matcher = self._matcher, None
            if self._mode is _Mode.HEAD:
                self._mode = _Mode.CONTENT
                pending = self._head_failed(matcher.consumed)
            else:
                self._mode = _Mode.CONTENT
                return

    def _consume(self, text: str) -> str | None:
        """Process `text`; returns text to re-read when a match failed, else None."""
        for i, char in enumerate(text):
            if self._mode is _Mode.CONTENT:
                self._content_char(char)
            elif self._mode is _Mode.HEAD:
                result = self._matcher.step(char)
                if result is False:
                    consumed = self._matcher.consumed
                    self._matcher, self._mode = None, _Mode.CONTENT
                    return self._head_failed(consumed) + text[i + 1:]
                if result:
                    self._start_call(self._matcher.name)
            elif self._mode is _Mode.ARGUMENTS:
                self._argument_char(char)
            else:
                result = self._matcher.step(char)
                if result is False:
                    consumed = self._matcher.consumed
                    self._matcher, self._mode = None, _Mode.CONTENT
                    return consumed + text[i + 1:]
                if result:
                    self._matcher, self._mode = None, _Mode.CONTENT
        return None

    def _content_char(self, char: str) -> None:
        if char in _JSON_WS:
            self._held_space += char
        elif char == "<":
            self._mode = _Mode.HEAD
            self._matcher = _Matcher(_HEAD)
            self._matcher.step(char)
        else:
            self._flush_space()
            self._emit_content(char)

    def _head_failed(self, consumed: str) -> str:
        """The '<' was text after all; the rest of what the head read is read again."""
        self._flush_space()
        self._emit_content(consumed[0])
        return consumed[1:]

    def _flush_space(self) -> None:
        if not self._after_call:
            self._emit_content(self._held_space)
        self._held_space = ""
        self._after_call = False

    def _start_call(self, name: str) -> None:
        self._held_space = ""
        self._matcher = None
        call_id = self._make_id()
        self._calls.append((call_id, name, []))
        self._out.append([len(self._calls) - 1, call_id, name, []])
        self._mode = _Mode.ARGUMENTS
        self._depth, self._in_string, self._escaped = 0, False, False
        self._argument_char("{")

    def _argument_char(self, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char in _JSON_WS:
            return
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
        self._emit_arguments(char)
        if self._depth == 0:
            self._mode = _Mode.TAIL
            self._matcher = _Matcher(_TAIL)
            self._after_call = True

    # ---- deltas ------------------------------------------------------------------------------
    def _emit_content(self, text: str) -> None:
        if not text:
            return
        if not self._out or self._out[-1][0] is not None:
            self._out.append([None, None, None, []])
        self._out[-1][3].append(text)

    def _emit_arguments(self, text: str) -> None:
        index = len(self._calls) - 1
        self._calls[index][2].append(text)
        if not self._out or self._out[-1][0] != index:
            self._out.append([index, None, None, []])
        self._out[-1][3].append(text)

    def _take(self) -> list[StreamDelta]:
        out, self._out = self._out, []
        return [ContentDelta("".join(pieces)) if index is None else ToolCallDelta(index, "".join(pieces), call_id, name)
                for index, call_id, name, pieces in out]


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


def parse_tool_calls(text: str, make_id: Callable[[], str] = new_tool_call_id) -> tuple[str | None, list[ParsedToolCall]]:
    """A finished completion's (content or None, tool calls). Never raises on the text."""
    parser = ToolCallStreamParser(make_id)
    deltas = parser.feed(text)
    deltas += parser.finish().deltas
    return reassemble(deltas)


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
