"""The test oracle: Hugging Face transformers on the same GGUF checkpoint (its own dequantizer)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch


def reading_each_gguf_once(read):
    """gguf's reader class `read` made to parse each file once (the parsed fields are only read)."""
    readers = {}

    def read_once(path, mode: str = "r"):
        key = f"{Path(path).resolve()}:{mode}"
        if key not in readers:
            readers[key] = read(path, mode)
        return readers[key]

    return read_once


@contextlib.contextmanager
def _gguf_read_once():
    """transformers parses the GGUF file twice (for the config, then for the weights) and rebuilds
    gguf's tensor-name map once per tensor: ~25 of the ~40 s its load takes on the 2-core machine.
    While the oracle loads, the file is parsed once and the map built once per architecture; what
    transformers computes from them (its own dequantization included) is unchanged."""
    import gguf

    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = reading_each_gguf_once(original_reader), functools.cache(original_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map


@functools.lru_cache(maxsize=1)
def hf_model():
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from depthserve.loading.registry import resolve_model

    hf_logging.set_verbosity_error()
    source = resolve_model("smollm2-135m-instruct")
    with _gguf_read_once():
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                     dtype=torch.float32)
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
