"""The Llama family (Llama, Mistral, SmolLM2): its config, checkpoint names, cache plan and FLOP
counting (docs/depth-semantics.md section 0). The depth architectures built on Llama layers (SGT, ITT,
PUT, SAOBP) read their base config and count their base FLOPs here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.depth import DepthParams, DepthPlan
from depthserve.loading.checkpoint import CheckpointFormatError

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")

# Checkpoint modules stored as separate tensors that the model packs into one parameter, in
# shard order (q, k, v rows into qkv_proj; gate, up rows into gate_up_proj).
PACKED_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if rope_type not in ("default", None):
            raise CheckpointFormatError(f"rope scaling '{rope_type}' is not supported yet")
        theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )


@dataclass(frozen=True)
class LlamaSpec:
    architecture: str = "llama"


def read_spec(section: dict[str, Any] | None, hf_config: dict[str, Any]) -> LlamaSpec:
    archs = hf_config.get("architectures") or ["LlamaForCausalLM"]
    if section is None and archs[0] not in HF_ARCHITECTURES:
        raise CheckpointFormatError(f"architecture {archs[0]} is not supported (Llama family: {HF_ARCHITECTURES})")
    return LlamaSpec()


def to_section(spec: LlamaSpec) -> dict[str, Any]:
    from depthserve.loading.checkpoint import FORMAT_VERSION

    return {"format_version": FORMAT_VERSION, "architecture": "llama"}


def dense_slots(cfg: LlamaConfig, names: list[str] | None = None) -> tuple[SlotSpec, ...]:
    """One dense KV slot per layer (`layer{i}`, or the given names)."""
    names = names or [f"layer{i}" for i in range(cfg.num_layers)]
    return tuple(SlotSpec(name, SlotKind.DENSE, cfg.num_kv_heads) for name in names)


def plain_plan(cfg: LlamaConfig, depth: DepthParams) -> DepthPlan:
    flops = cfg.num_layers * layer_weight_flops(cfg)
    return DepthPlan(depth=depth, layout=CacheLayout(dense_slots(cfg)), flops_per_token=flops,
                     plain_flops_per_token=flops)


# ---- FLOP counting (relative_compute): weight matmuls plus attention score and value products ----
def layer_weight_flops(cfg: LlamaConfig) -> float:
    """Weight matmuls of one full decoder layer for one token (QKV, O, gate/up, down)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    return 2 * d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + 2 * cfg.num_heads * hd * d \
        + 2 * 3 * d * cfg.intermediate_size


def attention_flops(num_q_heads: int, head_dim: int, context_sum: float) -> float:
    """Scores (q.k) and values (p.v) over `context_sum` (query, key) pairs per head."""
    return 4 * num_q_heads * head_dim * context_sum


def plain_flops(cfg: LlamaConfig, tokens: int, logit_rows: int) -> float:
    """The plain model over positions 0..tokens-1 (position p attends to p + 1 keys), plus the LM
    head on the `logit_rows` rows whose logits were computed (the sampled positions)."""
    ctx_sum = tokens * (tokens + 1) / 2
    return tokens * cfg.num_layers * layer_weight_flops(cfg) + logit_rows * 2 * cfg.hidden_size * cfg.vocab_size \
        + cfg.num_layers * attention_flops(cfg.num_heads, cfg.head_dim, ctx_sum)
