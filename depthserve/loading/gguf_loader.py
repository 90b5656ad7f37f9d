"""Read a llama-architecture GGUF file: config from its metadata, weights dequantized with `gguf`,
and the codes of the block formats a CPU kernel reproduces exactly (Q4_0, Q4_1) kept as stored.

gguf's reader parses every metadata field of the file, the vocabulary's strings and merges included
(~100,000 of them in SmolLM2's: ~2 s on the 2-core AMD EPYC, several on the Xeon, a third of the
default model's start). The first read of a file saves what the loader takes from that parse (the
config, and each tensor's type, dimensions and place in the file) as an index beside the tokenizer's
conversion (loading/derived_cache.py); later starts map the file and take the tensors from there."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from depthserve.errors import CheckpointFormatError
from depthserve.layers.quantized import INT4_GROUP, QuantizedWeight
from depthserve.loading.derived_cache import derived_dir

INDEX_VERSION = 1

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


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


# Block layouts (ggml's): an fp16 scale d, for Q4_1 an fp16 minimum m, then the codes of 32 weights:
# Q4_0/Q4_1 two to a byte, weights 0..15 in the low nibbles and 16..31 in the high ones; Q8_0 one
# signed byte each (w = d * q).
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
KEPT_TYPES = tuple(_BLOCK_BYTES)


@dataclass
class GGUFWeights:
    """A GGUF's tensors under Hugging Face names: every one dequantized to fp32 (`dense`), and for
    those stored in a block format the CPU kernels take, their codes (`quantized`, same names)."""

    config: dict[str, Any]
    dense: dict[str, torch.Tensor]
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # name -> GGUF type name, e.g. "Q4_1"


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of a GGUF file: its name, ggml type (a GGMLQuantizationType name), dimensions in the
    file's order (fastest first) and its stored values as gguf's reader gives them (a view of the
    mapped file)."""

    name: str
    kind: str
    dims: tuple[int, ...]
    data: np.ndarray


def read_gguf(path: Path) -> tuple[dict[str, Any], list[StoredTensor]]:
    """The config and the tensors of a GGUF file: from its saved index (module docstring), else
    parsed by gguf's reader, the index then saved (a cache that cannot be written costs only the
    parse next time)."""
    index_file = derived_dir(path, "gguf-index") / "index.json"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        index = None
    if isinstance(index, dict) and index.get("version") == INDEX_VERSION:
        stored = np.memmap(path, dtype=np.uint8, mode="r")
        return index["config"], [
            StoredTensor(t["name"], t["kind"], tuple(t["dims"]),
                         stored[t["offset"]: t["offset"] + t["bytes"]].view(np.dtype(t["dtype"])).reshape(t["shape"]))
            for t in index["tensors"]]
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    config = read_config(reader)
    tensors = [StoredTensor(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), t.data) for t in reader.tensors]
    entries = [{"name": t.name, "kind": t.tensor_type.name, "dims": [int(d) for d in t.shape],
                "offset": int(t.data_offset), "bytes": int(t.data.nbytes), "dtype": t.data.dtype.str,
                "shape": list(t.data.shape)} for t in reader.tensors]
    try:
        index_file.parent.mkdir(parents=True, exist_ok=True)
        partial = index_file.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"version": INDEX_VERSION, "config": config, "tensors": entries}))
        partial.replace(index_file)  # whole or absent: a concurrent start reads one or the other
    except OSError:
        pass
    return config, tensors


def load_gguf(path: Path, progress: bool = True, keep_codes: bool = False) -> GGUFWeights:
    """The config and fp32 weights; with `keep_codes`, also the stored codes of Q4_0/Q4_1/Q8_0 tensors."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    config, tensors = read_gguf(path)
    out = GGUFWeights(config, {})
    for tensor in tqdm(tensors, desc=f"Loading {path.name}", disable=not progress, unit="tensor"):
        name, kind = _hf_name(tensor.name), tensor.kind
        shape = tuple(reversed(tensor.dims))
        rows = _rope_rows(tensor.name, shape[0], config)
        out.types[name] = kind
        if kind in _BLOCK_BYTES and len(shape) == 2:
            # The block formats decoded from their codes in torch: gguf's own dequantization bit for
            # bit (tests/test_quantized.py), without its Python loop over groups of rows (~1.2 s of
            # the default model's load).
            codes = _block_codes(np.asarray(tensor.data), kind, shape)
            codes = codes if rows is None else codes.rows(rows)
            out.dense[name] = codes.dequantize()
            if keep_codes:
                out.quantized[name] = codes
            continue
        array = np.asarray(dequantize(tensor.data, GGMLQuantizationType[kind]), dtype=np.float32).reshape(shape)
        if rows is not None:
            array = array[rows.numpy()]
        out.dense[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
    return out


def _rope_rows(gguf_name: str, num_rows: int, config: dict[str, Any]) -> torch.Tensor | None:
    """llama.cpp stores Q/K rows interleaved per rotary pair: the row order that restores the
    half-split layout, or None for other tensors."""
    if gguf_name.endswith("attn_q.weight"):
        heads = config["num_attention_heads"]
    elif gguf_name.endswith("attn_k.weight"):
        heads = config["num_key_value_heads"]
    else:
        return None
    return torch.arange(num_rows).view(heads, num_rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _block_codes(data: np.ndarray, kind: str, shape: tuple[int, int]) -> QuantizedWeight:
    rows, width = shape
    blocks = data.reshape(rows, width // INT4_GROUP, _BLOCK_BYTES[kind])
    scale = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q8_0":
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(rows, width))
        return QuantizedWeight(8, codes, scale)
    start = 4 if kind == "Q4_1" else 2
    packed = blocks[..., start:]
    nibbles = np.concatenate([packed & 15, packed >> 4], axis=-1)  # weights 0..15, then 16..31
    codes = torch.from_numpy(nibbles.reshape(rows, width).astype(np.uint8))
    if kind == "Q4_1":
        low = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    else:
        low = -8 * scale
    return QuantizedWeight(4, codes, scale, low)
