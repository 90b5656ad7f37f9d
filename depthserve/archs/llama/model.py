"""Llama-family decoder (Llama, SmolLM2): docs/depth-semantics.md section 0.

h  = x + W_O · Attn(RMSNorm_a(x))
x' = h + W_down · (SiLU(W_gate · RMSNorm_m(h)) ⊙ W_up · RMSNorm_m(h))
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from depthserve.archs.base import BuildOptions, DepthModel, StaticDecodeSpec
from depthserve.archs.llama.format import PACKED_MODULES, LlamaConfig, plain_plan
from depthserve.archs.llama.native_decode import NativeDecodeLayers
from depthserve.depth import DepthParams, DepthPlan
from depthserve.layers.activation import silu_and_mul
from depthserve.layers.attention import AttentionMetadata, KVPool, paged_attention
from depthserve.layers.embedding import checkpoint_embedding
from depthserve.layers.norm import RMSNorm
from depthserve.layers.rotary import apply_rope, register_rope_buffers, rope_tables


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
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, index: int):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, slot=index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)
        self.native_decode: NativeDecodeLayers | None = None  # set after loading (finish_load), where it applies

    def forward(self, x, cos, sin, pool, meta, columns) -> torch.Tensor:
        if self.native_decode is not None and self.native_decode.applies(x, meta):
            return self.native_decode(x, cos, sin, pool, meta, [columns.start])  # the lines below as one native call
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, pool, meta, columns)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module, DepthModel):
    packed_modules = PACKED_MODULES
    # True where the forward is this class's plain loop over self.layers, which the native decode
    # step may then run as one call (finish_load). A subclass (a depth model loops its own way) is
    # False unless it declares the flag itself (__init_subclass__).
    plain_layer_loop: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.plain_layer_loop = cls.__dict__.get("plain_layer_loop", False)

    def __init__(self, cfg: LlamaConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.max_positions = max_positions
        self.embed_tokens = checkpoint_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        register_rope_buffers(self, cfg.head_dim, max_positions)
        self._base_plan = plain_plan(cfg, DepthParams())
        self.native_layers: NativeDecodeLayers | None = None  # every layer in one native call (finish_load)
        self._first_columns = [self._base_plan.layout.columns(i).start for i in range(cfg.num_layers)]

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def plan(self, depth: DepthParams) -> DepthPlan:
        return self._base_plan

    def static_decode_spec(self) -> StaticDecodeSpec:
        return StaticDecodeSpec(self._base_plan.layout)

    def forward(self, input_ids, positions, pool: KVPool, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        layout = self._base_plan.layout
        if self.native_layers is not None and self.native_layers.applies(x, meta):
            return self.norm(self.native_layers(x, cos, sin, pool, meta, self._first_columns))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, pool, meta, layout.columns(i))
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def after_load(self, loaded: set[str]) -> set[str]:
        return tie_lm_head(self, loaded)

    def finish_load(self, device: torch.device) -> None:
        fp32_rope_tables(self, device)
        # NativeDecodeLayers.of needs every projection on the native CPU kernel (quantized layers run
        # on the CPU only), so a layer elsewhere keeps its eager forward.
        for layer in self.layers:
            plain = (type(layer) is LlamaDecoderLayer and type(layer.self_attn) is LlamaAttention
                     and type(layer.mlp) is LlamaMLP)  # a subclass's parts are not what the native step computes
            layer.native_decode = NativeDecodeLayers.of([layer]) if plain else None
        if self.plain_layer_loop and all(layer.native_decode is not None for layer in self.layers):
            self.native_layers = NativeDecodeLayers.of(self.layers)


def tie_lm_head(model: nn.Module, loaded: set[str]) -> set[str]:
    """The LM head is the embedding matrix when the checkpoint ties them or has no head
    (`after_load` of every model with `lm_head` and `embed_tokens`)."""
    if model.config.tie_word_embeddings or "lm_head.weight" not in loaded:
        model.lm_head.weight = model.embed_tokens.weight
        return {"lm_head.weight"}
    return set()


def fp32_rope_tables(model: nn.Module, device: torch.device) -> None:
    """The rotary tables stay fp32 whatever the model dtype (rebuilt after the cast)."""
    cos, sin = rope_tables(model.config.head_dim, model.max_positions, model.config.rope_theta)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)


def build(hf_config: dict, spec, options: BuildOptions) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig.from_hf(hf_config), options.max_len)
