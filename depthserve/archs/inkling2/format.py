"""Inkling-2's looped text model (Thinking Machines' Inkling-2-Mini): the transformers config.json
read as transformers reads it, the released tensor names, the knob `loops`, the cache plan and FLOP
counting (docs/depth-semantics.md, "Public looped models: Inkling-2").

The checkpoint carries no `depth` section: `model_type: "inkling2_loop_text"` names the
architecture (loading/checkpoint.py). Every field defaults as transformers' Inkling2LoopTextConfig
does. The multimodal checkpoint (`inkling2_loop`, a vision tower beside the text model) is refused
with a CheckpointFormatError: only the text model is served.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.depth import DepthCounter, DepthParams, DepthPlan, DepthReport, KnobInfo, KnobSpec
from depthserve.loading.checkpoint import CheckpointFormatError

SLIDING = "hybrid_sliding"
FULL = "hybrid"
# The ceiling of `loops` when the config names none: this many times the trained pass count.
MAX_LOOPS_FACTOR = 4
WHAT = "inkling2_loop_text config.json"


@dataclass(frozen=True)
class Inkling2Config:
    """The fields of an Inkling-2 loop text config.json the engine computes with."""

    vocab_size: int  # rows of the embedding
    unpadded_vocab_size: int  # rows of the LM head that are served
    hidden_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    swa_num_heads: int
    swa_num_kv_heads: int
    head_dim: int  # both layer types (the page pool has one head size)
    sliding_window: int
    d_rel: int
    rel_extent: int
    log_scaling_n_floor: int
    log_scaling_alpha: float
    rms_norm_eps: float
    conv_kernel_size: int
    moe_intermediate_size: int
    num_experts: int
    experts_per_token: int
    route_scale: float
    qk_clip: float
    rel_clip: float
    layers_per_block: int
    mlp_gate_softcap: float
    mlp_up_softcap: float
    final_logit_softcap: float
    loop_start: int
    loop_end: int
    loop_passes: int  # the trained pass count: the knob's default
    max_loops: int  # the knob's ceiling
    loop_gate_rank: int
    max_position_embeddings: int
    architecture: str = "inkling2_loop_text"

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def looped_layers(self) -> range:
        return range(self.loop_start, self.loop_end)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def window(self, layer: int) -> int | None:
        """Keys a query of this layer sees, itself included (None: every earlier key)."""
        return self.sliding_window if self.is_sliding(layer) else None

    def heads(self, layer: int) -> tuple[int, int]:
        """(query heads, KV heads) of a layer."""
        return (self.swa_num_heads, self.swa_num_kv_heads) if self.is_sliding(layer) else (
            self.num_heads, self.num_kv_heads)

    def rel_span(self, layer: int) -> int:
        """Backward distances the relative position bias covers (the window on sliding layers)."""
        return self.sliding_window if self.is_sliding(layer) else self.rel_extent

    def is_block_boundary(self, layer: int) -> bool:
        return layer % self.layers_per_block == 0


def _integer(hf: dict[str, Any], name: str, default: int | None, minimum: int = 0) -> int:
    value = hf.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CheckpointFormatError(f"{WHAT}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def _number(hf: dict[str, Any], name: str, default: float) -> float:
    value = hf.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise CheckpointFormatError(f"{WHAT}: {name} must be a positive number, got {value!r}")
    return float(value)


def _loop_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The loop fields, from a released `loop_config` object where there is one (as transformers reads it)."""
    fields = dict(hf)
    loop = hf.get("loop_config")
    if loop is not None:
        if not isinstance(loop, dict):
            raise CheckpointFormatError(f"{WHAT}: loop_config must be an object, got {loop!r}")
        for ours, theirs in (("loop_layer_index_start", "core_start"), ("loop_layer_index_end", "core_end"),
                             ("loop_num_passes", "num_passes"), ("loop_gate_rank", "gate_rank")):
            if theirs in loop:
                fields[ours] = loop[theirs]
    return fields


def read_config(hf: dict[str, Any]) -> Inkling2Config:
    """The config of a transformers Inkling-2 loop text config.json (CheckpointFormatError naming the field)."""
    if hf.get("model_type") == "inkling2_loop" or "vision_config" in hf:
        raise CheckpointFormatError("an inkling2_loop checkpoint with a vision tower is not served; serve its text "
                                    "model (model_type inkling2_loop_text)")
    hf = _loop_fields(hf)
    layers = _integer(hf, "num_hidden_layers", 24, 1)
    types = hf.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in (SLIDING, FULL) for t in types):
        raise CheckpointFormatError(f"{WHAT}: layer_types must list {layers} layers, each {SLIDING!r} or {FULL!r}, "
                                    f"got {types!r}")
    per_block = _integer(hf, "n_layers_per_attn_res_block", 6, 1)
    start, end = _integer(hf, "loop_layer_index_start", 6, 1), _integer(hf, "loop_layer_index_end", 18, 1)
    if start % per_block or end % per_block or not start < end <= layers:
        raise CheckpointFormatError(f"{WHAT}: the looped layers {start}..{end - 1} must be whole attention-residual "
                                    f"blocks of {per_block} layers within the {layers} layers, after the first")
    head_dim, swa_head_dim = _integer(hf, "head_dim", 128, 1), _integer(hf, "swa_head_dim", 128, 1)
    hidden = _integer(hf, "hidden_size", 2304, 1)
    if head_dim != swa_head_dim or hidden % head_dim:
        raise CheckpointFormatError(f"{WHAT}: head_dim ({head_dim}) must equal swa_head_dim ({swa_head_dim}) and "
                                    f"divide hidden_size ({hidden}) (one page size for every cache slot)")
    heads, kv_heads = _integer(hf, "num_attention_heads", 24, 1), _integer(hf, "num_key_value_heads", 8, 1)
    swa_heads, swa_kv = _integer(hf, "swa_num_attention_heads", 24, 1), _integer(hf, "swa_num_key_value_heads", 8, 1)
    if heads % kv_heads or swa_heads % swa_kv:
        raise CheckpointFormatError(f"{WHAT}: attention heads must be multiples of their key/value heads")
    for name, expected in (("hidden_act", "silu"), ("scoring_func", "sigmoid")):
        if hf.get(name, expected) != expected:
            raise CheckpointFormatError(f"{WHAT}: {name} {hf[name]!r} is not served (only {expected!r})")
    experts = _integer(hf, "n_routed_experts", 128, 1)
    vocab = _integer(hf, "vocab_size", 201024, 1)
    passes = _integer(hf, "loop_num_passes", 3, 1)
    return Inkling2Config(
        vocab_size=vocab, unpadded_vocab_size=_integer(hf, "unpadded_vocab_size", 200058, 1), hidden_size=hidden,
        layer_types=tuple(types), num_heads=heads, num_kv_heads=kv_heads, swa_num_heads=swa_heads,
        swa_num_kv_heads=swa_kv, head_dim=head_dim, sliding_window=_integer(hf, "sliding_window_size", 1024, 1),
        d_rel=_integer(hf, "d_rel", 16, 1), rel_extent=_integer(hf, "rel_extent", 1024, 1),
        log_scaling_n_floor=_integer(hf, "log_scaling_n_floor", 8192, 1),
        log_scaling_alpha=float(hf.get("log_scaling_alpha", 0.1)), rms_norm_eps=_number(hf, "rms_norm_eps", 1e-6),
        conv_kernel_size=_integer(hf, "conv_kernel_size", 4, 1),
        moe_intermediate_size=_integer(hf, "moe_intermediate_size", 1152, 1), num_experts=experts,
        experts_per_token=_integer(hf, "num_experts_per_tok", 8, 1), route_scale=_number(hf, "route_scale", 8.0),
        qk_clip=_number(hf, "qk_l2_clip_threshold", 22.627416997969522),
        rel_clip=_number(hf, "rel_l2_clip_threshold", 8.0), layers_per_block=per_block,
        mlp_gate_softcap=_number(hf, "mlp_gate_softcap", 4.0), mlp_up_softcap=_number(hf, "mlp_up_softcap", 25.0),
        final_logit_softcap=_number(hf, "final_logit_softcapping", 30.0), loop_start=start, loop_end=end,
        loop_passes=passes, max_loops=MAX_LOOPS_FACTOR * passes,
        loop_gate_rank=_integer(hf, "loop_gate_rank", 64, 1),
        max_position_embeddings=_integer(hf, "max_position_embeddings", 1048576, 1))


def read_spec(section: dict[str, Any] | None, hf_config: dict[str, Any]) -> Inkling2Config:
    """The registry's reader: the checkpoint has no `depth` section, its config is the spec."""
    if section is not None:
        raise CheckpointFormatError("an Inkling-2 loop checkpoint carries no `depth` section")
    return read_config(hf_config)


def refuse_multimodal(section: dict[str, Any] | None, hf_config: dict[str, Any]) -> Inkling2Config:
    """The reader of `model_type: "inkling2_loop"` (text model and vision tower): refused."""
    raise CheckpointFormatError("an inkling2_loop checkpoint (text model and vision tower) is not served; serve "
                                "its text model (model_type inkling2_loop_text)")


# ---- the knob and the plan ------------------------------------------------------------------------
KNOBS = (KnobInfo("loops", "passes of the looped band of layers"),)


def knobs(cfg: Inkling2Config) -> dict[str, KnobSpec]:
    return {"loops": KnobSpec("loops", f"passes of the looped band of layers; trained with {cfg.loop_passes}",
                              1, cfg.max_loops, cfg.loop_passes)}


def slot_names(layer: int, t: int = 1) -> tuple[str, str, str]:
    """The slots one invocation of a layer writes (pass t of a looped layer): its keys and values,
    the inputs of its key and value convolutions, and the inputs of its two residual convolutions."""
    base = f"layer{layer}" if t == 1 else f"layer{layer}.pass{t}"
    return base, f"{base}.conv_kv", f"{base}.conv_res"


def invocation_slots(cfg: Inkling2Config, layer: int, t: int = 1) -> tuple[SlotSpec, ...]:
    """A convolution slot keeps only its last conv_kernel_size tokens (a window), so its pages go
    back as the sequence moves on, as a sliding layer's do."""
    _, kv_heads = cfg.heads(layer)
    attention, conv_kv, conv_res = slot_names(layer, t)
    kernel = cfg.conv_kernel_size
    return (SlotSpec(attention, SlotKind.DENSE, kv_heads, cfg.window(layer)),
            SlotSpec(conv_kv, SlotKind.DENSE, kv_heads, kernel),
            SlotSpec(conv_res, SlotKind.DENSE, cfg.hidden_size // cfg.head_dim, kernel))


def base_slots(cfg: Inkling2Config) -> tuple[SlotSpec, ...]:
    """The slots every request has (every layer once: pass 1 of the looped band)."""
    return tuple(slot for layer in range(cfg.num_layers) for slot in invocation_slots(cfg, layer))


@dataclass(frozen=True, kw_only=True)
class Inkling2Plan(DepthPlan):
    loops: int  # passes of the looped band


def layer_weight_flops(cfg: Inkling2Config, layer: int) -> float:
    """Weight matmuls of one layer invocation for one token: attention projections (q, k, v, output,
    gate, relative states, sinks, dynamic conv taps) and the routed experts it runs."""
    d = cfg.hidden_size
    heads, kv_heads = cfg.heads(layer)
    q, kv = heads * cfg.head_dim, kv_heads * cfg.head_dim
    attention = 2 * d * (3 * q + 2 * kv + heads * cfg.d_rel + heads)
    if not cfg.is_sliding(layer):
        attention += 2 * 2 * d * kv_heads * cfg.conv_kernel_size
    experts = 2 * 3 * d * cfg.moe_intermediate_size * cfg.experts_per_token + 2 * d * cfg.num_experts
    return attention + experts


def message_flops(cfg: Inkling2Config) -> float:
    """The four message gates of one looped layer invocation after the first pass."""
    d, r = cfg.hidden_size, cfg.loop_gate_rank
    return 4 * 2 * (2 * d * r + 2 * r * d)


def token_flops(cfg: Inkling2Config, loops: int) -> float:
    once = sum(layer_weight_flops(cfg, i) for i in range(cfg.num_layers))
    band = sum(layer_weight_flops(cfg, i) + message_flops(cfg) for i in cfg.looped_layers)
    return once + (loops - 1) * band


def plan(cfg: Inkling2Config, depth: DepthParams) -> Inkling2Plan:
    loops = int(depth.get("loops", cfg.loop_passes))
    base = base_slots(cfg)
    later = tuple(slot for t in range(2, loops + 1) for layer in cfg.looped_layers
                  for slot in invocation_slots(cfg, layer, t))
    layout = CacheLayout(base + later, base_slots=len(base))
    return Inkling2Plan(depth=depth, layout=layout, flops_per_token=token_flops(cfg, loops),
                        plain_flops_per_token=token_flops(cfg, cfg.loop_passes), loops=loops, level=loops)


def report(cfg: Inkling2Config, plan: Inkling2Plan, tokens: int, generated: int) -> DepthReport:
    """Weight FLOPs of the tokens computed and of the LM head rows, at the request's loops and at the
    trained pass count (the `plain` reference)."""
    head = generated * 2 * cfg.hidden_size * cfg.unpadded_vocab_size
    band = cfg.loop_end - cfg.loop_start
    counters = {"looped_layer_passes": tokens * plan.loops * band}
    return DepthReport(architecture="inkling2_loop_text", tokens=tokens, flops=tokens * plan.flops_per_token + head,
                       plain_flops=tokens * plan.plain_flops_per_token + head,
                       settings={"loops": plan.loops, "trained_loops": cfg.loop_passes},
                       counters=counters,
                       counter_samples=tuple(DepthCounter(name, count) for name, count in counters.items()))
