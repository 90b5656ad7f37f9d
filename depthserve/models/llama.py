"""Llama-family decoder (Llama, SmolLM2): depth-semantics.md section 0.

h  = x + W_O · Attn(RMSNorm_a(x))
x' = h + W_down · (SiLU(W_gate · RMSNorm_m(h)) ⊙ W_up · RMSNorm_m(h))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from depthserve.depth import DepthParams, KnobSpec
from depthserve.engine.cache_spec import CacheLayout, SlotKind, SlotSpec
from depthserve.layers.attention import AttentionMetadata, KVPool, paged_attention
from depthserve.layers.norm import RMSNorm
from depthserve.layers.rotary import apply_rope, rope_tables


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
            raise ValueError(f"rope scaling '{rope_type}' is not supported yet")
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


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, slot: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        self.slot = slot

    def qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [n, H, hd] and keys [n, H_kv, hd] with RoPE applied, values [n, H_kv, hd]."""
        n = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = apply_rope(qk.reshape(n, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v.view(n, self.num_kv_heads, self.head_dim)

    def forward(self, x, cos, sin, pool: KVPool, meta: AttentionMetadata, columns: slice) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        out = paged_attention(q, k, v, pool, meta, columns, self.scale)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, index: int):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, slot=index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin, pool, meta, columns) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, pool, meta, columns)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, max_positions, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._layout = CacheLayout(
            tuple(SlotSpec(f"layer{i}", SlotKind.DENSE, cfg.num_kv_heads) for i in range(cfg.num_layers))
        )

    # ---- what the engine asks of every model --------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def depth_knobs(self) -> dict[str, KnobSpec]:
        return {}

    def cache_layout(self, depth: DepthParams) -> CacheLayout:
        return self._layout

    def forward(self, input_ids, positions, pool: KVPool, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, pool, meta, self._layout.columns(i))
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ---- weights ----------------------------------------------------------------------------
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face Llama names, fusing q/k/v and gate/up."""
        get = lambda name: weights.pop(name)  # noqa: E731
        with torch.no_grad():
            load_embeddings_and_head(self, weights, get)
            for i, layer in enumerate(self.layers):
                load_decoder_layer(layer, get, f"model.layers.{i}.", self.config.attention_bias)
        leftover = [k for k in weights if not k.endswith("rotary_emb.inv_freq")]
        if leftover:
            raise ValueError(f"unexpected weights in checkpoint: {leftover[:5]}")


# ---- weight loading pieces shared by the models built from Llama layers --------------------------
Getter = Callable[[str], torch.Tensor]  # pops a named tensor from the checkpoint (or raises)


def load_embeddings_and_head(model: nn.Module, weights: dict[str, torch.Tensor], get: Getter) -> None:
    """Token embeddings, the final norm and the LM head (tied to the embeddings when the checkpoint
    says so or has no head)."""
    model.embed_tokens.weight.copy_(get("model.embed_tokens.weight"))
    model.norm.weight.copy_(get("model.norm.weight"))
    head = weights.pop("lm_head.weight", None)
    if head is None or model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    else:
        model.lm_head.weight.copy_(head)


def load_attention(attn: LlamaAttention, get: Getter, prefix: str, bias: bool) -> None:
    """q/k/v fused into qkv_proj (and their biases if the model has them), and o_proj."""
    attn.qkv_proj.weight.copy_(torch.cat([get(prefix + f"self_attn.{n}_proj.weight") for n in "qkv"]))
    if bias:
        attn.qkv_proj.bias.copy_(torch.cat([get(prefix + f"self_attn.{n}_proj.bias") for n in "qkv"]))
    attn.o_proj.weight.copy_(get(prefix + "self_attn.o_proj.weight"))


def load_decoder_layer(layer: LlamaDecoderLayer, get: Getter, prefix: str, bias: bool) -> None:
    """One Llama decoder layer under `prefix` (e.g. "model.layers.3.")."""
    load_attention(layer.self_attn, get, prefix, bias)
    layer.mlp.gate_up_proj.weight.copy_(torch.cat([get(prefix + "mlp.gate_proj.weight"), get(prefix + "mlp.up_proj.weight")]))
    layer.mlp.down_proj.weight.copy_(get(prefix + "mlp.down_proj.weight"))
    layer.input_layernorm.weight.copy_(get(prefix + "input_layernorm.weight"))
    layer.post_attention_layernorm.weight.copy_(get(prefix + "post_attention_layernorm.weight"))
