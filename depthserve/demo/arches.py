"""How each demo architecture is built, trained and written back: a small checkpoint in the
native format, trained through the architecture's own reference equations (so what is trained is
exactly what the engine must equal), with the depth knob sampled per batch so every setting is a
usable model.

    demo = DEMO_ARCHES["put"]
    cfg, weights = demo.initial(shape, tokenizer)        # the untrained checkpoint
    model = demo.trainable(checkpoint_dir)               # float32 tensors with gradients
    logits = model.logits(ids, demo.sample_setting(rng)) # [B, n, V]
    weights = model.export()                             # native tensor names, for write_checkpoint
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from depthserve.archs.dreamer import format as dreamer_format
from depthserve.archs.itt import format as itt_format
from depthserve.archs.llama.reference import Reference
from depthserve.archs.llama.tiny import base_config
from depthserve.archs.put import format as put_format

INIT_STD = 0.02  # every matrix; norms start at 1, step embeddings, conv taps and routers at 0 or small


@dataclass(frozen=True)
class Shape:
    """A demo model's size (a few hundred thousand parameters)."""
    hidden_size: int = 128
    intermediate_size: int = 256
    num_attention_heads: int = 8
    max_position_embeddings: int = 256

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
    """A checkpoint's tensors as trainable float32 leaves and the forward over them."""
    params: dict[str, torch.Tensor]  # name -> leaf with requires_grad
    logits: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]  # (ids [B, n], knob setting) -> [B, n, V]
    export: Callable[[], dict[str, torch.Tensor]]  # native checkpoint tensors (detached copies)
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DemoArch:
    name: str
    knob: str  # the knob the depth-quality table sweeps (its settings: `settings`)
    initial: Callable[[Shape, Any], tuple[dict[str, Any], dict[str, torch.Tensor]]]
    trainable: Callable[[Path], Trainable]
    sample_setting: Callable[[random.Random], dict[str, Any]]
    settings: Callable[[dict[str, Any]], list[dict[str, Any]]]  # every setting of a checkpoint's knob, cheapest first
    finish: Callable[[Path, list[list[int]]], None] | None = None  # after the weights are written (token prompts)


def _matrix(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * INIT_STD).contiguous()


def _llama_layer(prefix: str, shape: Shape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    d, ff, width = shape.hidden_size, shape.intermediate_size, shape.num_attention_heads * shape.head_dim
    w = {prefix + "input_layernorm.weight": torch.ones(d), prefix + "post_attention_layernorm.weight": torch.ones(d)}
    for name, dims in (("self_attn.q_proj", (width, d)), ("self_attn.k_proj", (width, d)),
                       ("self_attn.v_proj", (width, d)), ("self_attn.o_proj", (d, width)),
                       ("mlp.gate_proj", (ff, d)), ("mlp.up_proj", (ff, d)), ("mlp.down_proj", (d, ff))):
        w[prefix + name + ".weight"] = _matrix(*dims, gen=gen)
    return w


def _embeddings(cfg: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": _matrix(cfg["vocab_size"], cfg["hidden_size"], gen=gen),
            "model.norm.weight": torch.ones(cfg["hidden_size"])}


def _leaves(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(torch.float32).clone().requires_grad_() for name, t in weights.items()}


def _detached(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone().contiguous() for name, t in weights.items()}


# ---- PUT: prefix, a shared core run `loops` times with step embeddings, suffix ---------------------------
PUT_LAYOUT = put_format.PUTSpec(n_prefix=1, n_core=1, n_suffix=1, steps=6, conv_kernel=2)


def _put_initial(shape: Shape, tokenizer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    spec = PUT_LAYOUT
    cfg = base_config(tokenizer, {**shape.llama_fields(), "num_hidden_layers": spec.num_layers}, tied=True)
    cfg.update(architectures=["PUTForCausalLM"], model_type="put", depth=put_format.to_section(spec))
    gen = torch.Generator().manual_seed(0)
    w = _embeddings(cfg, gen)
    for prefix in put_format.layer_prefixes(spec):
        w.update(_llama_layer(prefix, shape, gen))
    for j in range(spec.n_core):
        w[put_format.step_embedding(j)] = torch.zeros(spec.steps, shape.intermediate_size)
        w[put_format.conv_weight(j)] = torch.zeros(spec.conv_kernel, shape.intermediate_size)
    return cfg, w


def _put_trainable(path: Path) -> Trainable:
    from depthserve.archs.put.reference import load_put, run

    loaded = load_put(path, torch.float32)
    params = _leaves(loaded.w)
    ref = Reference(loaded.cfg, params, loaded.spec)
    prefixes = put_format.layer_prefixes(loaded.spec)

    def export() -> dict[str, torch.Tensor]:  # model.layers.i. -> the layer's native prefix
        out = {}
        for name, t in _detached(params).items():
            if name.startswith("model.layers."):
                index, rest = name[len("model.layers."):].split(".", 1)
                name = prefixes[int(index)] + rest
            out[name] = t
        return out

    return Trainable(params, lambda ids, setting: run(ref, ids, setting["loops"]), export)


def _put_sample(rng: random.Random) -> dict[str, Any]:
    return {"loops": rng.randint(1, PUT_LAYOUT.steps)}


def _put_settings(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"loops": t} for t in range(1, cfg["depth"]["put"]["T"] + 1)]


# ---- Dreamer: one shared block (DA, SA, EA) run `depth` times ---------------------------------------------
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
        else:
            w[name] = _matrix(*dims, gen=gen)
    return cfg, w


def _dreamer_trainable(path: Path) -> Trainable:
    from depthserve.archs.dreamer.reference import load, run

    cfg, spec, weights = load(path, torch.float32)
    params = _leaves(weights)
    frozen = {name for name in params if name.endswith("router.bias")}  # the balancing bias is not a gradient's
    for name in frozen:
        params[name].requires_grad_(False)

    def logits(ids: torch.Tensor, setting: dict[str, Any]) -> torch.Tensor:
        return run(cfg, spec, params, ids, setting["depth"])[0]

    return Trainable({k: v for k, v in params.items() if k not in frozen}, logits, lambda: _detached(params))


def _dreamer_sample(rng: random.Random) -> dict[str, Any]:
    return {"depth": rng.randint(1, DREAMER_LAYOUT.depth)}


def _dreamer_settings(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"depth": d} for d in range(1, cfg["depth"]["dreamer"]["depth"] + 1)]


# ---- ITT: layers that think again on the tokens their routers select --------------------------------------
ITT_LAYERS = 2
ITT_LAYOUT = itt_format.ITTSpec(layers=(0, 1), steps=2, alphas=(1.0, 1.0), trained_ratios=(1.0, 1.0),
                                skip_rule="identity")
ITT_RATIOS = (0.25, 0.5, 0.75, 1.0)


def _itt_initial(shape: Shape, tokenizer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    spec = ITT_LAYOUT
    cfg = base_config(tokenizer, {**shape.llama_fields(), "num_hidden_layers": ITT_LAYERS}, tied=True)
    cfg["depth"] = itt_format.to_section(spec)
    gen = torch.Generator().manual_seed(0)
    w = _embeddings(cfg, gen)
    for i in range(ITT_LAYERS):
        w.update(_llama_layer(f"model.layers.{i}.", shape, gen))
    d = shape.hidden_size
    for layer in spec.layers:
        w[itt_format.router_weight(layer)] = _matrix(spec.steps, d, gen=gen)
        w[itt_format.router_bias(layer)] = torch.zeros(spec.steps)
        w[itt_format.step_encoding(layer)] = torch.ones(spec.steps + 1, d)
    return cfg, w


def _itt_trainable(path: Path) -> Trainable:
    from depthserve.archs.itt.reference import load_itt, run

    loaded = load_itt(path, torch.float32)
    params = _leaves(loaded.w)
    extras = {layer: {"router_w": entry["router_w"].detach().clone().requires_grad_(),
                      "router_b": entry["router_b"].detach().clone(),  # b_t: kept at 0 (selection is by quantile)
                      "phi": entry["phi"].detach().clone().requires_grad_(), "quantiles": None}
              for layer, entry in loaded.extras.items()}
    ref = Reference(loaded.cfg, params, loaded.spec, extras)
    for layer, entry in extras.items():
        params[itt_format.router_weight(layer)] = entry["router_w"]
        params[itt_format.step_encoding(layer)] = entry["phi"]

    def logits(ids: torch.Tensor, setting: dict[str, Any]) -> torch.Tensor:
        # Training routes each step by the quantile of this batch's scores (the rule the calibration
        # table stands in for at serving time); `valid` marks the real tokens of right-padded rows.
        tables = {"valid": setting.get("valid")}
        return run(ref, ids, {k: v for k, v in setting.items() if k != "valid"}, None, tables)[0]

    def export() -> dict[str, torch.Tensor]:
        out = _detached(params)
        for layer, entry in extras.items():
            out[itt_format.router_bias(layer)] = entry["router_b"].clone()
        return out

    return Trainable(params, logits, export)


def _itt_sample(rng: random.Random) -> dict[str, Any]:
    steps = rng.randint(0, ITT_LAYOUT.steps)
    ratio = rng.choice(ITT_RATIOS)
    return {"selection_ratios": [ratio if t < steps else 0.0 for t in range(ITT_LAYOUT.steps)]}


def _itt_settings(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    steps = cfg["depth"]["itt"]["steps"]
    out = [{"thinking_steps": 0}]
    for t in range(1, steps + 1):
        out += [{"thinking_steps": t, "selection_ratios": [r] * steps} for r in ITT_RATIOS]
    return out


def _itt_calibrate(out: Path, prompts: list[list[int]]) -> None:
    """The router-score quantile table, on training prompts (the distribution requests come from)."""
    from depthserve.archs.itt.tiny import calibrate_tokens

    calibrate_tokens(out, prompts, {"source": "variable-chasing training prompts (train-demo)"})


DEMO_ARCHES: dict[str, DemoArch] = {
    "put": DemoArch("put", "loops", _put_initial, _put_trainable, _put_sample, _put_settings),
    "dreamer": DemoArch("dreamer", "depth", _dreamer_initial, _dreamer_trainable, _dreamer_sample, _dreamer_settings),
    "itt": DemoArch("itt", "selection_ratios", _itt_initial, _itt_trainable, _itt_sample, _itt_settings,
                    _itt_calibrate),
}
