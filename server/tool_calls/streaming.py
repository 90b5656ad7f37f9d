"""The model's output parsed back into content and `tool_calls`.

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
finish_reason "length"); `tool_call_problem` (validation.py) then reports them as not JSON.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from depthserve.server.tool_calls.deltas import (
    ContentDelta,
    ParsedToolCall,
    StreamDelta,
    StreamEnd,
    ToolCallDelta,
    new_tool_call_id,
    reassemble,
)
from depthserve.server.tool_calls.hermes import CLOSE_TAG, OPEN_TAG

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


def parse_tool_calls(text: str, make_id: Callable[[], str] = new_tool_call_id) -> tuple[str | None, list[ParsedToolCall]]:
    """A finished completion's (content or None, tool calls). Never raises on the text."""
    parser = ToolCallStreamParser(make_id)
    deltas = parser.feed(text)
    deltas += parser.finish().deltas
    return reassemble(deltas)
