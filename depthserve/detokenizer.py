"""Incremental, UTF-8-safe detokenization with stop strings held back.

The offsets technique: keep a short window of recent token ids. `prefix_offset..read_offset` is the
part already turned into text, `read_offset..end` the part not yet shown. Each new token decodes
the window twice at most (cached otherwise) and emits the new characters only once they no longer
end in U+FFFD (an incomplete UTF-8 sequence). Once emitted, the window slides forward, so the
cost per token does not grow with the length of the output.
"""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT = "\ufffd"
# How many prompt tokens give the first output token its context (a leading space, say).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        self._stops = [s for s in stops if s]
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self._ids = self._initial_context(list(prompt_token_ids))
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached
        self._text = ""  # output text so far (cut at the stop string once one matched)
        self._stop_string: str | None = None
        self._flushed = False

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, if any."""
        return self._stop_string

    def add_token(self, token_id: int) -> str | None:
        """Appends one generated token. Returns the stop string if this token completed one (the
        text is then cut at the stop string: before it, or after it with include_stop_str_in_output),
        else None. Tokens added after a stop string or after `text(True)` are ignored."""
        if self._stop_string is not None or self._flushed:
            return None
        self._ids.append(token_id)
        prefix_text = self._window_prefix_text()
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return None  # nothing new yet, or a multi-byte character still incomplete
        self._slide_window()
        return self._append(new_text[len(prefix_text):])

    def text(self, finished: bool) -> str:
        """Text that is safe to show now. While not finished it never ends in an incomplete
        character and holds back a tail that could still start a stop string; successive results
        only grow. Once finished: everything (minus a matched stop string)."""
        if finished:
            self._flush()
            return self._text
        held = self._held_back()
        return self._text[: len(self._text) - held] if held else self._text

    # ---- internals -------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _initial_context(self, prompt_ids: list[int]) -> list[int]:
        """The last few prompt tokens, minus any that end in an incomplete character (the output's
        first bytes must not complete a character of the prompt: they decode on their own)."""
        context = prompt_ids[-_CONTEXT_TOKENS:]
        while context and self._decode(context).endswith(_REPLACEMENT):
            context.pop()
        return context

    def _window_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return self._prefix_text

    def _slide_window(self) -> None:
        """Everything decoded so far is now shown: the unread part becomes the next prefix."""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        if self._prefix_offset:  # drop ids no window will look at again
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _append(self, delta: str) -> str | None:
        """Adds new text; cuts it at the earliest-ending stop string, if one completed."""
        if not delta:
            return None
        search_from = max(0, len(self._text) - (self._max_stop_len - 1))
        self._text += delta
        match = self._find_stop(search_from)
        if match is None:
            return None
        index, stop = match
        self._text = self._text[: index + len(stop)] if self._include_stop else self._text[:index]
        self._stop_string = stop
        return stop

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            index = self._text.find(stop, search_from)
            if index != -1:
                candidate = (index + len(stop), index, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _held_back(self) -> int:
        """How many trailing characters could still be the start of a stop string."""
        if self._stop_string is not None or self._flushed or not self._stops:
            return 0
        for k in range(min(len(self._text), self._max_stop_len - 1), 0, -1):
            tail = self._text[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0

    def _flush(self) -> None:
        """At the end: show what is still undecoded, even if it ends in an incomplete character."""
        if self._flushed:
            return
        self._flushed = True
        if self._stop_string is not None:
            return
        prefix_text = self._window_prefix_text()
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text):
            self._append(new_text[len(prefix_text):])
