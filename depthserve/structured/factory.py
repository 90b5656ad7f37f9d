"""Choosing a grammar backend by name: the one place that knows the implementations."""

from __future__ import annotations

from collections.abc import Sequence

from depthserve.structured.backend import GrammarBackend


def create_grammar_backend(hf_tokenizer, eos_token_ids: Sequence[int] | None = None, name: str = "llguidance",
                           **options) -> GrammarBackend:
    """The grammar backend `name` for a model's tokenizer (build once per model; ~2 s for 49k tokens)."""
    if name == "llguidance":
        from depthserve.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(hf_tokenizer, eos_token_ids, **options)
    raise ValueError(f"unknown grammar backend {name!r}; available: llguidance")
