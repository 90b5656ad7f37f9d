"""ITT's demo: layers that think again on the tokens their routers select, trained on variable chasing.

The recipe of `depthserve train-demo --arch itt` (depthserve/lab/demo/kit.py has what every recipe
is built from, depthserve/lab/demo/train.py the training loop); the built-in `demo-itt` is its result."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from depthserve.archs.itt import format as itt_format
from depthserve.oracles.llama import Reference
from depthserve.lab.tiny.llama import base_config
from depthserve.lab.demo.kit import ROUTER_STD, DemoArch, Readout, Shape, Trainable, detached, embeddings, leaves, llama_layer, matrix

# One layer thinking up to five more times: with two plain layers the model learns to follow up
# to four hops without thinking (pointer doubling across layers), and thinking barely matters.
ITT_LAYERS = 1
ITT_STEPS = 5
ITT_LAYOUT = itt_format.ITTSpec(layers=(0,), steps=ITT_STEPS, alphas=(1.0,) * ITT_STEPS,
                                trained_ratios=(1.0,) * ITT_STEPS, skip_rule="identity")
ITT_RATIOS = (0.25, 0.5, 0.75, 1.0)


def _itt_initial(shape: Shape, tokenizer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    spec = ITT_LAYOUT
    cfg = base_config(tokenizer, {**shape.llama_fields(), "num_hidden_layers": ITT_LAYERS}, tied=True)
    cfg["depth"] = itt_format.to_section(spec)
    gen = torch.Generator().manual_seed(0)
    w = embeddings(cfg, tokenizer, gen)
    for i in range(ITT_LAYERS):
        w.update(llama_layer(f"model.layers.{i}.", shape, gen))
    d = shape.hidden_size
    for layer in spec.layers:
        w[itt_format.router_weight(layer)] = matrix(spec.steps, d, gen=gen, std=ROUTER_STD)
        w[itt_format.router_bias(layer)] = torch.zeros(spec.steps)
        w[itt_format.step_encoding(layer)] = torch.ones(spec.steps + 1, d)
    return cfg, w


def _itt_trainable(path: Path) -> Trainable:
    from depthserve.oracles.itt import load_itt, run

    loaded = load_itt(path, torch.float32)
    spec: itt_format.ITTSpec = loaded.spec
    params = leaves(loaded.w)
    extras = {layer: {"router_w": entry["router_w"].detach().clone().requires_grad_(),
                      "router_b": entry["router_b"].detach().clone(),  # b_t: kept at 0 (selection is by quantile)
                      "phi": entry["phi"].detach().clone().requires_grad_(), "quantiles": None}
              for layer, entry in loaded.extras.items()}
    ref = Reference(loaded.cfg, params, spec, extras)
    for layer, entry in extras.items():
        params[itt_format.router_weight(layer)] = entry["router_w"]
        params[itt_format.step_encoding(layer)] = entry["phi"]

    def readouts(ids: torch.Tensor, valid: torch.Tensor, rng: random.Random) -> list[Readout]:
        # The paper's elastic thinking: a setting drawn per batch (thinking steps, and a selection
        # ratio for them). Training routes each step by the quantile of this batch's scores (the
        # rule the calibration table stands in for at serving time); `valid` marks the real tokens
        # of right-padded rows. A selected token passes each ITT layer 1 + steps times.
        steps, ratio = rng.randint(0, spec.steps), rng.choice(ITT_RATIOS)
        setting = {"selection_ratios": [ratio if t < steps else 0.0 for t in range(spec.steps)]}
        reach = loaded.cfg["num_hidden_layers"] + len(spec.layers) * steps
        return [(reach, logits(ids, valid, setting))]

    def logits(ids: torch.Tensor, valid: torch.Tensor, setting: dict[str, Any]) -> torch.Tensor:
        return run(ref, ids, setting, None, {"valid": valid})[0]

    def export() -> dict[str, torch.Tensor]:
        out = detached(params)
        for layer, entry in extras.items():
            out[itt_format.router_bias(layer)] = entry["router_b"].clone()
        return out

    return Trainable(params, readouts, logits, export)


def _itt_settings(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Thinking steps 0..T at the trained ratios (every token), then every step at a lower selection
    ratio; the largest setting (every step, every token) last."""
    steps = cfg["depth"]["itt"]["steps"]
    ratios = [{"selection_ratios": [r] * steps} for r in ITT_RATIOS if r < 1.0]
    return [{"thinking_steps": t} for t in range(steps)] + ratios + [{"thinking_steps": steps}]


def _itt_calibrate(out: Path, prompts: list[list[int]]) -> None:
    """The router-score quantile table, on training prompts (the distribution requests come from)."""
    from depthserve.lab.tiny.itt import calibrate_tokens

    calibrate_tokens(out, prompts, {"source": "variable-chasing training prompts (train-demo)"})


def demo() -> DemoArch:
    return DemoArch("itt", "ITT trained on variable chasing (depthserve train-demo): knobs thinking_steps 0..5 and "
                    "selection_ratios", "thinking_steps", ITT_LAYERS + len(ITT_LAYOUT.layers) * ITT_LAYOUT.steps, 10000,
                    _itt_initial, _itt_trainable, _itt_settings, _itt_calibrate)
