"""The test oracle: Hugging Face transformers on the same GGUF checkpoint (its own dequantizer)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def hf_model():
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from depthserve.loading.registry import resolve_model

    hf_logging.set_verbosity_error()
    source = resolve_model("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32
    )
    return model.eval()


@torch.inference_mode()
def hf_greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model()
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=2, eos_token_id=None, min_new_tokens=max_new_tokens,
    )
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def hf_prompt_logprobs(prompt_ids: list[int]) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1."""
    logits = hf_model()(torch.tensor([prompt_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist()
