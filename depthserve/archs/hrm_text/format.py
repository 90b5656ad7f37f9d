"""HRM-Text's checkpoint: the transformers `config.json` (model_type "hrm_text") read as transformers
reads it, the tensor names transformers saves, the knobs `h_cycles`, `l_cycles` and `prefix_lm`,
the cache plan and FLOP counting (docs/depth-semantics.md, "Public looped models: HRM-Text").

An HRM-Text checkpoint carries no `depth` section: `model_type: "hrm_text"` names the architecture
(loading/checkpoint.py). transformers saves `num_hidden_layers` inflated to one entry per attention
invocation (layers per stack x H_cycles x (L_cycles + 1)) beside the real `num_layers_per_stack`;
a config without `num_layers_per_stack` carries the per-stack count in `num_hidden_layers`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.depth import DepthCounter, DepthParams, DepthPlan, DepthReport, KnobInfo, KnobSpec
from depthserve.loading.checkpoint import CheckpointFormatError

# The ceiling of `h_cycles` and `l_cycles` when the engine names none: this many times the
# checkpoint's own count.
MAX_CYCLES_FACTOR = 4


@dataclass(frozen=True)
class HrmTextConfig:
    """The fields of an HRM-Text config.json the engine computes with."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int  # keys and values have as many heads (multi-head attention, no grouping)
    head_dim: int
    layers_per_stack: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    embedding_scale: float
    h_cycles: int  # the checkpoint's H_cycles: the knob's default
    l_cycles: int  # the checkpoint's L_cycles: the knob's default
    max_h_cycles: int
    max_l_cycles: int
    prefix_lm: bool  # trained with a bidirectional instruction block: the knob `prefix_lm`'s default
    tie_word_embeddings: bool = False
    architecture: str = "hrm_text"


def _integer(hf: dict[str, Any], name: str, default: int | None, minimum: int = 1) -> int:
    value = hf.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CheckpointFormatError(f"hrm_text config.json: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def _number(hf: dict[str, Any], name: str, default: float) -> float:
    value = hf.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise CheckpointFormatError(f"hrm_text config.json: {name} must be a positive number, got {value!r}")
    return float(value)


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters")
    if params is None:
        return _number(hf, "rope_theta", 10_000.0)
    if not isinstance(params, dict) or not isinstance(params.get("rope_theta", 10_000.0), (int, float)):
        raise CheckpointFormatError(f"hrm_text config.json: rope_parameters must hold a rope_theta, got {params!r}")
    if params.get("rope_type", "default") != "default":
        raise CheckpointFormatError(f"hrm_text config.json: rope_parameters.rope_type {params['rope_type']!r} "
                                    "is not served (only 'default')")
    return float(params.get("rope_theta", 10_000.0))


def read_config(hf: dict[str, Any], max_cycles: int | None = None) -> HrmTextConfig:
    """The HRM-Text config of a transformers config.json (CheckpointFormatError naming the field);
    `max_cycles`: the engine's ceiling of both cycle knobs instead of MAX_CYCLES_FACTOR times the
    checkpoint's counts."""
    h_cycles, l_cycles = _integer(hf, "H_cycles", 2), _integer(hf, "L_cycles", 3)
    per_stack = hf.get("num_layers_per_stack")
    per_stack = _integer(hf, "num_hidden_layers", 16) if per_stack is None else _integer(hf, "num_layers_per_stack", None)
    hidden, heads = _integer(hf, "hidden_size", 1536), _integer(hf, "num_attention_heads", 12)
    if hidden % heads:
        raise CheckpointFormatError(f"hrm_text config.json: hidden_size ({hidden}) must be a multiple of "
                                    f"num_attention_heads ({heads})")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointFormatError(f"hrm_text config.json: hidden_act {hf['hidden_act']!r} is not served (only 'silu')")
    for name in ("attention_bias", "mlp_bias"):
        if hf.get(name, False):
            raise CheckpointFormatError(f"hrm_text config.json: {name} is not served (HRM-Text has no biases)")
    prefix_lm = hf.get("prefix_lm", True)
    if not isinstance(prefix_lm, bool):
        raise CheckpointFormatError(f"hrm_text config.json: prefix_lm must be true or false, got {prefix_lm!r}")
    initializer_range = _number(hf, "initializer_range", 0.02)
    embedding_scale = hf.get("embedding_scale")
    embedding_scale = 1.0 / initializer_range if embedding_scale is None else _number(hf, "embedding_scale", 1.0)
    return HrmTextConfig(
        vocab_size=_integer(hf, "vocab_size", 151808), hidden_size=hidden,
        intermediate_size=_integer(hf, "intermediate_size", 4096), num_heads=heads,
        head_dim=_integer(hf, "head_dim", 128, 2), layers_per_stack=per_stack,
        max_position_embeddings=_integer(hf, "max_position_embeddings", 2048),
        rms_norm_eps=_number(hf, "rms_norm_eps", 1e-6), rope_theta=_rope_theta(hf), embedding_scale=embedding_scale,
        h_cycles=h_cycles, l_cycles=l_cycles,
        max_h_cycles=max(h_cycles, max_cycles or MAX_CYCLES_FACTOR * h_cycles),
        max_l_cycles=max(l_cycles, max_cycles or MAX_CYCLES_FACTOR * l_cycles),
        prefix_lm=prefix_lm, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))


def read_spec(section: dict[str, Any] | None, hf_config: dict[str, Any]) -> HrmTextConfig:
    """The registry's reader: an HRM-Text checkpoint has no `depth` section, its config is the spec."""
    if section is not None:
        raise CheckpointFormatError("an HRM-Text checkpoint (model_type 'hrm_text') carries no `depth` section")
    return read_config(hf_config)


# ---- tensor names (docs/checkpoint-format.md) -------------------------------------------------------
# transformers saves each layer's attention projections fused as `attn.gqkv_proj` (gate, q, k, v
# stacked on the output dimension) and its MLP's as `mlp.gate_up_proj`; its modules hold them apart
# (`self_attn.{gate,q,k,v}_proj`, `mlp.{gate,up}_proj`). The engine keeps the fused layout and
# accepts both spellings; its parameters carry the names without the `model.` prefix.
FUSED_PARTS = {"attn.gqkv_proj": ("self_attn.gate_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_SPLIT = re.compile(r"^(?P<layer>[LH]_module\.layers\.\d+)\.(?P<part>self_attn\.(?:gate|q|k|v)_proj|mlp\.(?:gate|up)_proj)"
                    r"\.weight$")


def parameter_name(checkpoint_name: str) -> str:
    """The engine's parameter of a checkpoint tensor in the fused spelling (a split projection maps
    to its fused parameter: split_part says which part)."""
    name = checkpoint_name.removeprefix("model.")
    if (split := _SPLIT.match(name)) is not None:
        fused = next(f for f, parts in FUSED_PARTS.items() if split["part"] in parts)
        return f"{split['layer']}.{fused}.weight"
    return name.replace(".self_attn.o_proj.", ".attn.o_proj.")


def split_part(checkpoint_name: str) -> int | None:
    """Which part of its fused parameter a split projection is (None: the tensor is whole)."""
    split = _SPLIT.match(checkpoint_name.removeprefix("model."))
    if split is None:
        return None
    return next(parts.index(split["part"]) for parts in FUSED_PARTS.values() if split["part"] in parts)


# ---- the knobs and the plan -------------------------------------------------------------------------
KNOBS = (KnobInfo("h_cycles", "high-level cycles (HRM-Text's H_cycles)"),
         KnobInfo("l_cycles", "low-level cycles per high-level cycle (HRM-Text's L_cycles)"),
         KnobInfo("prefix_lm", "1: the prompt is a bidirectional instruction block (HRM-Text's prefix-LM); 0: causal"))


def knobs(cfg: HrmTextConfig) -> dict[str, KnobSpec]:
    return {
        "h_cycles": KnobSpec("h_cycles", f"high-level cycles; trained with {cfg.h_cycles}", 1, cfg.max_h_cycles,
                             cfg.h_cycles),
        "l_cycles": KnobSpec("l_cycles", f"low-level cycles per high-level cycle; trained with {cfg.l_cycles}", 1,
                             cfg.max_l_cycles, cfg.l_cycles),
        # transformers ignores the instruction block of a checkpoint trained without one
        "prefix_lm": KnobSpec("prefix_lm", "1: the prompt attends bidirectionally (an instruction block), 0: causally",
                              0, int(cfg.prefix_lm), int(cfg.prefix_lm)),
    }


def low_slot_name(h: int, l: int, layer: int) -> str:
    """The slot of layer `layer` of the low-level stack at high cycle h, low cycle l (from 0)."""
    return f"h{h}.l{l}.layer{layer}"


def high_slot_name(h: int, layer: int) -> str:
    """The slot of layer `layer` of the high-level stack at high cycle h (from 0)."""
    return f"h{h}.high.layer{layer}"


def invocation_slots(cfg: HrmTextConfig, h_cycles: int, l_cycles: int) -> list[str]:
    """Every attention invocation's slot at these cycle counts, the ones every request has first
    (the invocations of one high cycle with one low cycle), then in order of high cycle."""
    layers = range(cfg.layers_per_stack)
    base = [low_slot_name(0, 0, j) for j in layers] + [high_slot_name(0, j) for j in layers]
    rest = [low_slot_name(h, l, j) for h in range(h_cycles) for l in range(l_cycles) for j in layers
            if (h, l) != (0, 0)]
    rest += [high_slot_name(h, j) for h in range(1, h_cycles) for j in layers]
    return base + rest


@dataclass(frozen=True, kw_only=True)
class HrmTextPlan(DepthPlan):
    h_cycles: int
    l_cycles: int
    prefix_lm: bool  # the prompt is one bidirectional block, computed in one forward


def layer_weight_flops(cfg: HrmTextConfig) -> float:
    """Weight matmuls of one decoder layer for one token (gate, q, k, v, o; MLP gate, up, down)."""
    d, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    return 2 * d * 5 * q + 2 * 3 * d * cfg.intermediate_size


def token_flops(cfg: HrmTextConfig, h_cycles: int, l_cycles: int) -> float:
    return h_cycles * (l_cycles + 1) * cfg.layers_per_stack * layer_weight_flops(cfg)


def plan(cfg: HrmTextConfig, depth: DepthParams, max_positions: int) -> HrmTextPlan:
    h_cycles = int(depth.get("h_cycles", cfg.h_cycles))
    l_cycles = int(depth.get("l_cycles", cfg.l_cycles))
    prefix_lm = bool(depth.get("prefix_lm", int(cfg.prefix_lm)))
    names = invocation_slots(cfg, h_cycles, l_cycles)
    slots = tuple(SlotSpec(name, SlotKind.DENSE, cfg.num_heads) for name in names)
    # A bidirectional prompt's keys depend on every prompt token, so the prompt runs in one forward
    # (a chunk longer than any sequence) and its blocks are shared only with the same prompt.
    chunk = max_positions + 1 if prefix_lm else None
    layout = CacheLayout(slots, base_slots=2 * cfg.layers_per_stack, prompt_keyed=prefix_lm)
    return HrmTextPlan(depth=depth, layout=layout, flops_per_token=token_flops(cfg, h_cycles, l_cycles),
                       plain_flops_per_token=token_flops(cfg, cfg.h_cycles, cfg.l_cycles), level=h_cycles,
                       prefill_chunk=chunk, h_cycles=h_cycles, l_cycles=l_cycles, prefix_lm=prefix_lm)


def report(cfg: HrmTextConfig, plan: HrmTextPlan, tokens: int, generated: int) -> DepthReport:
    """Weight FLOPs of the tokens computed and of the LM head rows, at the request's cycles and at the
    checkpoint's (the `plain` reference)."""
    head = generated * 2 * cfg.hidden_size * cfg.vocab_size
    counters = {"stack_invocations": tokens * plan.h_cycles * (plan.l_cycles + 1)}
    return DepthReport(architecture="hrm_text", tokens=tokens, flops=tokens * plan.flops_per_token + head,
                       plain_flops=tokens * plan.plain_flops_per_token + head,
                       settings={"h_cycles": plan.h_cycles, "l_cycles": plan.l_cycles,
                                 "trained_h_cycles": cfg.h_cycles, "trained_l_cycles": cfg.l_cycles,
                                 "prefix_lm": int(plan.prefix_lm)},
                       counters=counters,
                       counter_samples=tuple(DepthCounter(name, count) for name, count in counters.items()))
