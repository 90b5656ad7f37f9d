"""The context-length rule, written once: how many tokens a request may generate (no torch).

A prompt and its completion share the model's context of `max_model_len` tokens. Where a request
asks for more than is left, two callers want two answers, and name theirs as a `ContextOverflow`:
the HTTP server refuses it with a 400 that names the limit (as OpenAI's and vLLM's servers do),
the offline `LLM.generate` cuts `max_tokens` to the rest of the context (as vLLM's `LLM` does).
"""

from __future__ import annotations

from enum import Enum

from depthserve.errors import PromptTooLongError


class ContextOverflow(Enum):
    """What to do with a request whose prompt plus `max_tokens` passes the context."""

    REFUSE = "refuse"  # raise PromptTooLongError naming the limit (the HTTP server)
    CLAMP = "clamp"  # generate up to the end of the context (the offline API)


def completion_budget(prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                      overflow: ContextOverflow) -> int:
    """The tokens a request of `prompt_tokens` may generate; `max_tokens` None means the rest of
    the context.

    Raises PromptTooLongError when the prompt passes the context, or fills it and asks for output
    (a prompt that fills it can still be scored, with max_tokens 0 or None); and, under `REFUSE`,
    when prompt + max_tokens passes it. Under `CLAMP` that request is cut to the rest instead."""
    if overflow is ContextOverflow.REFUSE and max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; the request asks for "
            f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} for the completion): "
            "lower max_tokens or shorten the prompt")
    if prompt_tokens > max_model_len or (prompt_tokens == max_model_len and max_tokens):
        raise PromptTooLongError(f"the prompt has {prompt_tokens} tokens; this model's context is {max_model_len} tokens")
    room = max_model_len - prompt_tokens
    return room if max_tokens is None else min(max_tokens, room)
