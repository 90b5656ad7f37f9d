"""The reference of a Dory checkpoint: transformers' DoryForCausalLM itself, in fp32, with
`n_recurrent_loops` set to the request's `loops`.

With `recurrent_kv_cache_mode: "last_loop"` the result depends on how the tokens are split into
forwards (docs/depth-semantics.md, "Public looped models: Dory"), so the reference feeds the
prompt in chunks of `prefill_chunk` tokens counted from its first token, then every later token
one at a time, through transformers' own cache, as the engine does."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str, loops: int | None):
    from transformers import DoryForCausalLM

    kwargs = {} if loops is None else {"n_recurrent_loops": loops}
    return DoryForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()


def _loops(depth: Any) -> int | None:
    if depth is None:
        return None
    value = depth.get("loops")  # a knob dict or DepthParams
    return None if value is None else int(value)


@torch.inference_mode()
def forward(model_dir: str | Path, token_ids: list[int], depth: Any = None, *, prompt_len: int | None = None,
            prefill_chunk: int | None = None) -> torch.Tensor:
    """Logits [n, vocab] of `token_ids` at the request's `loops` (default: the config's).

    `prompt_len` and `prefill_chunk` (last_loop mode): the first `prompt_len` tokens go in forwards
    of `prefill_chunk` tokens, the rest one token per forward. Unset: one forward over everything
    (per_loop mode gives the same logits however the tokens are split)."""
    model = hf_model(str(model_dir), _loops(depth))
    ids = torch.tensor([token_ids])
    if model.config.recurrent_kv_cache_mode != "last_loop" or prefill_chunk is None:
        return model(ids).logits[0].float()
    prompt_len = len(token_ids) if prompt_len is None else prompt_len
    bounds = list(range(0, prompt_len, prefill_chunk)) + list(range(prompt_len, len(token_ids)))
    cache, logits = None, []
    for start, end in zip(bounds, bounds[1:] + [len(token_ids)]):
        out = model(ids[:, start:end], cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits[0].float())
    return torch.cat(logits)
