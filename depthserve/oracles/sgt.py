"""The SGT reference (docs/depth-semantics.md section 1; paper 000, Eq. 6): the plain decoder where
each looped layer runs its head-subset attention `loops` extra times between its attention
residual and its MLP, on the full sequence, no cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from depthserve.oracles.llama import (
    Reference,
    attention,
    full_layer,
    knob_values,
    level_mask,
    load,
    mlp,
    norm,
    run_layers,
)
from depthserve.archs.sgt.format import SGTSpec, read_spec


def sgt_loops(spec: SGTSpec, depth: Any) -> dict[int, int]:
    """The `loops` knob: an int for every looped layer or a map layer -> count (others: trained K_l)."""
    loops = {s.layer: s.loops for s in spec.layers}
    value = knob_values(depth).get("loops")
    if isinstance(value, int):
        loops = {layer: value for layer in loops}
    elif isinstance(value, dict):
        loops.update({int(k): int(v) for k, v in value.items()})
    return loops


def sgt_layer(ref: Reference, layer: int, x: torch.Tensor, loops: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The looped layer with `loops` [B, n] iterations per token: iteration k runs for the tokens
    with loops >= k and attends to the earlier of them (section 6; a constant is the fixed knob)."""
    spec = ref.spec.layer(layer)
    h = x + attention(ref, layer, norm(ref, layer, "a", x), list(range(ref.cfg["num_attention_heads"])), mask)
    for k in range(1, int(loops.max()) + 1):
        # Eq. 6 / section 1: h = h + sum_{i in S_l} W_O^(i) Attn_i(RMSNorm_a(h)), the layer's own weights and norm
        ran = loops >= k
        step = attention(ref, layer, norm(ref, layer, "a", h), list(spec.heads), level_mask(mask, ran), spec.head_scales)
        h = torch.where(ran[..., None], h + step, h)
    return h + mlp(ref, layer, norm(ref, layer, "m", h))  # the MLP once, after the loops


@torch.no_grad()
def forward(model_dir: str | Path, token_ids: list[int], depth: Any = None, *, return_decisions: bool = False,
            force: dict | None = None, dtype: torch.dtype = torch.float64, schedule: list | None = None):
    """Logits [n_tokens, vocab] with these `loops` (default: the trained counts), or with `schedule`
    (one knob setting per token) each token's own loops (section 6)."""
    ref = load(model_dir, dtype, read_spec)
    n = len(token_ids)
    if schedule is not None and len(schedule) != n:
        raise ValueError(f"a schedule needs one setting per token: {len(schedule)} for {n} tokens")
    per_token = [sgt_loops(ref.spec, setting) for setting in (schedule or [depth] * n)]
    loops = {layer: torch.tensor([[counts[layer] for counts in per_token]]) for layer in per_token[0]}

    def layer_fn(ref: Reference, layer: int, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return sgt_layer(ref, layer, x, loops[layer], mask) if layer in loops else full_layer(ref, layer, x, mask)

    logits = run_layers(ref, torch.as_tensor(list(token_ids), dtype=torch.long)[None], layer_fn)[0]
    return (logits, {}) if return_decisions else logits
