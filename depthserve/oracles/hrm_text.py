"""The reference of an HRM-Text checkpoint: transformers' HrmTextForCausalLM itself, in fp32, with
`H_cycles` and `L_cycles` set to the request's `h_cycles` and `l_cycles`, and with prefix-LM the
prompt marked as the bidirectional block (`token_type_ids` 1 over the prompt, 0 after it)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    from transformers import HrmTextForCausalLM

    return HrmTextForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


def _setting(depth: Any, name: str, default: int) -> int:
    value = None if depth is None else depth.get(name)  # a knob dict or DepthParams
    return default if value is None else int(value)


@torch.inference_mode()
def forward(model_dir: str | Path, token_ids: list[int], depth: Any = None, *, prompt_len: int | None = None
            ) -> torch.Tensor:
    """Logits [n, vocab] of `token_ids` (one forward, no cache) at the request's cycles (default: the
    config's); with prefix-LM on (the knob, default the config's `prefix_lm`) the first `prompt_len`
    tokens (default: all) are the bidirectional instruction block."""
    model = hf_model(str(model_dir))
    config = model.config
    trained = (config.H_cycles, config.L_cycles)
    config.H_cycles = _setting(depth, "h_cycles", trained[0])
    config.L_cycles = _setting(depth, "l_cycles", trained[1])
    try:
        ids = torch.tensor([token_ids])
        kwargs = {}
        if _setting(depth, "prefix_lm", int(config.prefix_lm)):
            prompt_len = len(token_ids) if prompt_len is None else prompt_len
            kwargs["token_type_ids"] = (torch.arange(len(token_ids)) < prompt_len).long()[None]
        return model(ids, use_cache=False, **kwargs).logits[0].float()
    finally:
        config.H_cycles, config.L_cycles = trained
