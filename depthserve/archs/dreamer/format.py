"""Dreamer's checkpoint section and tensors, knob, cache plan, decision record and FLOP counting
(docs/depth-semantics.md section 3).

config.json `depth.dreamer`: the trained depth D, the depth-attention width and heads, its RoPE
mode, the expert-attention MoE (E experts, top-k, router rank r, expert width) and the number of
attention experts A (0: dense attention projections). Tensor names are under `model.block.`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.depth import DepthCounter, DepthParams, DepthPlan, DepthRange, DepthReport, KnobInfo, KnobSpec
from depthserve.loading.checkpoint import FORMAT_VERSION, CheckpointFormatError

DA_ROPE_MODES = ("depth", "reversed_half")


# ---- the `depth` section ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DreamerSpec:
    depth: int  # D, the trained depth (the default of the `depth` knob)
    da_dim: int  # d_DA: width of DA's queries / keys / values (all heads)
    da_heads: int = 1
    da_rope: str = "reversed_half"
    da_rope_theta: float = 10000.0
    num_experts: int = 8  # E (EA)
    top_k: int = 2
    expert_rank: int = 8  # r: EA (and attention-expert router) query/key rank
    expert_intermediate_size: int = 32  # SwiGLU width of one EA expert
    router_rope_theta: float = 10000.0  # RoPE over the depth index of the router queries
    attn_experts: int = 0  # A: top-1 linear experts in the attention projections (0 = dense)
    qk_norm_eps: float = 1e-6
    architecture: str = "dreamer"

    @property
    def da_head_dim(self) -> int:
        return self.da_dim // self.da_heads


def to_section(spec: DreamerSpec) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "architecture": "dreamer",
        "dreamer": {
            "depth": spec.depth, "da_dim": spec.da_dim, "da_heads": spec.da_heads, "da_rope": spec.da_rope,
            "da_rope_theta": spec.da_rope_theta, "num_experts": spec.num_experts, "top_k": spec.top_k,
            "expert_rank": spec.expert_rank, "expert_intermediate_size": spec.expert_intermediate_size,
            "router_rope_theta": spec.router_rope_theta, "attn_experts": spec.attn_experts,
            "qk_norm_eps": spec.qk_norm_eps,
        },
    }


def _int(body: dict, name: str, minimum: int, default: Any = None) -> int:
    value = body.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CheckpointFormatError(f"depth.dreamer.{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise CheckpointFormatError(f"depth.dreamer.{name} must be a positive number, got {value!r}")
    return float(value)


def read_spec(section: dict[str, Any] | None, hf_config: dict[str, Any]) -> DreamerSpec:
    """The config's `depth` section of a Dreamer checkpoint, checked (CheckpointFormatError naming the field)."""
    body = (section or {}).get("dreamer")
    if not isinstance(body, dict):
        raise CheckpointFormatError("depth.architecture is 'dreamer' but depth.dreamer is missing")
    for key in ("hidden_size", "num_attention_heads", "vocab_size"):
        if not isinstance(hf_config.get(key), int):
            raise CheckpointFormatError(f"config.json: a Dreamer checkpoint needs the integer field {key}")
    heads = hf_config["num_attention_heads"]
    kv = hf_config.get("num_key_value_heads", heads)
    if not isinstance(kv, int) or kv < 1 or heads % kv:
        raise CheckpointFormatError("config.json: num_key_value_heads must divide num_attention_heads")
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    if head_dim % 2:
        raise CheckpointFormatError("config.json: head_dim must be even (rotary embedding)")
    depth = _int(body, "depth", 1)
    da_heads = _int(body, "da_heads", 1, 1)
    da_dim = _int(body, "da_dim", 2)
    if da_dim % da_heads or (da_dim // da_heads) % 2:
        raise CheckpointFormatError("depth.dreamer.da_dim must split into da_heads heads of even size")
    da_rope = body.get("da_rope", "reversed_half")
    if da_rope not in DA_ROPE_MODES:
        raise CheckpointFormatError(f"depth.dreamer.da_rope must be one of {DA_ROPE_MODES}, got {da_rope!r}")
    experts = _int(body, "num_experts", 1)
    top_k = _int(body, "top_k", 1)
    if top_k > experts:
        raise CheckpointFormatError(f"depth.dreamer.top_k must lie in 1..num_experts={experts}, got {top_k}")
    rank = _int(body, "expert_rank", 2)
    if rank % 2:
        raise CheckpointFormatError("depth.dreamer.expert_rank must be even (rotary embedding over depth)")
    return DreamerSpec(
        depth=depth, da_dim=da_dim, da_heads=da_heads, da_rope=da_rope,
        da_rope_theta=_float(body, "da_rope_theta", 10000.0),
        num_experts=experts, top_k=top_k, expert_rank=rank,
        expert_intermediate_size=_int(body, "expert_intermediate_size", 1),
        router_rope_theta=_float(body, "router_rope_theta", 10000.0),
        attn_experts=_int(body, "attn_experts", 0, 0),
        qk_norm_eps=_float(body, "qk_norm_eps", 1e-6),
    )


# ---- the model's dimensions -------------------------------------------------------------------------
@dataclass(frozen=True)
class DreamerConfig:
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> DreamerConfig:
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(cfg.get("rope_theta", 10000.0)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


# ---- tensor names and shapes (docs/checkpoint-format.md, "Dreamer") ------------------------------------
P = "model.block."


def tensor_shapes(cfg: dict, spec: DreamerSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Dreamer checkpoint and its shape (lm_head.weight only when untied)."""
    d, V = cfg["hidden_size"], cfg["vocab_size"]
    H = cfg["num_attention_heads"]
    H_kv = cfg.get("num_key_value_heads", H)
    hd = cfg.get("head_dim") or d // H
    E, r, f, A, dda = spec.num_experts, spec.expert_rank, spec.expert_intermediate_size, spec.attn_experts, spec.da_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, d)}
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (V, d)
    for norm in ("da_norm", "sa_norm", "ea_norm", "out_norm"):
        shapes[P + norm + ".weight"] = (d,)
    for name in ("q", "k", "v"):
        shapes[P + f"da.{name}_proj.weight"] = (dda, d)
    shapes[P + "da.o_proj.weight"] = (d, dda)
    shapes[P + "sa.q_norm.weight"] = (hd,)
    shapes[P + "sa.k_norm.weight"] = (hd,)
    proj = {"q": (H * hd, d), "k": (H_kv * hd, d), "v": (H_kv * hd, d), "o": (d, H * hd)}
    if A == 0:
        for name, shape in proj.items():
            shapes[P + f"sa.{name}_proj.weight"] = shape
    else:
        for name, shape in proj.items():
            shapes[P + f"sa.experts.{name}_proj.weight"] = (A, *shape)
            shapes[P + f"sa.shared_expert.{name}_proj.weight"] = shape
        shapes[P + "sa.router.query.weight"] = (r, d)
        shapes[P + "sa.router.keys"] = (A, r)
        shapes[P + "sa.router.bias"] = (A,)
    shapes[P + "ea.router.query.weight"] = (r, d)
    shapes[P + "ea.router.keys"] = (E, r)
    shapes[P + "ea.router.bias"] = (E,)
    shapes[P + "ea.experts.gate_proj.weight"] = (E, f, d)
    shapes[P + "ea.experts.up_proj.weight"] = (E, f, d)
    shapes[P + "ea.experts.down_proj.weight"] = (E, d, f)
    return shapes


def read_weights(cfg: dict, spec: DreamerSpec, weights: dict[str, Any], source: str = "checkpoint") -> dict:
    """Check every Dreamer tensor is present with its shape and nothing else is; returns the tensors
    (lm_head.weight too when the checkpoint has one, though the config ties it)."""
    shapes = tensor_shapes(cfg, spec)
    out = {}
    for name, shape in shapes.items():
        if name not in weights:
            raise CheckpointFormatError(f"{source}: Dreamer weight {name} is missing")
        if tuple(weights[name].shape) != shape:
            raise CheckpointFormatError(
                f"{source}: Dreamer weight {name} has shape {tuple(weights[name].shape)}, expected {shape}")
        out[name] = weights[name]
    leftover = sorted(set(weights) - set(shapes) - {"lm_head.weight"})
    if leftover:
        raise CheckpointFormatError(f"{source}: unexpected weights in a Dreamer checkpoint: {leftover[:5]}")
    if "lm_head.weight" in weights and "lm_head.weight" not in out:
        out["lm_head.weight"] = weights["lm_head.weight"]
    return out


# ---- the knob and the plan ------------------------------------------------------------------------
KNOBS = (KnobInfo("depth", "recurrences of the shared block", elastic=True),)


def knobs(spec: DreamerSpec) -> dict[str, KnobSpec]:
    D = spec.depth
    return {"depth": KnobSpec("depth", f"recurrences of the shared block (trained depth D={D})", 1, D, D,
                              elastic=True)}


def slot_name(depth_index: int) -> str:
    return f"depth{depth_index}"


@dataclass(frozen=True, kw_only=True)
class DreamerPlan(DepthPlan):
    recurrences: int  # block applications, 1..D (a range: its maximum); one KV slot per recurrence

    @property
    def min_recurrences(self) -> int:
        """Depths every token runs: their slots are dense, the deeper ones routed (section 6)."""
        return self.recurrences if self.elastic is None else self.elastic.minimum


def plan(cfg: DreamerConfig, spec: DreamerSpec, depth: DepthParams) -> DreamerPlan:
    value = depth.get("depth", spec.depth)
    elastic = value if isinstance(value, DepthRange) and value.minimum < value.maximum else None
    n = value.maximum if isinstance(value, DepthRange) else int(value)
    lowest = n if elastic is None else elastic.minimum
    # base_slots=1: depth 0 is the one slot every request has (depth >= 1). With a range, slot d
    # holds only the tokens that ran depth d (routed, grown with them), past the range's minimum.
    dense = tuple(SlotSpec(slot_name(j), SlotKind.DENSE, cfg.num_kv_heads) for j in range(lowest))
    routed = tuple(SlotSpec(slot_name(j), SlotKind.ROUTED, cfg.num_kv_heads) for j in range(lowest, n))
    layout = CacheLayout(dense, routed, base_slots=1)
    per_depth = weight_flops_per_depth(cfg, spec)
    return DreamerPlan(depth=depth, layout=layout, flops_per_token=n * per_depth,
                       plain_flops_per_token=spec.depth * per_depth, recurrences=n, elastic=elastic, level=n)


# ---- the decisions of one sequence, FLOP counting and the report -----------------------------------
class DreamerRecord:
    """Per-position expert choices of one sequence: EA top-k ids [pos, D, k] and attention expert
    [pos, D] (-1: not run at that depth); and the readouts the confidence exit took at each
    position (the LM head over a level's state, beside the final one)."""

    def __init__(self, depth: int, top_k: int):
        self.ea = np.full((64, depth, top_k), -1, dtype=np.int32)
        self.attn = np.full((64, depth), -1, dtype=np.int32)
        self.readouts = np.zeros(64, dtype=np.int32)

    def write(self, start: int, ea: np.ndarray, attn: np.ndarray, readouts: np.ndarray | None = None) -> None:
        end = start + len(ea)
        if end > len(self.ea):
            grow = max(end, 2 * len(self.ea)) - len(self.ea)
            self.ea = np.concatenate([self.ea, np.full((grow,) + self.ea.shape[1:], -1, np.int32)])
            self.attn = np.concatenate([self.attn, np.full((grow,) + self.attn.shape[1:], -1, np.int32)])
            self.readouts = np.concatenate([self.readouts, np.zeros(grow, np.int32)])
        self.ea[start:end] = ea
        self.attn[start:end] = attn
        self.readouts[start:end] = 0 if readouts is None else readouts


def weight_flops_per_depth(cfg: DreamerConfig, spec: DreamerSpec) -> float:
    """Weight-matrix FLOPs of one token through one application of the block."""
    d, H, H_kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    r, f, E, A, dda = spec.expert_rank, spec.expert_intermediate_size, spec.num_experts, spec.attn_experts, spec.da_dim
    flops = 2 * d * 3 * dda + 2 * dda * d  # DA projections
    flops += 2 * d * (H + 2 * H_kv) * hd + 2 * H * hd * d  # SA projections (one expert when A > 0)
    flops += 2 * d * r + 2 * r * E + spec.top_k * 3 * 2 * d * f  # EA router + top-k experts
    if A:
        flops += 2 * d * r + 2 * r * A
    return flops


def depth_flops(cfg: DreamerConfig, spec: DreamerSpec, tokens: int, depth: int, logit_rows: int) -> float:
    """FLOPs of `tokens` positions (0..tokens-1) at `depth` recurrences, plus the LM head rows."""
    return schedule_flops(cfg, spec, np.full(tokens, depth), logit_rows)


def schedule_flops(cfg: DreamerConfig, spec: DreamerSpec, depths: np.ndarray, logit_rows: int) -> float:
    """FLOPs of positions 0..n-1 each at its own depth (section 6: at depth j a token attends to the
    earlier tokens that ran depth j and itself), plus the LM head rows."""
    depths = np.asarray(depths, dtype=np.int64)
    ran = np.array([np.count_nonzero(depths > j) for j in range(int(depths.max(initial=0)))], dtype=np.float64)
    ctx_sum = float((ran * (ran + 1) / 2).sum())  # keys attended, summed over levels
    da_pairs = float((depths * (depths + 1) / 2).sum())  # depth j attends to j + 1 states
    return (float(depths.sum()) * weight_flops_per_depth(cfg, spec) + 4 * cfg.num_heads * cfg.head_dim * ctx_sum
            + 4 * spec.da_dim * da_pairs + logit_rows * 2 * cfg.hidden_size * cfg.vocab_size)


def ran_depths(record: DreamerRecord, tokens: int) -> np.ndarray:
    """The depth each position ran, from the recorded expert choices (-1 where a depth did not run)."""
    return np.count_nonzero(record.ea[:tokens, :, 0] >= 0, axis=1)


def report(cfg: DreamerConfig, spec: DreamerSpec, plan: DreamerPlan, record: DreamerRecord | None, tokens: int,
           generated: int) -> DepthReport:
    decisions = None if record is None else {"ea": record.ea[:tokens].copy(), "attn": record.attn[:tokens].copy()}
    settings: dict = {"depth": plan.recurrences, "trained_depth": spec.depth}
    counters: dict = {}
    per_token = None
    flops = depth_flops(cfg, spec, tokens, plan.recurrences, generated)  # this request's FLOPs
    if plan.elastic is not None and record is not None:
        per_token = ran_depths(record, tokens)
        settings["depth"] = plan.elastic.as_json()
        settings["mean_depth"] = round(float(per_token.mean()), 4) if tokens else 0.0
        readouts = int(record.readouts[:tokens].sum())  # the confidence exit's readouts
        flops = schedule_flops(cfg, spec, per_token, generated) + readouts * 2 * cfg.hidden_size * cfg.vocab_size
        per_token = per_token.tolist()
        if readouts:
            counters["exit_readouts"] = readouts  # LM head reads beside the final one (confidence exit)
    return DepthReport(
        architecture="dreamer",
        tokens=tokens,
        flops=flops,
        plain_flops=depth_flops(cfg, spec, tokens, spec.depth, generated),  # the same tokens at the trained depth D
        settings=settings,
        counters=counters,
        counter_samples=tuple(DepthCounter(name, count) for name, count in counters.items()),
        decisions=decisions,  # {"ea": [n, D, k], "attn": [n, D]} expert ids per position (-1: depth not run)
        per_token=per_token,  # with a range knob: the depth each position ran
    )
