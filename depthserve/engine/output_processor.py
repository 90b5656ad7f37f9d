"""From what a step sampled to what a caller sees: each sequence's logprobs and incremental text,
the checks that finish it (stop strings, EOS, stop token ids, a complete structured-output
constraint, max_tokens, the context), and the
`RequestOutput`s built from them. The engine applies a `Finish` through its scheduler, which
frees the sequence's pages."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from depthserve.depth import DepthReport
from depthserve.detokenizer import IncrementalDetokenizer
from depthserve.engine.model_runner import PromptLogprob, SeqStepOutput
from depthserve.engine.requests import Request
from depthserve.engine.sequence import Sequence
from depthserve.engine.structured_output import StructuredOutputs
from depthserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from depthserve.sampler import SampledToken


@dataclass(frozen=True)
class Finish:
    """Why a sequence ends after this step (Scheduler.finish's arguments)."""

    reason: str  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop string or stop token id


def eos_token_ids(hf_config: dict, tokenizer: Any) -> set[int]:
    """The end-of-sequence ids of the checkpoint's config and of its tokenizer, together."""
    ids: set[int] = set()
    for value in (hf_config.get("eos_token_id"), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return ids


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def start(self, seq: Sequence) -> None:
        """A new sequence's detokenizer, and its logprob lists where the request asks for them."""
        sampling = seq.sampling
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, skip_special_tokens=sampling.skip_special_tokens,
            stop=sampling.stop, include_stop_str_in_output=sampling.include_stop_str_in_output)
        seq.logprobs = [] if sampling.logprobs is not None else None
        seq.prompt_logprobs = [None] if sampling.prompt_logprobs is not None else None

    def process(self, seq: Sequence, result: SeqStepOutput) -> Finish | None:
        """Take in the sequence's step: its prompt logprobs, its sampled token. Returns why the
        sequence ends now, if it does."""
        self._record_prompt_logprobs(seq, result.prompt_logprobs)
        if result.sampled is not None:
            return self._append_token(seq, result.sampled)
        if result.scheduled.samples and result.fault is None and len(seq.output_token_ids) >= seq.max_tokens:
            return Finish("length")  # max_tokens == 0: prompt scoring only
        return None

    def build(self, request: Request, depth: DepthReport | None) -> RequestOutput:
        """The request's cumulative output so far (its final text once a sequence finished)."""
        first = request.seqs[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=[_completion(seq) for seq in request.seqs],
            finished=request.finished,
            num_cached_tokens=first.num_cached_tokens,
            depth=depth,
            metrics=RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time),
            error=request.error,
        )

    def _append_token(self, seq: Sequence, sampled: SampledToken) -> Finish | None:
        token = sampled.token_id
        seq.output_token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        seq.cumulative_logprob += sampled.logprob
        if seq.logprobs is not None:
            seq.logprobs.append(self._entry(token, sampled.logprob, sampled.rank, sampled.top_logprobs))
        # A complete constraint admits nothing but the end: it stops the sequence even before min_tokens.
        constraint_complete = seq.matcher is not None and StructuredOutputs.accept(seq, token)
        stop_string = seq.detokenizer.add_token(token)
        sampling = seq.sampling
        num_out = len(seq.output_token_ids)
        if stop_string is not None:
            return Finish("stop", stop_string)
        if not sampling.ignore_eos and token in self.eos_token_ids and num_out >= sampling.min_tokens:
            return Finish("stop")
        if token in sampling.stop_token_ids and num_out >= sampling.min_tokens:
            return Finish("stop", token)
        if constraint_complete:
            return Finish("stop")
        if num_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return Finish("length")
        return None

    def _record_prompt_logprobs(self, seq: Sequence, scored: list[PromptLogprob]) -> None:
        collected = seq.prompt_logprobs
        for item in scored:
            if item.position != len(collected):
                continue  # already scored before a preemption
            collected.append(self._entry(seq.prompt_token_ids[item.position], item.logprob, item.rank, item.top))

    def _entry(self, token: int, logprob: float, rank: int, top: list[tuple[int, float]]) -> TokenLogprobs:
        """A token's logprob with the top alternatives' (the token itself keeps its own rank)."""
        entry = {token: Logprob(logprob, rank, self._decode_one(token))}
        for alt_rank, (alt, alt_logprob) in enumerate(top, start=1):
            entry.setdefault(alt, Logprob(alt_logprob, alt_rank, self._decode_one(alt)))
        return entry

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])


def _completion(seq: Sequence) -> CompletionOutput:
    return CompletionOutput(
        index=seq.index,
        text=seq.detokenizer.text(seq.finish_reason is not None),
        token_ids=list(seq.output_token_ids),
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=seq.logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        token_depths=list(seq.output_levels) if seq.plan.elastic is not None else None,
    )
