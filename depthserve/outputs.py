"""What the engine returns for a request (shapes follow vLLM's RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from depthserve.depth import DepthReport


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


# One entry per token: token id -> Logprob (the chosen/prompt token plus the top-N alternatives).
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # With a range knob (per-token depth): the level each generated token ran at (the depth of the
    # forward whose logits it was sampled from), parallel to token_ids; None for a fixed knob.
    token_depths: list[int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Engine-side timestamps of a request (time.monotonic(), the engine process's clock)."""

    arrival_time: float
    first_scheduled_time: float | None = None  # left the waiting queue (queue time = this - arrival)
    first_token_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # prompt_logprobs[0] is None (the first token has no prefix); then one entry per prompt token.
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    depth: DepthReport | None = field(default=None)  # what the request spent on depth (depth models)
    metrics: RequestMetrics | None = None
    # Why the request failed (finish_reason "error"): a fault traced to it alone while running it.
    error: str | None = None

    # Convenience accessors for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
