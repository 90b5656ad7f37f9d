"""Random-weight Llama checkpoints for tests and benchmarks, and the pieces every Llama-built
architecture's tiny checkpoint shares (shapes, config, base weights).

A tiny checkpoint has random weights with *peaked* output distributions (the LM head is scaled so
that the top-2 logit gap is usually large), so greedy comparisons between the engine and the
reference mean something. `like="smollm2-135m-instruct"` gives the real model's shapes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from depthserve.archs.llama.format import LlamaSpec, to_section
from depthserve.loading.checkpoint import write_checkpoint
from depthserve.loading.tokenizer import default_tokenizer

if TYPE_CHECKING:
    import torch

# Shapes of a tiny model (the vocabulary is the tokenizer's).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rope_theta=10000.0)
LIKE = {
    "smollm2-135m-instruct": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                  num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                  max_position_embeddings=8192, rope_theta=100000.0),
}
EMBED_STD = 1.0  # token embeddings
QK_STD = 1.5  # attention logits of std ~QK_STD**2: focused attention without amplifying fp32 rounding
LOGIT_STD = 4.0  # std of the tiny model's logits: peaked (top-1 ~0.25 on average), top-2 gaps usually >> fp32 noise


def model_shapes(like: str | None, num_kv_heads: int | None = None) -> dict[str, Any]:
    """The Llama shape fields of a tiny model, or of a real model (`like`), with optional GQA override."""
    if like and like not in LIKE:
        raise ValueError(f"--like must be one of {sorted(LIKE)}")
    shapes = dict(LIKE[like]) if like else dict(TINY)
    if num_kv_heads is not None:
        if shapes["num_attention_heads"] % num_kv_heads:
            raise ValueError("--num-kv-heads must divide the number of attention heads")
        shapes["num_key_value_heads"] = num_kv_heads
    return shapes


def num_layers_of(like: str | None) -> int:
    """Layers of a tiny model, or of a real model's shapes (`like`)."""
    return (LIKE[like] if like else TINY)["num_hidden_layers"]


def every_other_layer(num_layers: int, parity: str) -> list[int]:
    """Layers 1, 3, 5, ... ('odd') or 0, 2, 4, ... ('even') of a model with `num_layers` layers."""
    return list(range(1 if parity == "odd" else 0, num_layers, 2))


def int_list(text: str) -> list[int]:
    """A command-line list of integers, e.g. "10,15,20"."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def synthetic_streams(vocab_size: int, windows: int, length: int, seed: int) -> torch.Tensor:
    """Token windows [windows, length] drawn from a Zipf-like distribution over a shuffled vocabulary."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
    probs = 1.0 / ranks**1.1
    order = torch.randperm(vocab_size, generator=gen)
    draws = torch.multinomial(probs / probs.sum(), windows * length, replacement=True, generator=gen)
    return order[draws].view(windows, length)


def base_config(tokenizer, shapes: dict[str, Any], tied: bool) -> dict[str, Any]:
    """config.json of a random checkpoint: HF Llama fields (the `depth` section is added by the caller)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        **shapes,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "torch_dtype": "float32",
    }


def normal_sampler(gen: torch.Generator) -> Callable[..., torch.Tensor]:
    """normal(*shape, std=1.0): contiguous Gaussian draws from `gen`."""
    import torch

    def normal(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    return normal


def llama_weights(cfg: dict[str, Any], gen: torch.Generator, layer_prefixes: Sequence[str] | None = None
                  ) -> dict[str, torch.Tensor]:
    """Random Llama weights (embeddings, final norm, untied head, and the layers under
    `layer_prefixes`, default model.layers.0..L-1), scaled so that output distributions are peaked."""
    d, ffn, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, H_kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    normal = normal_sampler(gen)

    w = {"model.embed_tokens.weight": normal(V, d, std=EMBED_STD),
         "model.norm.weight": 1 + normal(d, std=0.1)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(V, d, std=LOGIT_STD / d**0.5)  # peaked output distributions
    if layer_prefixes is None:
        layer_prefixes = [f"model.layers.{i}." for i in range(cfg["num_hidden_layers"])]
    for p in layer_prefixes:
        w[p + "self_attn.q_proj.weight"] = normal(H * hd, d, std=QK_STD / d**0.5)
        w[p + "self_attn.k_proj.weight"] = normal(H_kv * hd, d, std=QK_STD / d**0.5)
        w[p + "self_attn.v_proj.weight"] = normal(H_kv * hd, d, std=1.0 / d**0.5)
        w[p + "self_attn.o_proj.weight"] = normal(d, H * hd, std=1.0 / (H * hd) ** 0.5)
        w[p + "mlp.gate_proj.weight"] = normal(ffn, d, std=1.0 / d**0.5)
        w[p + "mlp.up_proj.weight"] = normal(ffn, d, std=1.0 / d**0.5)
        w[p + "mlp.down_proj.weight"] = normal(d, ffn, std=1.0 / ffn**0.5)
        w[p + "input_layernorm.weight"] = 1 + normal(d, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + normal(d, std=0.1)
    return w


CLI_FLAGS = ()  # make-tiny flags of its own (registry.TinyCheckpoints): none


def make_tiny(out: Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None,
              tokenizer=None) -> Path:
    """A random plain Llama checkpoint (untied head unless `like`)."""
    import torch

    tokenizer = tokenizer or default_tokenizer()
    cfg = base_config(tokenizer, model_shapes(like, num_kv_heads), tied=bool(like))
    cfg["depth"] = to_section(LlamaSpec())
    return write_checkpoint(Path(out), cfg, llama_weights(cfg, torch.Generator().manual_seed(seed)), tokenizer)
