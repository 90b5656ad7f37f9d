"""PUT's demo: a shared core run `loops` times with step embeddings, trained on variable chasing.

The recipe of `depthserve train-demo --arch put` (depthserve/lab/demo/kit.py has what every recipe
is built from, depthserve/lab/demo/train.py the training loop); the built-in `demo-put` is its result."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from depthserve.oracles.llama import Reference
from depthserve.lab.tiny.llama import base_config
from depthserve.archs.put import format as put_format
from depthserve.lab.demo.kit import DemoArch, Readout, Shape, Trainable, detached, embeddings, leaves, llama_layer

PUT_LAYOUT = put_format.PUTSpec(n_prefix=0, n_core=1, n_suffix=0, steps=6, conv_kernel=2)


def _put_passes(spec: put_format.PUTSpec, loops: int) -> int:
    """Layer passes a token makes at `loops`: the hops that setting can follow."""
    return spec.n_prefix + spec.n_core * loops + spec.n_suffix


def _put_initial(shape: Shape, tokenizer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    spec = PUT_LAYOUT
    cfg = base_config(tokenizer, {**shape.llama_fields(), "num_hidden_layers": spec.num_layers}, tied=True)
    cfg.update(architectures=["PUTForCausalLM"], model_type="put", depth=put_format.to_section(spec))
    gen = torch.Generator().manual_seed(0)
    w = embeddings(cfg, tokenizer, gen)
    for prefix in put_format.layer_prefixes(spec):
        w.update(llama_layer(prefix, shape, gen))
    for j in range(spec.n_core):
        w[put_format.step_embedding(j)] = torch.zeros(spec.steps, shape.intermediate_size)
        w[put_format.conv_weight(j)] = torch.zeros(spec.conv_kernel, shape.intermediate_size)
    return cfg, w


def _put_trainable(path: Path) -> Trainable:
    from depthserve.oracles.put import load_put, put_loops, run, run_each_loop

    loaded = load_put(path, torch.float32)
    params = leaves(loaded.w)
    ref = Reference(loaded.cfg, params, loaded.spec)
    prefixes = put_format.layer_prefixes(loaded.spec)

    def readouts(ids: torch.Tensor, valid: torch.Tensor, rng: random.Random) -> list[Readout]:
        # One run of all T passes gives the logits of every loops setting (a loss at every depth).
        logits = run_each_loop(ref, ids, loaded.spec.steps)
        return [(_put_passes(loaded.spec, t), out) for t, out in enumerate(logits, 1)]

    def export() -> dict[str, torch.Tensor]:  # model.layers.i. -> the layer's native prefix
        out = {}
        for name, t in detached(params).items():
            if name.startswith("model.layers."):
                index, rest = name[len("model.layers."):].split(".", 1)
                name = prefixes[int(index)] + rest
            out[name] = t
        return out

    def logits(ids: torch.Tensor, valid: torch.Tensor, setting: dict[str, Any]) -> torch.Tensor:
        return run(ref, ids, put_loops(loaded.spec, setting))

    return Trainable(params, readouts, logits, export)


def _put_settings(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"loops": t} for t in range(1, cfg["depth"]["put"]["T"] + 1)]


def demo() -> DemoArch:
    return DemoArch("put", "PUT trained on variable chasing (depthserve train-demo): knob loops 1..6, one hop per loop",
                    "loops", _put_passes(PUT_LAYOUT, PUT_LAYOUT.steps), 10000, _put_initial, _put_trainable,
                    _put_settings)
