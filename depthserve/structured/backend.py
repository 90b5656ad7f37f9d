"""The grammar-backend interface: what the engine needs from a structured-output engine.

A backend is built once per model from its tokenizer. Per request it compiles the constraint once
(`compile`, before admission: errors are 400s) into a `CompiledGrammar`, from which each sequence
(each of `n` choices) gets its own `GrammarMatcher`. Per decode step the engine fills one bitmask row
per constrained sequence (`fill_bitmask`, batched, off the GIL: it can run on a worker thread while
the model runs), masks the logits (`bitmask.apply_token_bitmask_`), samples, and feeds the sampled
token back (`accept_token`). `rollback` undoes accepted tokens, for speculative decoding.

The shape follows llguidance and xgrammar alike (compiled grammar -> matcher; int32 bitmask rows),
so either can implement it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from depthserve.structured.constraints import Constraint


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer facts a backend was built with."""

    vocab_size: int  # tokens the bitmask covers (the tokenizer's; a model's padded width may be larger)
    eos_token_ids: tuple[int, ...]  # allowed exactly where the constraint may end
    special_token_ids: tuple[int, ...]  # never allowed inside constrained text


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on compiling and running one constraint; exceeding one is a 400, never a stalled thread."""

    compile_timeout_s: float = 5.0
    max_constraint_chars: int = 1_000_000  # the schema/grammar text, before compiling
    max_choices: int = 10_000  # a choice list's strings (its lexer takes ~2.4 kB a choice)
    max_grammar_symbols: int = 500_000  # llguidance max_grammar_size
    initial_lexer_fuel: int = 1_000_000  # regex work while compiling (~50k per ms)
    step_lexer_fuel: int = 200_000  # regex work per mask (~14k per ms)
    step_max_items: int = 50_000  # Earley items per mask (~20k per ms)
    max_lexer_states: int = 250_000  # lexer memory (1-2 kB per state)


@runtime_checkable
class GrammarMatcher(Protocol):
    """The constraint's state for one sequence. Not thread-safe: one step's fill, then its accept."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (CPU, int32, contiguous)."""

    def accept_token(self, token_id: int) -> bool:
        """Advances past `token_id`; False if the constraint did not allow it (the matcher is then in
        error). An EOS token is accepted where the constraint may end, and finishes it."""

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, in order, the constraint would accept from here (state unchanged)."""

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""

    def is_finished(self) -> bool:
        """The constraint is complete: nothing but EOS may follow (or EOS was accepted)."""

    def eos_allowed(self) -> bool:
        """The text so far satisfies the constraint, so the sequence may end here."""

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a rejected token, a per-step bound exceeded), or None."""

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state (for `n > 1` or beam-like forks)."""


@runtime_checkable
class CompiledGrammar(Protocol):
    """A constraint compiled against one tokenizer; immutable, shared by every sequence that uses it."""

    constraint: Constraint

    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the start of the constraint."""


@runtime_checkable
class GrammarBackend(Protocol):
    """One per model: compiles constraints and fills a step's bitmask rows."""

    tokenizer: TokenizerInfo
    limits: GrammarLimits

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compiles (or finds in the cache) `constraint`; raises a `StructuredOutputError` subclass
        naming the reason when it is malformed, unsupported, or over a bound."""

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """A CPU int32 bitmask of `rows` rows for this tokenizer, every token allowed."""

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Fills `bitmask[i]` for `matchers[i]`, all rows at once (releases the GIL)."""


class BitmaskFillWorker:
    """Fills a step's bitmask on a thread of its own, so the engine can run the model meanwhile:
    `submit` before the forward pass, `result()` of the future before masking the logits. The grammar
    engine releases the GIL while it fills, so the two really overlap."""

    def __init__(self, backend: GrammarBackend):
        self.backend = backend
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="depthserve-grammar-mask")

    def submit(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> Future[None]:
        """Starts filling `bitmask[i]` for `matchers[i]`; neither may be touched until it is done."""
        return self._thread.submit(self.backend.fill_bitmask, list(matchers), bitmask)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
