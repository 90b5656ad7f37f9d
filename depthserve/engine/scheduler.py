"""Continuous batching: which sequences run this step and on how many tokens (no torch).

Each step has a token budget. Running sequences go first (oldest first): a decoding
sequence takes one token, a sequence still in its prompt takes the next chunk. Then waiting
sequences are admitted first-come-first-served while the budget, `max_num_seqs` and free
pages allow; the head of the queue is never overtaken for pages, so a large request is not starved.

Long prompts (docs/server.md, "Scheduling"): a sequence prefilling more than
`long_prefill_token_threshold` tokens is long. Its chunks are capped by their cost, not only by the
budget, so that no step it runs in is much longer than a short request's own step: at most
`long_prefill_chunk_tokens` tokens, fewer as its context grows (attention over thousands of cached
positions costs more than the chunk's own weights), and at least one. In a step where a short prompt
waits to be admitted, a long prefill sits out (that step gives the short prompt its first token and
would otherwise also run the long chunk's attention), but never in two steps running, so it keeps
at least every other step. At most `max_long_partial_prefills` long prompts prefill at once; a long
prompt beyond them waits while shorter ones behind it are admitted, and is admitted first once a
long prefill ends. `_prefill_chunk` is the one place that sizes a chunk.
When pages run out, the newest running sequence is preempted: its pages are freed and it
goes back to the front of the queue, to be recomputed from its tokens (nothing is lost).

Fault isolation: when running a step raised, `isolate` preempts the step's sequences and marks
them; each then runs alone, recomputed from its tokens (which restores every cache and state it
has), until it has passed the tokens of the failed step. A fault that recurs is then raised by
a step of one sequence, which the engine fails alone; the others go on with the same tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from depthserve.engine.block_manager import BlockManager
from depthserve.engine.sequence import Sequence, SequenceStatus
from depthserve.errors import ConfigurationError

if TYPE_CHECKING:
    from depthserve.config import EngineArgs


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    # Admission keeps this fraction of the pages free for running sequences to grow into.
    watermark: float = 0.01
    # A sequence to prefill with more tokens than this is long (0: none is). With chunked prefill only.
    long_prefill_token_threshold: int = 0
    # A long prefill's chunk at context 0, in tokens (0: the threshold).
    long_prefill_chunk_tokens: int = 0
    # Cached positions whose attention costs a chunk as much as its weights: a long prefill's chunk at
    # context c is capped at chunk_tokens / (1 + c / this) tokens (0: the cap does not shrink with the context).
    long_prefill_context_scale: int = 0
    # Long prompts that may be mid-prefill at once.
    max_long_partial_prefills: int = 1

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_model_len: int) -> SchedulerConfig:
        """The scheduler's settings from engine arguments resolved for a device (`EngineArgs.on_device`)."""
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < max_model_len:
            raise ConfigurationError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
        return cls(args.max_num_batched_tokens, args.max_num_seqs, args.enable_chunked_prefill,
                   long_prefill_token_threshold=args.long_prefill_token_threshold,
                   long_prefill_chunk_tokens=args.long_prefill_chunk_tokens,
                   long_prefill_context_scale=args.long_prefill_context_scale,
                   max_long_partial_prefills=args.max_long_partial_prefills)

    def prefill_chunk_cap(self, context: int) -> int | None:
        """The most tokens a long prefill's chunk starting at position `context` may take (None: no cap)."""
        if not self.enable_chunked_prefill or self.long_prefill_token_threshold <= 0:
            return None
        cap = self.long_prefill_chunk_tokens or self.long_prefill_token_threshold
        if self.long_prefill_context_scale > 0:
            cap = cap * self.long_prefill_context_scale // (self.long_prefill_context_scale + context)
        return max(1, cap)

    def is_long_prefill(self, num_tokens: int, num_uncomputed_tokens: int) -> bool:
        """A sequence of `num_tokens` tokens, `num_uncomputed_tokens` of them still to compute, is a long
        prefill: it is prefilling (not decoding its one new token) and its tokens reach past the threshold
        (so a long prompt stays long to its last chunk, whose attention spans all the positions before it)."""
        return (self.enable_chunked_prefill and self.long_prefill_token_threshold > 0
                and num_uncomputed_tokens > 1 and num_tokens > self.long_prefill_token_threshold)


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int
    # The level this step's tokens run at, for a request with a range knob (set by the depth
    # policy after scheduling, depthserve/engine/depth_policy.py); None: the request's fixed knob.
    level: int | None = None
    # The confidence exit (depth_policy): a token of this step may stop below `level` at the first
    # level of its range whose readout's top-1 probability reaches this; None: it runs `level`.
    exit_threshold: float | None = None
    # Prompt tokens by need (EngineArgs.prompt_exit): a prompt token whose next token is in the prompt
    # stops too, at the first level whose readout gives that known token at least `exit_threshold`.
    exit_prompt: bool = False
    # After the step: the level each token ran at, where some stopped below `level` (else None).
    ran_levels: tuple[int, ...] | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """After this step the sequence has computed every known token: sample the next."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._watermark_pages = int(config.watermark * block_manager.num_pages)
        # A long prefill gives way (a one-token chunk) in a step that admits a short prompt, but never in
        # two steps running: the request ids that gave way in the previous step, and in this one.
        self._gave_way: set[str] = set()
        self._giving_way: set[str] = set()
        self._short_prompt_waiting = False

    # ---- queue management ------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queue_stats(self) -> dict[str, int]:
        """Sequences running and waiting, requests running, and preemptions since start."""
        return {
            "num_running": len(self.running), "num_waiting": len(self.waiting),
            "num_running_requests": len({seq.request_id for seq in self.running}),  # the rest are waiting
            "num_preemptions": self.num_preemptions,
        }

    def mean_relative_compute(self) -> float:
        """The running sequences' compute per token relative to the model at its default depth."""
        if not self.running:
            return 1.0
        return sum(seq.plan.relative_compute_estimate for seq in self.running) / len(self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence (done, stopped or aborted) and free its pages at once."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.free(seq)

    # ---- fault isolation -----------------------------------------------------------------
    def isolate(self, scheduled: list[ScheduledSeq]) -> None:
        """The step over `scheduled` failed: recompute each of its sequences alone up to the end of
        its part of that step (see the module docstring)."""
        for item in scheduled:
            seq = item.seq
            if seq.status is SequenceStatus.RUNNING:
                self._preempt(seq)
            seq.isolate_until = max(item.end, seq.isolate_until or 0)

    def step_succeeded(self, scheduled: list[ScheduledSeq]) -> None:
        for item in scheduled:
            seq = item.seq
            if seq.isolate_until is not None and item.end >= seq.isolate_until:
                seq.isolate_until = None

    def _next_isolated(self) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.isolate_until is not None:
                return seq
        return None

    def _schedule_alone(self, seq: Sequence, out: SchedulerOutput) -> None:
        """A step of `seq` alone; other running sequences make room for it if pages run short."""
        bm = self.block_manager
        if seq.status is SequenceStatus.WAITING:
            self._attach_cached_prefix(seq)
        num = self._prefill_chunk(seq, self.config.max_num_batched_tokens)
        target = seq.num_computed_tokens + num
        while not bm.can_grow(seq, target):
            victims = [other for other in self.running if other is not seq]
            if not victims:  # admission checked that the request fits the cache alone
                raise RuntimeError(f"sequence {seq.seq_id} cannot fit the KV cache even alone")
            self._preempt(victims[-1])
            out.preempted.append(victims[-1])
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._start_running(seq)
        bm.grow(seq, target)
        out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num))

    # ---- the step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._gave_way, self._giving_way = self._giving_way, set()
        self._short_prompt_waiting = False
        isolated = self._next_isolated()
        if isolated is not None:
            self._schedule_alone(isolated, out)
            return out
        self._short_prompt_waiting = any(not self._is_long(seq) for seq in self.waiting)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            running = len(out.scheduled)
            budget = self._schedule_waiting(out, budget)
            if len(out.scheduled) == running and self._giving_way:
                self._take_back_way(out, budget)
        return out

    def _take_back_way(self, out: SchedulerOutput, budget: int) -> None:
        """No waiting prompt could be admitted after all: the long prefills that gave way take their
        chunks in this step (nothing was admitted, so the step is as `_schedule_running` left it), and
        a long prompt that gave way at admission is admitted. A running one whose pages cannot grow
        without preempting sits the step out, and runs in the next."""
        self._short_prompt_waiting = False
        for seq in [seq for seq in self.running if seq.request_id in self._giving_way]:
            num = self._prefill_chunk(seq, budget)
            if budget <= 0 or not self.block_manager.can_grow(seq, seq.num_computed_tokens + num):
                continue
            self.block_manager.grow(seq, seq.num_computed_tokens + num)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num))
            budget -= num
        self._schedule_waiting(out, budget)
        self._giving_way -= {item.seq.request_id for item in out.scheduled}

    def _is_long(self, seq: Sequence) -> bool:
        return self.config.is_long_prefill(seq.num_tokens, seq.num_uncomputed_tokens)

    def look_ahead(self, items: list[ScheduledSeq], steps: int) -> int:
        """How many decode steps the scheduled batch runs back to back (engine/static_decode.py
        "Steps ahead"): up to `steps` when every scheduled sequence decodes one token, nothing waits
        to be admitted (a sequence preempted this step waits too) and every sequence's pages grow to
        the tokens ahead without preempting (they then do); no sequence steps past its max_tokens.
        Else 1."""
        if steps <= 1 or self.waiting or not items:
            return 1
        if any(item.num_tokens != 1 or not item.samples or item.seq.isolate_until is not None for item in items):
            return 1
        steps = min([steps] + [item.seq.max_tokens - len(item.seq.output_token_ids) for item in items])
        for item in items:
            if steps <= 1 or not self.block_manager.can_grow(item.seq, item.start + steps):
                return 1  # pages already grown stay with their sequences, which reach them in later steps
            self.block_manager.grow(item.seq, item.start + steps)
        return steps

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num = self._prefill_chunk(seq, budget)
            if num == 0:  # a long prefill giving way
                index += 1
                continue
            target = seq.num_computed_tokens + num
            while not self.block_manager.can_grow(seq, target):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.block_manager.grow(seq, target)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num))
            budget -= num
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        long_prefills = sum(self._is_long(seq) for seq in self.running)
        index = 0  # waiting long prompts left for later sit before it
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[index]
            self._attach_cached_prefix(seq)
            remaining, long = seq.num_uncomputed_tokens, self._is_long(seq)
            num = self._prefill_chunk(seq, budget) if not long or long_prefills < self.config.max_long_partial_prefills else 0
            if num == 0:  # a long prompt beyond max_long_partial_prefills, or giving way
                self._release_waiting(seq)
                index += 1
                continue
            # a model's own split (after a preemption: the prompt, then one token per forward) is not chunking
            if num < remaining and not self.config.enable_chunked_prefill and seq.plan.prefill_chunk is None:
                self._release_waiting(seq)
                break
            # Admit only if the whole prompt fits now (with headroom for running sequences).
            if not bm.can_grow(seq, seq.num_tokens, reserve_pages=self._watermark_pages):
                if not self.running and bm.can_grow(seq, seq.num_tokens):
                    pass  # alone, the watermark must not block progress
                else:
                    self._release_waiting(seq)
                    break
            del self.waiting[index]
            self._start_running(seq)
            bm.grow(seq, seq.num_computed_tokens + num)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num))
            budget -= num
            long_prefills += long
        return budget

    def _prefill_chunk(self, seq: Sequence, budget: int) -> int:
        """The tokens `seq` computes in this step, out of `budget`: its uncomputed tokens (one when it
        decodes), within the budget and, for a long prefill, the cost cap of a chunk at its context;
        0 when a long prefill gives way."""
        fixed = seq.plan.forward_tokens(seq.num_computed_tokens, seq.num_prompt_tokens,
                                        self.config.enable_chunked_prefill)
        if fixed is not None:  # the model's results depend on the split: its chunk is never cut (may overrun the budget)
            return fixed
        num = min(seq.num_uncomputed_tokens, budget)
        if not self._is_long(seq):
            return num
        if self._short_prompt_waiting and seq.request_id not in self._gave_way:
            # The step that gives a waiting short prompt its first token runs without the long chunk,
            # whose attention over its context would lengthen that step.
            self._giving_way.add(seq.request_id)
            return 0
        return min(num, self.config.prefill_chunk_cap(seq.num_computed_tokens))

    def _attach_cached_prefix(self, seq: Sequence) -> None:
        """A waiting sequence that holds no pages starts from its cached prompt prefix, if any."""
        bm = self.block_manager
        if not bm.has(seq) and seq.sampling.prompt_logprobs is None:
            # Prompt logprobs need every prompt position computed: no prefix-cache hits.
            cached = bm.allocate_cached_prefix(seq, seq.plan.cache_key, self.config.enable_chunked_prefill)
            seq.num_computed_tokens = cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        self.running.append(seq)

    def _release_waiting(self, seq: Sequence) -> None:
        # A sequence left waiting holds no pages: prefix-cache rows attached for an admission
        # that failed go back (evictable), else they could starve the sequences ahead of it.
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
