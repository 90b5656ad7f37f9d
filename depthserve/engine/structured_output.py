"""The engine's side of structured outputs (docs/server.md, "Structured outputs and tools").

A request's constraint is compiled once, before admission (`StructuredOutputs.compile`: its errors
are 400s); each of its sequences gets its own matcher. Each step, the matchers of the rows that
sample are asked for their allowed tokens (`start_step`): on a worker thread while the model runs
where a core is free for it (`overlap`: a GPU engine, or a CPU engine whose threads leave a core
idle), else before the forward pass on the engine thread, row by row. On a CPU whose every core
runs the model's threads, any second busy thread slowed each step by far more than the fill costs
(it preempts one of the forward's threads, and the others wait for that one at every barrier);
the masks are applied to those rows' logits after `compute_logits` and before penalties, temperature
and the sampler (`StepMasks.apply`), so greedy and sampled tokens, `n > 1` and the logprobs all see
the masked distribution. The output processor feeds each sampled token back (`accept`) and ends a
sequence whose constraint is complete. Unconstrained rows are never touched.

The grammar backend is built from the engine's tokenizer on the first constrained request (about
two seconds for a 49k vocabulary), so engines that never see one never pay for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any

import torch

from depthserve.engine.sequence import Sequence
from depthserve.errors import ConstraintViolationError
from depthserve.structured.backend import BitmaskFillWorker, CompiledGrammar, GrammarBackend, GrammarMatcher
from depthserve.structured.bitmask import BITS_PER_WORD, apply_token_bitmask_
from depthserve.structured.constraints import Constraint
from depthserve.structured.factory import create_grammar_backend


# (logits [B, V] fp32, bitmask [R, W] int32, logits row of each bitmask row [R] int64, limit) -> None, in place
NativeApply = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]


@dataclass
class StepMasks:
    """One step's masks: row `i` of `bitmask` is for the step's `rows[i]`-th sampled row."""

    rows: list[int]  # positions among the step's sampled rows, ascending
    bitmask: torch.Tensor  # [len(rows), words] int32, filled by the worker
    fill: Future[None]
    _row_of: dict[int, int] = field(default_factory=dict)  # seq_id -> bitmask row
    native_apply: NativeApply | None = None  # the native CPU kernel (kernels/cpu_native.py), where it loads

    def wait(self) -> None:
        self.fill.result()

    def settle(self) -> None:
        """Waits for the fill to end, whatever its outcome (the step is over; an error surfaced
        through `apply` already, if the step got that far)."""
        futures_wait([self.fill])

    def for_sequence(self, seq_id: int) -> torch.Tensor | None:
        """The bitmask row of a sequence of this step (the fill finished), or None if unconstrained."""
        row = self._row_of.get(seq_id)
        if row is None:
            return None
        self.wait()
        return self.bitmask[row]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Masks, in place, the constrained rows of the step's sampled logits [sampled rows, V]."""
        self.wait()
        if (self.native_apply is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
                and logits.stride(1) == 1):
            limit = min(logits.shape[1], self.bitmask.shape[1] * BITS_PER_WORD)  # as apply_token_bitmask_'s default
            self.native_apply(logits, self.bitmask, torch.tensor(self.rows, dtype=torch.long), limit)
            return logits
        return apply_token_bitmask_(logits, self.bitmask, self.rows)


class StructuredOutputs:
    """Compiles constraints (thread-safe: the async server compiles off the engine thread) and runs
    each step's mask fill beside the model."""

    def __init__(self, tokenizer: Any, eos_token_ids: Seq[int], overlap: bool, backend: str = "llguidance",
                 native_apply: NativeApply | None = None):
        self._tokenizer = tokenizer
        self._native_apply = native_apply
        self.overlap = overlap
        self._eos_token_ids = sorted(eos_token_ids)
        self._backend_name = backend
        self._backend: GrammarBackend | None = None
        self._worker: BitmaskFillWorker | None = None
        self._lock = threading.Lock()
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = create_grammar_backend(self._tokenizer, self._eos_token_ids, self._backend_name)
                if self.overlap:
                    self._worker = BitmaskFillWorker(self._backend)
            return self._backend

    def compile(self, constraint: Constraint | None) -> CompiledGrammar | None:
        """The compiled constraint (cached by the backend), or None for none; raises a
        `StructuredOutputError` (a 400) for a constraint that cannot be enforced."""
        return None if constraint is None else self.backend.compile(constraint)

    def start_step(self, sampled: list[Sequence]) -> StepMasks | None:
        """Starts filling the masks of the constrained ones among the step's sampled sequences (in
        the order their logits will have); None when there are none."""
        rows = [i for i, seq in enumerate(sampled) if seq.matcher is not None]
        if not rows:
            return None
        backend = self.backend
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = backend.allocate_bitmask(max(len(rows), 2 * self._bitmask.shape[0]))
        bitmask = self._bitmask[: len(rows)]
        matchers: list[GrammarMatcher] = [sampled[i].matcher for i in rows]
        if self.overlap:
            fill = self._worker.submit(matchers, bitmask)
        else:
            # Row by row on this thread: the backend's batched fill hands the rows to its own thread
            # pool, whose threads then spin beside the forward pass (+12% a step at 32 rows, against
            # +3% this way, on the 2-core Xeon).
            fill = Future()
            try:
                for row, matcher in enumerate(matchers):
                    matcher.fill_bitmask(bitmask, row)
                fill.set_result(None)
            except Exception as exc:  # noqa: BLE001 - raised where the masks are used, as from the worker
                fill.set_exception(exc)
        return StepMasks(rows, bitmask, fill, {sampled[i].seq_id: j for j, i in enumerate(rows)}, self._native_apply)

    @staticmethod
    def accept(seq: Sequence, token_id: int) -> bool:
        """Feeds a sampled token to the sequence's matcher; True when the constraint is now complete
        (nothing but the end may follow). Raises `ConstraintViolationError` if the token breaks it."""
        matcher = seq.matcher
        if not matcher.accept_token(token_id):
            raise ConstraintViolationError(
                f"token {token_id} does not continue the output's constraint: {matcher.error or 'rejected'}")
        return matcher.is_finished()
