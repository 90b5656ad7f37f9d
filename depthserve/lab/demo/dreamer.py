"""Dreamer's demo: one shared block (DA, SA, EA) run `depth` times, trained on variable chasing.

The recipe of `depthserve train-demo --arch dreamer` (depthserve/lab/demo/kit.py has what every recipe
is built from, depthserve/lab/demo/train.py the training loop); the built-in `demo-dreamer` is its result."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from depthserve.archs.dreamer import format as dreamer_format
from depthserve.lab.tiny.llama import base_config
from depthserve.lab.demo.kit import ROUTER_STD, DemoArch, Readout, Shape, Trainable, detached, leaves, matrix, word_embeddings

DREAMER_LAYOUT = dreamer_format.DreamerSpec(depth=6, da_dim=32, da_heads=1, num_experts=4, top_k=2, expert_rank=16,
                                            expert_intermediate_size=128, attn_experts=0,
                                            da_rope_theta=100.0, router_rope_theta=100.0)


def _dreamer_initial(shape: Shape, tokenizer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    spec = DREAMER_LAYOUT
    cfg = base_config(tokenizer, shape.llama_fields(), tied=True)
    cfg.update(architectures=["DreamerForCausalLM"], model_type="dreamer", num_hidden_layers=1,
               intermediate_size=spec.expert_intermediate_size, depth=dreamer_format.to_section(spec))
    gen = torch.Generator().manual_seed(0)
    w = {}
    for name, dims in dreamer_format.tensor_shapes(cfg, spec).items():
        if name.endswith("norm.weight"):
            w[name] = torch.ones(*dims)
        elif name.endswith("router.bias"):
            w[name] = torch.zeros(*dims)
        elif name.endswith("router.keys"):
            w[name] = torch.randn(*dims, generator=gen)  # distinct experts from the start
        elif name.endswith("router.query.weight"):
            w[name] = matrix(*dims, gen=gen, std=ROUTER_STD)
        else:
            w[name] = matrix(*dims, gen=gen)
    w["model.embed_tokens.weight"] = word_embeddings(tokenizer, cfg["hidden_size"], gen)
    return cfg, w


def _dreamer_trainable(path: Path) -> Trainable:
    from depthserve.oracles.dreamer import knob_depth, load, run

    cfg, spec, weights = load(path, torch.float32)
    params = leaves(weights)
    frozen = {name for name in params if name.endswith("router.bias")}  # the balancing bias is not a gradient's
    for name in frozen:
        params[name].requires_grad_(False)

    def readouts(ids: torch.Tensor, valid: torch.Tensor, rng: random.Random) -> list[Readout]:
        # One run to depth D reads the LM head at every depth (the depth-d model's output).
        logits, _ = run(cfg, spec, params, ids, spec.depth, every_depth=True)
        return list(enumerate(logits, 1))

    def logits(ids: torch.Tensor, valid: torch.Tensor, setting: dict[str, Any]) -> torch.Tensor:
        return run(cfg, spec, params, ids, knob_depth(setting, spec.depth))[0]

    trained = {k: v for k, v in params.items() if k not in frozen}
    return Trainable(trained, readouts, logits, lambda: detached(params))


def _dreamer_settings(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"depth": d} for d in range(1, cfg["depth"]["dreamer"]["depth"] + 1)]


def demo() -> DemoArch:
    return DemoArch("dreamer", "Dreamer trained on variable chasing (depthserve train-demo): knob depth 1..6, one hop "
                    "per depth", "depth", DREAMER_LAYOUT.depth, 2500, _dreamer_initial, _dreamer_trainable,
                    _dreamer_settings)
