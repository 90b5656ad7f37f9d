"""Requests on their way in: validation (`RequestValidator`, no engine state touched), the accepted
request (`ValidatedRequest`) and the engine's record of a running one (`Request`: its sequences)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from depthserve.archs.base import DepthModel
from depthserve.depth import DepthParams, DepthPlan
from depthserve.engine.block_manager import BlockManager
from depthserve.engine.context_length import ContextOverflow, completion_budget
from depthserve.engine.sequence import Sequence
from depthserve.engine.structured_output import StructuredOutputs
from depthserve.errors import EmptyPromptError, InvalidRequestError, UnadmittableRequestError
from depthserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class ValidatedRequest:
    """A request `RequestValidator.check` accepted: its tokens, its depth plan (normalized knobs
    and the cache layout they need) and max_tokens resolved against the context."""

    prompt_text: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    plan: DepthPlan
    max_tokens: int
    grammar: Any = None  # the compiled structured-output constraint (CompiledGrammar), if any


@dataclass
class Request:
    """A request the engine holds: one sequence per choice (`SamplingParams.n`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None  # set when a fault traced to this request failed it

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


@dataclass(frozen=True, eq=False)
class RequestValidator:
    """Checks a request against the model, its vocabulary, its context and the KV cache."""

    model: DepthModel
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    block_manager: BlockManager
    structured: StructuredOutputs

    def check(self, prompt: str | list[int], sampling: SamplingParams, depth: DepthParams | None,
              overflow: ContextOverflow, grammar: Any = None) -> ValidatedRequest:
        """Raises a typed `InvalidRequestError` subclass for anything wrong with the request. The
        depth plan is made here, once per request; its constraint is compiled here unless `grammar`
        is the caller's compilation of it (`StructuredOutputs.compile`, run off the engine thread)."""
        depth = (depth or DepthParams()).normalized(self.model.depth_knobs())  # "this model": no path in errors
        plan = self.model.plan(depth)
        sampling.validate()
        sampling.check_vocab(self.vocab_size)
        prompt_text, token_ids = self._tokenize(prompt)
        max_tokens = completion_budget(len(token_ids), sampling.max_tokens, self.max_model_len, overflow)
        if not self.block_manager.fits_ever(plan.layout, len(token_ids) + max_tokens):
            raise UnadmittableRequestError(
                f"the KV cache ({self.block_manager.num_pages} pages) can never hold this request "
                f"({len(token_ids)} prompt tokens + {max_tokens} new); lower max_tokens")
        if grammar is None:
            grammar = self.structured.compile(sampling.constraint)
        return ValidatedRequest(prompt_text, token_ids, sampling, plan, max_tokens, grammar)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise EmptyPromptError("the prompt must be a non-empty string or a non-empty list of token ids")
        # exactly int (no bool, no int subclass), in range; checked by builtins that loop in C
        if set(map(type, prompt)) != {int} or min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return None, list(prompt)


def new_request(request_id: str, request: ValidatedRequest, arrival_time: float | None) -> Request:
    """The engine's record of an accepted request: one sequence per choice, each with its own
    generator where the request is seeded. `arrival_time` (time.monotonic()): when it reached the
    server, if earlier than now."""
    sampling = request.sampling
    entry = Request(request_id, request.prompt_text, request.prompt_token_ids, sampling)
    for index in range(sampling.n):
        seq = Sequence(request_id, index, list(request.prompt_token_ids), sampling, request.plan, request.max_tokens)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        seq.generator = _generator(sampling.seed, index)
        seq.matcher = None if request.grammar is None else request.grammar.new_matcher()
        entry.seqs.append(seq)
    return entry


def _generator(seed: int | None, index: int) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed * 0x9E3779B1 + index) % (1 << 63))
