"""Random-weight SAOBP checkpoints: the tiny Llama base with a `depth.saobp` section (no extra
tensors), a long default context for the long-context tests, and lambda = 1 by default so that the
bias visibly changes the outputs (the paper trains with 0.05-0.2)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from depthserve.lab.tiny.llama import base_config, llama_weights, model_shapes
from depthserve.archs.saobp.format import SAOBPSpec, read_spec, to_section
from depthserve.loading.checkpoint import write_checkpoint
from depthserve.loading.tokenizer import default_tokenizer

TINY_CONTEXT = 8192


CLI_FLAGS = ()  # make-tiny flags of its own (registry.TinyCheckpoints): none


def make_tiny(out: Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None, tokenizer=None,
              *, lam: float = 1.0, variant: str = "high", self_message: bool = False,
              layers: Sequence[int] | None = None, max_position_embeddings: int | None = None) -> Path:
    """A random SAOBP checkpoint on the tiny Llama base (or `like`'s shapes)."""
    import torch

    shapes = model_shapes(like, num_kv_heads)
    if not like:
        shapes["max_position_embeddings"] = TINY_CONTEXT
    if max_position_embeddings is not None:
        shapes["max_position_embeddings"] = int(max_position_embeddings)
    tokenizer = tokenizer or default_tokenizer()
    cfg = base_config(tokenizer, shapes, tied=bool(like))
    spec = SAOBPSpec(float(lam), variant, self_message, None if layers is None else tuple(sorted(layers)))
    cfg["depth"] = to_section(spec)
    read_spec(cfg["depth"], cfg)  # the checks a load makes, before anything is written
    return write_checkpoint(Path(out), cfg, llama_weights(cfg, torch.Generator().manual_seed(seed)), tokenizer)
