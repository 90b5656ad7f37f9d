"""Text <-> token ids for the server, on a thread of their own (never on the event loop).

Tokenizing a long prompt takes seconds; on the event loop it would stall every other request and
`/health`. The worker uses the server's copy of the tokenizer (ModelInfo; the engine thread's
detokenizers use the original), and refuses text longer than any prompt the model can take before tokenizing it: no
token covers more characters than the vocabulary's longest entry, so a text of more than
`max_model_len x longest entry` characters has more than `max_model_len` tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import jinja2

from depthserve.errors import InvalidRequestError, PromptTooLongError
from depthserve.server.tool_calls import NO_TOOLS, ToolSetup, render_chat_prompt

T = TypeVar("T")


def longest_token_chars(tokenizer) -> int:
    """Characters in the vocabulary's longest entry (byte-level BPE: one character per byte)."""
    added = [token.content for token in tokenizer.added_tokens_decoder.values()]
    return max(len(token) for token in [*tokenizer.get_vocab(), *added])


class TokenizerWorker:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_model_len * longest_token_chars(tokenizer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="depthserve-tokenizer")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- run on the worker thread ------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > self.max_prompt_chars:
            raise PromptTooLongError(
                f"the text has {len(text)} characters: more than {self.max_model_len} tokens, this model's "
                f"context (no token of its vocabulary covers more than {self.max_prompt_chars // self.max_model_len} "
                "characters)")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, conversation: list[dict[str, Any]], tools: ToolSetup = NO_TOOLS) -> list[int]:
        """The messages (OpenAI's shape, tool calls and results included) and the tools offered,
        rendered by the chat template (with the default tool template where the chat template
        knows no tools: server/tool_calls/), as token ids."""
        if self.tokenizer.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions")
        total = sum(len(json.dumps(message, ensure_ascii=False)) for message in conversation)
        if total > self.max_prompt_chars:
            raise PromptTooLongError(
                f"the messages have {total} characters: more than {self.max_model_len} tokens, this model's context")
        try:
            rendered = render_chat_prompt(self.tokenizer, conversation, tools.tools, tools.choice, tools.parallel_calls)
        except (ValueError, jinja2.TemplateError) as exc:  # the template refuses this conversation
            raise InvalidRequestError(f"the model's chat template cannot render these messages: {exc}") from exc
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))
