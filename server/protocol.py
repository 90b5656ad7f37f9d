"""Request bodies of the OpenAI-compatible API (pydantic), and the error body.

Unknown fields are rejected (400 naming the field) rather than silently ignored, so typos stay
visible. OpenAI fields that do not change the output (`IGNORED_FIELDS`: storage, billing and
tracing hints that OpenAI clients send) are accepted and dropped with a debug log line; OpenAI
fields that would change it and that this server does not implement (`UNSUPPORTED_FIELDS`) are a
400 that says "not supported". The table is in docs/server.md. Types are strict: a
string is not an integer ("3" for max_tokens is a 400, not 3), 1 is not a boolean. Every number
has a finite range (the table in docs/server.md), and every string must be valid Unicode: JSON
can carry a lone surrogate (`"\ud800"`), which no tokenizer can encode, so it is a 400 here.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from depthserve.archs import knob_schemas
from depthserve.errors import InvalidRequestError
from depthserve.sampling_params import (
    MAX_TOP_K,
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    SEED_MAX,
    SEED_MIN,
)

logger = logging.getLogger("depthserve.server")

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
# OpenAI fields that exist in the API but that this server does not implement: they would change
# the output, so a request that sets one is refused.
UNSUPPORTED_FIELDS = (
    "suffix", "best_of", "functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort",
    "web_search_options",
)
# OpenAI fields that never change what is generated (storage, billing tier, tracing and caching
# hints): accepted and ignored, as vLLM does.
IGNORED_FIELDS = ("store", "metadata", "service_tier", "user", "prompt_cache_key", "safety_identifier")
_ASCII_TOKEN_ID = re.compile(r"-?[0-9]+")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in UNSUPPORTED_FIELDS:
                if data.get(name) is not None:
                    raise ValueError(f"'{name}' is not supported by this server")
        return data

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_unicode(value)
        return value


class OpenAIRequest(StrictModel):
    """A request body of an OpenAI endpoint: the ignored fields are dropped before validation."""

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(name in data for name in IGNORED_FIELDS):
            dropped = [name for name in IGNORED_FIELDS if name in data]
            logger.debug("ignoring OpenAI field(s) %s (they do not change the output)", ", ".join(dropped))
            data = {key: value for key, value in data.items() if key not in IGNORED_FIELDS}
        return data

def _check_unicode(value: Any) -> None:
    """Strings anywhere in value (lists, dict keys and values) must encode as UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text must be valid Unicode: {value[exc.start]!r} at character {exc.start} is a "
                             "lone surrogate") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)


class StreamOptions(StrictModel):
    include_usage: bool = False


def _registered_knobs(schema: dict[str, Any]) -> None:
    """The documented shape of `depth`: every registered architecture's knobs (built when the
    schema is asked for, so an architecture registered after this module loaded is in it)."""
    schema["properties"] = knob_schemas()
    schema["additionalProperties"] = False


class DepthRequest(BaseModel):
    """The depth extension: knob name -> value (docs/depth-semantics.md). The names, types and ranges
    are the served model's (GET /v1/models lists them; the schema lists every registered
    architecture's) and are checked by the engine, whose 400 names the knob, what it accepts and
    what was sent (so neither names nor values are fixed here)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_registered_knobs)

    @model_validator(mode="after")
    def _valid_unicode(self) -> "DepthRequest":
        _check_unicode(self.model_extra or {})
        return self

    def knobs(self) -> dict[str, Any]:
        return {name: value for name, value in (self.model_extra or {}).items() if value is not None}


class SamplingFields(OpenAIRequest):
    """Fields shared by completions and chat (OpenAI names, plus vLLM-style extensions)."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, ge=REPETITION_PENALTY_MIN, le=REPETITION_PENALTY_MAX)
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs (docs/server.md): OpenAI's response_format, vLLM's structured_outputs, and
    # vLLM's older guided_* names; checked and turned into one constraint by server/structured_request.py.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    depth: DepthRequest | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not _ASCII_TOKEN_ID.fullmatch(key):  # str.isdigit() would take other scripts' digits too
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must lie in [-100, 100], got {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, value):
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return value


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value


class ChatMessage(StrictModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, sent back in the conversation
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("role")
    @classmethod
    def _known_role(cls, value: str) -> str:
        if value not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _content_or_calls(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        return self

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template and the tool template read it."""
        return self.model_dump(exclude_none=True)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None  # checked by server/tool_calls/ (400s name the entry)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    @model_validator(mode="after")
    def _one_token_limit(self):
        # max_completion_tokens is the current name, max_tokens the deprecated one: either, or both equal
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) "
                             "disagree; send one of them")
        return self


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# ---- responses ------------------------------------------------------------------------------------
class ResponseModel(BaseModel):
    """Response bodies: OpenAI's shapes (plus the depth extension), documented in /openapi.json."""


def _absent_if_none(value: Any) -> bool:
    return value is None


class PromptTokensDetails(ResponseModel):
    cached_tokens: int  # prompt tokens whose KV pages came from the prefix cache


class UsageInfo(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(default=None, exclude_if=_absent_if_none)
    # What the request spent on depth (a depth model only): DepthReport.to_dict(), or for several
    # prompts their sums with each prompt's own report under `per_prompt` (docs/server.md).
    depth: dict[str, Any] | None = Field(default=None, exclude_if=_absent_if_none)


class CompletionLogprobs(ResponseModel):
    """The legacy completions logprobs object (what lm-evaluation-harness reads)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With a range knob (per-token depth): the level each token of this choice (or chunk) ran at.
    token_depths: list[int] | None = Field(default=None, exclude_if=_absent_if_none)


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_absent_if_none)


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob]


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str  # a JSON string, as OpenAI sends it


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the reply is only tool calls
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=_absent_if_none)


class ChatChoice(ResponseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With a range knob (per-token depth): the level each token of this choice (or chunk) ran at.
    token_depths: list[int] | None = Field(default=None, exclude_if=_absent_if_none)


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(ResponseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_absent_if_none)
    content: str | None = Field(default=None, exclude_if=_absent_if_none)
    # Pieces of tool calls: {"index", "id", "type", "function": {"name", "arguments"}} on a call's
    # first piece, {"index", "function": {"arguments"}} on the rest (OpenAI's stream shape).
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=_absent_if_none)


class ChatChunkChoice(ResponseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    # With a range knob (per-token depth): the level each token of this choice (or chunk) ran at.
    token_depths: list[int] | None = Field(default=None, exclude_if=_absent_if_none)


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_absent_if_none)


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "depthserve"
    max_model_len: int
    depth_knobs: dict[str, dict[str, Any]]  # knob name -> KnobSpec fields (name, description, range, default)
    depth_preset: dict[str, Any] | None = None
    supports_chat: bool  # the tokenizer has a chat template: /v1/chat/completions serves this model


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(ResponseModel):
    prompt: str
