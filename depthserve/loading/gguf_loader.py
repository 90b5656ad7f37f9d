"""Read a llama-architecture GGUF file: config from its metadata, weights dequantized with `gguf`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from depthserve.errors import CheckpointFormatError

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def read_config(reader) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointFormatError(f"GGUF architecture '{arch}' is not supported (only 'llama')")
    a = lambda key, default=None: _field(reader, f"llama.{key}", default)  # noqa: E731
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = a("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": int(a("rope.dimension_count", hidden // heads)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(a("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved per rotary pair; restore the half-split layout."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def load_gguf(path: Path, progress: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Returns (HF-style config dict, HF-named fp32 state dict)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    config = read_config(reader)
    weights: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"Loading {path.name}", disable=not progress, unit="tensor"):
        array = dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = np.asarray(array, dtype=np.float32).reshape(shape)
        if tensor.name.endswith("attn_q.weight"):
            array = _unpermute_rope(array, config["num_attention_heads"])
        elif tensor.name.endswith("attn_k.weight"):
            array = _unpermute_rope(array, config["num_key_value_heads"])
        weights[_hf_name(tensor.name)] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
    return config, weights
