"""The reference of an Inkling-2 loop text checkpoint: transformers' Inkling2LoopForCausalLM itself,
in fp32, with `loop_num_passes` set to the request's `loops`, over the whole sequence in one forward
(any split of the tokens into forwards gives the same logits). `expert_margins` reports, for the
same forward, how far each routing decision was from flipping."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str, loops: int | None):
    from transformers import Inkling2LoopForCausalLM

    kwargs = {} if loops is None else {"loop_num_passes": loops}
    return Inkling2LoopForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()


def _loops(depth: Any) -> int | None:
    if depth is None:
        return None
    value = depth.get("loops")  # a knob dict or DepthParams
    return None if value is None else int(value)


@torch.inference_mode()
def forward(model_dir: str | Path, token_ids: list[int], depth: Any = None, **_: Any) -> torch.Tensor:
    """Logits [n, vocab] of `token_ids` at the request's `loops` (default: the config's)."""
    model = hf_model(str(model_dir), _loops(depth))
    return model(torch.tensor([token_ids]), use_cache=False).logits[0].float()


@torch.inference_mode()
def forward_with_margins(model_dir: str | Path, token_ids: list[int],
                         depth: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward`'s logits and the smallest routing margin of each token over every MoE invocation:
    the k-th largest corrected score minus the (k+1)-th (a choice closer than its rounding may flip)."""
    model = hf_model(str(model_dir), _loops(depth))
    k = model.config.num_experts_per_tok
    margins = []

    def record(module, inputs, output):
        logits = output[0].float()
        ranked = (torch.sigmoid(logits) + module.e_score_correction_bias).sort(dim=-1, descending=True).values
        margins.append(ranked[:, k - 1] - ranked[:, k])

    hooks = [layer.mlp.gate.register_forward_hook(record) for layer in model.model.layers]
    try:
        logits = model(torch.tensor([token_ids]), use_cache=False).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    return logits, torch.stack(margins).min(dim=0).values
