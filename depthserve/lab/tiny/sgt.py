"""Random-weight SGT checkpoints: a tiny Llama with looped layers whose head sets cover the cases
that matter (one KV group per head, two heads of one group, heads split unevenly over groups)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from depthserve.lab.tiny.llama import base_config, int_list, llama_weights, model_shapes
from depthserve.archs.registry import TinyFlag
from depthserve.archs.sgt.format import SGTLayer, SGTSpec, to_section
from depthserve.loading.checkpoint import write_checkpoint
from depthserve.loading.tokenizer import default_tokenizer


def tiny_spec(num_layers: int, num_heads: int, layers: Sequence[int] | None = None,
              heads: int | Sequence[Sequence[int]] | None = None, loops: int | None = None) -> SGTSpec:
    """Looped layers 1..3 (or the upper layers of a deep model) with head sets that cover the cases:
    one KV group per head, two heads of one group, and heads split unevenly over groups.

    `layers`, `heads` (a head count, taken as heads 0..n-1, or one head set per looped layer) and
    `loops` (the trained count of every looped layer) override those defaults."""
    if layers is None:
        if num_layers <= 4:
            layers = [1, 2, 3][: max(num_layers - 1, 1)]
        else:
            layers = [num_layers // 3, num_layers // 2, (2 * num_layers) // 3]
    layers = list(layers)
    if not layers or len(set(layers)) != len(layers) or not all(0 <= l < num_layers for l in layers):
        raise ValueError(f"SGT layers must be distinct layer indices in 0..{num_layers - 1}, got {layers}")
    if heads is None:
        defaults = [[num_heads - 1, 0], [1, num_heads // 2, num_heads - 1], [1, 0]]
        head_sets = [defaults[i % len(defaults)] for i in range(len(layers))]
    elif isinstance(heads, int):
        if not 1 <= heads <= num_heads:
            raise ValueError(f"the SGT head count must lie in 1..{num_heads}, got {heads}")
        head_sets = [list(range(heads))] * len(layers)
    else:
        head_sets = [list(h) for h in heads]
        if len(head_sets) != len(layers):
            raise ValueError(f"give one SGT head set per looped layer ({len(layers)}), got {len(head_sets)}")
    head_sets = [sorted(set(h), key=h.index) for h in head_sets]
    if not all(h and all(0 <= x < num_heads for x in h) for h in head_sets):
        raise ValueError(f"SGT head sets must be non-empty sets of heads in 0..{num_heads - 1}, got {head_sets}")
    counts = [2, 1, 1][: len(layers)] + [1] * max(len(layers) - 3, 0) if loops is None else [loops] * len(layers)
    if min(counts) < 0:
        raise ValueError(f"the SGT loop count must be >= 0, got {loops}")
    return SGTSpec(tuple(SGTLayer(l, tuple(h), k) for l, h, k in zip(layers, head_sets, counts)),
                   max_loops=max(3, *counts))


def head_sets(text: str) -> int | list[list[int]]:
    """--sgt-heads: a head count N, or one comma-separated head set per looped layer, ';' between."""
    return int(text) if text.strip().isdigit() else [int_list(part) for part in text.split(";")]


CLI_FLAGS = (
    TinyFlag("--sgt-layers", "layers", int_list, "SGT looped layers, e.g. 10,15,20"),
    TinyFlag("--sgt-heads", "heads", head_sets,
             "SGT heads per looped layer: a count N (heads 0..N-1) or one set per layer, e.g. '0,1;0,4;1,8'"),
    TinyFlag("--sgt-loops", "loops", int, "trained loop count of every looped layer"),
)


def make_tiny(out: Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None, tokenizer=None,
              *, layers: Sequence[int] | None = None, heads: int | Sequence[Sequence[int]] | None = None,
              loops: int | None = None) -> Path:
    import torch

    tokenizer = tokenizer or default_tokenizer()
    cfg = base_config(tokenizer, model_shapes(like, num_kv_heads), tied=bool(like))
    cfg["depth"] = to_section(tiny_spec(cfg["num_hidden_layers"], cfg["num_attention_heads"], layers, heads, loops))
    return write_checkpoint(Path(out), cfg, llama_weights(cfg, torch.Generator().manual_seed(seed)), tokenizer)
