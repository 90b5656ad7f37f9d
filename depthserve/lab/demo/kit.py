"""What every demo recipe is built from: a small checkpoint in the native format, trained through
the architecture's own reference equations (so what is trained is exactly what the engine must
equal), with every depth setting trained so every setting is a usable model. Each architecture
with a demo declares its recipe (`DemoArch`) in its own module (`depthserve/lab/demo/<name>.py`)
and registers it (`Architecture.demo`); `depthserve.archs.demo_arches()` gathers them.

    demo = demo_arches()["put"]
    cfg, weights = demo.initial(shape, tokenizer)        # the untrained checkpoint
    model = demo.trainable(checkpoint_dir)               # float32 tensors with gradients
    logits = model.logits(ids, valid, {"loops": 3})      # [B, n, V] at one setting of the knob
    for reach, logits in model.readouts(ids, valid, rng): ...   # [B, n, V] at each depth trained
    weights = model.export()                             # native tensor names, for write_checkpoint

A readout's `reach` is the hops its depth can follow (one lookup per layer pass, see
depthserve/demo/task.py): training asks each depth only the questions within its reach, so a
shallow setting answers the short chains exactly and is not taught to guess at the long ones.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from depthserve.demo.task import DIGITS, VARIABLES

EMBEDDING_STD = 0.1  # a word's embedding (the sum of two factors of std EMBEDDING_STD / sqrt 2)
ROUTER_STD = 0.02  # router queries and weights start near uniform routing

Readout = tuple[int, torch.Tensor]  # (hops the depth can reach, logits [B, n, V])


@dataclass(frozen=True)
class Shape:
    """A demo model's size (a few hundred thousand parameters)."""
    hidden_size: int = 128
    intermediate_size: int = 256
    num_attention_heads: int = 8
    max_position_embeddings: int = 128

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def llama_fields(self) -> dict[str, Any]:
        return dict(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                    num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_attention_heads,
                    head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
                    rope_theta=10000.0)


@dataclass
class Trainable:
    """A checkpoint's tensors as trainable float32 leaves and the training forward over them."""
    params: dict[str, torch.Tensor]  # name -> leaf with requires_grad
    # (ids [B, n], real-token mask [B, n], rng) -> the readouts this batch trains
    readouts: Callable[[torch.Tensor, torch.Tensor, random.Random], list[Readout]]
    logits: Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]  # (ids, mask, knob setting) -> [B, n, V]
    export: Callable[[], dict[str, torch.Tensor]]  # native checkpoint tensors (detached copies)


@dataclass(frozen=True)
class DemoArch:
    name: str
    description: str  # of the built-in model trained with this recipe (`depthserve models`)
    knob: str  # the knob the depth-quality table sweeps (its settings: `settings`)
    max_hops: int  # hops the largest setting reaches: the task's hardest problems
    steps: int  # optimizer steps of the built-in model's recipe
    initial: Callable[[Shape, Any], tuple[dict[str, Any], dict[str, torch.Tensor]]]
    trainable: Callable[[Path], Trainable]
    settings: Callable[[dict[str, Any]], list[dict[str, Any]]]  # the knob's settings: smallest first, largest last
    finish: Callable[[Path, list[list[int]]], None] | None = None  # after the weights are written (token prompts)


def matrix(*shape: int, gen: torch.Generator, std: float | None = None) -> torch.Tensor:
    """N(0, 1/fan_in) (fan_in: the last dimension), so every projection starts at unit gain."""
    std = 1.0 / math.sqrt(shape[-1]) if std is None else std
    return (torch.randn(*shape, generator=gen) * std).contiguous()


def llama_layer(prefix: str, shape: Shape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    d, ff, width = shape.hidden_size, shape.intermediate_size, shape.num_attention_heads * shape.head_dim
    w = {prefix + "input_layernorm.weight": torch.ones(d), prefix + "post_attention_layernorm.weight": torch.ones(d)}
    for name, dims in (("self_attn.q_proj", (width, d)), ("self_attn.k_proj", (width, d)),
                       ("self_attn.v_proj", (width, d)), ("self_attn.o_proj", (d, width)),
                       ("mlp.gate_proj", (ff, d)), ("mlp.up_proj", (ff, d)), ("mlp.down_proj", (d, ff))):
        w[prefix + name + ".weight"] = matrix(*dims, gen=gen)
    return w


def word_embeddings(tokenizer, hidden_size: int, gen: torch.Generator) -> torch.Tensor:
    """The embedding table's starting point, factored by role: a statement `a=b` starts as
    name(a) + value(b), a question `b?` as its own vector + value(b), a digit as value(digit).
    Each is an ordinary row of the table once training starts; the shared factors only spare the
    model learning ~900 unrelated vectors before it can match a question to a statement."""
    factor = EMBEDDING_STD / math.sqrt(2)
    vocab = tokenizer.get_vocab()

    def vectors(names: str) -> dict[str, torch.Tensor]:
        return {c: torch.randn(hidden_size, generator=gen) * factor for c in names}

    name, value, asking = vectors(VARIABLES), vectors(VARIABLES + DIGITS), vectors(VARIABLES)
    table = torch.randn(len(tokenizer), hidden_size, generator=gen) * EMBEDDING_STD
    for word, index in vocab.items():
        if "=" in word:
            lhs, rhs = word.split("=")
            table[index] = name[lhs] + value[rhs]
        elif word.endswith("?"):
            table[index] = asking[word[0]] + value[word[0]]
        elif word in DIGITS:
            table[index] = value[word]
    return table


def embeddings(cfg: dict[str, Any], tokenizer, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": word_embeddings(tokenizer, cfg["hidden_size"], gen),
            "model.norm.weight": torch.ones(cfg["hidden_size"])}


def leaves(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(torch.float32).clone().requires_grad_() for name, t in weights.items()}


def detached(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone().contiguous() for name, t in weights.items()}
