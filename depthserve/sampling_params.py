"""Per-request sampling settings (vLLM-compatible names and defaults).

Every field has a finite documented range (`validate`, and the table in docs/server.md): no
setting can drive the sampler's arithmetic to inf or NaN. `repetition_penalty` is the one vLLM
leaves open above 0; a penalty of 1e-40 divides a logit of 5 into inf, so it is held to
[REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from depthserve.errors import InvalidSamplingParamsError
from depthserve.structured.constraints import Constraint
from depthserve.structured.params import StructuredOutputsParams, as_constraint

_GREEDY_EPS = 1e-5
REPETITION_PENALTY_MIN = 0.01
REPETITION_PENALTY_MAX = 10.0
MAX_TOP_K = (1 << 31) - 1
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the end of the context
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus top-k
    prompt_logprobs: int | None = None  # None: no prompt logprobs; k >= 0 as above
    skip_special_tokens: bool = True
    # What the output must match (a JSON schema, regex, choice, grammar or tool calls), enforced by
    # masking the logits each step: vLLM's StructuredOutputsParams, or a constraint itself.
    structured_outputs: StructuredOutputsParams | Constraint | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def constraint(self) -> Constraint | None:
        """The constraint `structured_outputs` asks for (StructuredOutputError if it is malformed)."""
        return as_constraint(self.structured_outputs)

    def validate(self) -> None:
        def fail(msg: str) -> None:
            raise InvalidSamplingParamsError(msg)

        if not _is_int(self.n) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            fail(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            fail(f"top_k must be -1 or 0 (disabled) or an integer in [1, {MAX_TOP_K}], got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                fail(f"{name} must be in [-2, 2], got {value!r}")
        if (not _is_number(self.repetition_penalty)
                or not REPETITION_PENALTY_MIN <= self.repetition_penalty <= REPETITION_PENALTY_MAX):
            fail(f"repetition_penalty must be in [{REPETITION_PENALTY_MIN}, {REPETITION_PENALTY_MAX}] "
                 f"(1 = off), got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    fail(f"logit_bias keys must be token ids (non-negative ints), got {token!r}")
                if not _is_number(bias) or not -100 <= bias <= 100:
                    fail(f"logit_bias values must be in [-100, 100], got {bias!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            fail(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            fail(f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop must be a non-empty string or a list of non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= 20):
                fail(f"{name} must be an integer in [0, 20], got {value!r}")
        self.constraint  # noqa: B018 - raises for a malformed structured_outputs

    def check_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in its vocabulary."""
        for token in list(self.logit_bias or {}) + self.stop_token_ids:
            if token >= vocab_size:
                raise InvalidSamplingParamsError(
                    f"token id {token} is outside the vocabulary (size {vocab_size})"
                )


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
