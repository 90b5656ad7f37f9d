"""How each demo architecture is built, trained and written back: a small checkpoint in the
native format, trained through the architecture's own reference equations (so what is trained is
exactly what the engine must equal), with every depth setting trained so every setting is a
usable model.

    demo = DEMO_ARCHES["put"]
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

from depthserve.archs.dreamer import format as dreamer_format
from depthserve.archs.itt import format as itt_format
from depthserve.archs.llama.reference import Reference
from depthserve.archs.llama.tiny import base_config
from depthserve.archs.put import format as put_format
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
    knob: str  # the knob the depth-quality table sweeps (its settings: `settings`)
    max_hops: int  # hops the largest setting reaches: the task's hardest problems
    steps: int  # optimizer steps of the built-in model's recipe
    initial: Callable[[Shape, Any], tuple[dict[str, Any], dict[str, torch.Tensor]]]
    trainable: Callable[[Path], Trainable]
    settings: Callable[[dict[str, Any]], list[dict[str, Any]]]  # the knob's settings: smallest first, largest last
    finish: Callable[[Path, list[list[int]]], None] | None = None  # after the weights are written (token prompts)


def _matrix(*shape: int, gen: torch.Generator, std: float | None = None) -> torch.Tensor:
    """N(0, 1/fan_in) (fan_in: the last dimension), so every projection starts at unit gain."""
    std = 1.0 / math.sqrt(shape[-1]) if std is None else std
    return (torch.randn(*shape, generator=gen) * std).contiguous()


def _llama_layer(prefix: str, shape: Shape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    d, ff, width = shape.hidden_size, shape.intermediate_size, shape.num_attention_heads * shape.head_dim
    w = {prefix + "input_layernorm.weight": torch.ones(d), prefix + "post_attention_layernorm.weight": torch.ones(d)}
    for name, dims in (("self_attn.q_proj", (width, d)), ("self_attn.k_proj", (width, d)),
                       ("self_attn.v_proj", (width, d)), ("self_attn.o_proj", (d, width)),
                       ("mlp.gate_proj", (ff, d)), ("mlp.up_proj", (ff, d)), ("mlp.down_proj", (d, ff))):
        w[prefix + name + ".weight"] = _matrix(*dims, gen=gen)
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


def _embeddings(cfg: dict[str, Any], tokenizer, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": word_embeddings(tokenizer, cfg["hidden_size"], gen),
            "model.norm.weight": torch.ones(cfg["hidden_size"])}


def _leaves(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(torch.float32).clone().requires_grad_() for name, t in weights.items()}


def _detached(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone().contiguous() for name, t in weights.items()}


# ---- PUT: a shared core run `loops` times with step embeddings ------------------------------------------
PUT_LAYOUT = put_format.PUTSpec(n_prefix=0, n_core=1, n_suffix=0, steps=6, conv_kernel=2)


def _put_passes(spec: put_format.PUTSpec, loops: int) -> int:
    """Layer passes a token makes at `loops`: the hops that setting can follow."""
    return spec.n_prefix + spec.n_core * loops + spec.n_suffix


def _put_initial(shape: Shape, tokenizer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    spec = PUT_LAYOUT
    cfg = base_config(tokenizer, {**shape.llama_fields(), "num_hidden_layers": spec.num_layers}, tied=True)
    cfg.update(architectures=["PUTForCausalLM"], model_type="put", depth=put_format.to_section(spec))
    gen = torch.Generator().manual_seed(0)
    w = _embeddings(cfg, tokenizer, gen)
    for prefix in put_format.layer_prefixes(spec):
        w.update(_llama_layer(prefix, shape, gen))
    for j in range(spec.n_core):
        w[put_format.step_embedding(j)] = torch.zeros(spec.steps, shape.intermediate_size)
        w[put_format.conv_weight(j)] = torch.zeros(spec.conv_kernel, shape.intermediate_size)
    return cfg, w


def _put_trainable(path: Path) -> Trainable:
    from depthserve.archs.put.reference import load_put, put_loops, run, run_each_loop

    loaded = load_put(path, torch.float32)
    params = _leaves(loaded.w)
    ref = Reference(loaded.cfg, params, loaded.spec)
    prefixes = put_format.layer_prefixes(loaded.spec)

    def readouts(ids: torch.Tensor, valid: torch.Tensor, rng: random.Random) -> list[Readout]:
        # One run of all T passes gives the logits of every loops setting (a loss at every depth).
        logits = run_each_loop(ref, ids, loaded.spec.steps)
        return [(_put_passes(loaded.spec, t), out) for t, out in enumerate(logits, 1)]

    def export() -> dict[str, torch.Tensor]:  # model.layers.i. -> the layer's native prefix
        out = {}
        for name, t in _detached(params).items():
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
        elif name.endswith("router.query.weight"):
            w[name] = _matrix(*dims, gen=gen, std=ROUTER_STD)
        else:
            w[name] = _matrix(*dims, gen=gen)
    w["model.embed_tokens.weight"] = word_embeddings(tokenizer, cfg["hidden_size"], gen)
    return cfg, w


def _dreamer_trainable(path: Path) -> Trainable:
    from depthserve.archs.dreamer.reference import knob_depth, load, run

    cfg, spec, weights = load(path, torch.float32)
    params = _leaves(weights)
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
    return Trainable(trained, readouts, logits, lambda: _detached(params))


def _dreamer_settings(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"depth": d} for d in range(1, cfg["depth"]["dreamer"]["depth"] + 1)]


# ---- ITT: layers that think again on the tokens their routers select --------------------------------------
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
    w = _embeddings(cfg, tokenizer, gen)
    for i in range(ITT_LAYERS):
        w.update(_llama_layer(f"model.layers.{i}.", shape, gen))
    d = shape.hidden_size
    for layer in spec.layers:
        w[itt_format.router_weight(layer)] = _matrix(spec.steps, d, gen=gen, std=ROUTER_STD)
        w[itt_format.router_bias(layer)] = torch.zeros(spec.steps)
        w[itt_format.step_encoding(layer)] = torch.ones(spec.steps + 1, d)
    return cfg, w


def _itt_trainable(path: Path) -> Trainable:
    from depthserve.archs.itt.reference import load_itt, run

    loaded = load_itt(path, torch.float32)
    spec: itt_format.ITTSpec = loaded.spec
    params = _leaves(loaded.w)
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
        out = _detached(params)
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
    from depthserve.archs.itt.tiny import calibrate_tokens

    calibrate_tokens(out, prompts, {"source": "variable-chasing training prompts (train-demo)"})


DEMO_ARCHES: dict[str, DemoArch] = {
    "put": DemoArch("put", "loops", _put_passes(PUT_LAYOUT, PUT_LAYOUT.steps), 10000, _put_initial, _put_trainable,
                    _put_settings),
    "dreamer": DemoArch("dreamer", "depth", DREAMER_LAYOUT.depth, 2500, _dreamer_initial, _dreamer_trainable,
                        _dreamer_settings),
    "itt": DemoArch("itt", "thinking_steps", ITT_LAYERS + len(ITT_LAYOUT.layers) * ITT_LAYOUT.steps, 10000,
                    _itt_initial, _itt_trainable, _itt_settings, _itt_calibrate),
}
