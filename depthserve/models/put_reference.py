"""The PUT reference forward (depth-semantics.md section 4): the test oracle.

A plain full-sequence forward written from the equations, in float64 by default: no cache, no
paging, no batching, nothing of the engine's model code (depthserve/models/put.py is used only
for the checkpoint format: the spec and the tensor names).

    x = embed(ids)
    prefix layers (plain Llama, section 0)
    for t = 1..loops, for each core layer (H = the normed input):
        h  = x + W_O . (SiLU(O) * O),   O = causal softmax attention of RMSNorm_a(x), per head
        Z  = ReLU(H W_gate + P(t)) * (H W_up),   H = RMSNorm_m(h)
        U  = SiLU(Z + DWConv_k(Z)),   DWConv_k(Z)_n = sum_{j<k} w_j * Z_{n-j}   (Z_m = 0 for m < 0)
        x  = h + U W_down
    suffix layers (plain Llama); logits = lm_head(RMSNorm(x))
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from depthserve.loading.checkpoint import read_depth_spec
from depthserve.loading.hf_loader import load_hf_dir
from depthserve.reference import attention_dims
from depthserve.models import put as fmt


def load(model_dir, dtype: torch.dtype = torch.float64):
    path = Path(model_dir)
    stamp = max(os.stat(f).st_mtime_ns for f in [path / "config.json", *path.glob("*.safetensors")])
    return _load(str(path.resolve()), stamp, dtype)


@functools.lru_cache(maxsize=4)
def _load(path: str, stamp: int, dtype: torch.dtype):
    cfg, weights = load_hf_dir(Path(path), progress=False)
    spec = read_depth_spec(cfg)
    if getattr(spec, "architecture", None) != "put":
        raise ValueError(f"{path} is not a PUT checkpoint")
    return cfg, spec, {k: v.to(dtype) for k, v in weights.items()}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Half-split rotary embedding at positions 0..n-1. x: [heads, n, head_dim]."""
    n, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angle = (torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]).to(x.dtype)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_heads(cfg: dict, w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    """Per-head causal softmax attention outputs O, concatenated: [n, H * head_dim]."""
    H, H_kv, hd, theta = attention_dims(cfg)
    n = x.shape[0]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, H, hd).transpose(0, 1)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, H_kv, hd).transpose(0, 1)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, H_kv, hd).transpose(0, 1)
    q, k = rope(q, theta), rope(k, theta)
    group = H // H_kv
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # query head i uses KV head i // group
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(n, H * hd)


def plain_layer(cfg: dict, w: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    """Section 0: h = x + W_O.Attn(RMSNorm_a(x)); x' = h + W_down(SiLU(W_gate H) * W_up H)."""
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    h = x + attention_heads(cfg, w, p, rms_norm(x, w[p + "input_layernorm.weight"], eps)) @ w[p + "self_attn.o_proj.weight"].T
    H = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
    return h + (F.silu(H @ w[p + "mlp.gate_proj.weight"].T) * (H @ w[p + "mlp.up_proj.weight"].T)) \
        @ w[p + "mlp.down_proj.weight"].T


def dwconv(z: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
    """Causal depthwise convolution over tokens: out_n = sum_{j<k} conv[j] * z_{n-j}, z_m = 0 for m < 0."""
    n = z.shape[0]
    out = torch.zeros_like(z)
    for j in range(conv.shape[0]):
        if j < n:
            out[j:] = out[j:] + conv[j] * z[: n - j]
    return out


def core_layer(cfg: dict, w: dict, j: int, t: int, x: torch.Tensor) -> torch.Tensor:
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    p = fmt.core_layer(j)
    O = attention_heads(cfg, w, p, rms_norm(x, w[p + "input_layernorm.weight"], eps))
    h = x + (F.silu(O) * O) @ w[p + "self_attn.o_proj.weight"].T  # Eq. 7, elementwise per head
    H = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
    P_t = w[fmt.step_embedding(j)][t - 1]
    Z = torch.relu(H @ w[p + "mlp.gate_proj.weight"].T + P_t) * (H @ w[p + "mlp.up_proj.weight"].T)  # Eq. 9
    U = F.silu(Z + dwconv(Z, w[fmt.conv_weight(j)]))  # Eq. 8
    return h + U @ w[p + "mlp.down_proj.weight"].T


def loops_of(spec, depth: Any) -> int:
    value = None
    if isinstance(depth, dict):
        value = depth.get("loops")
    elif depth is not None:
        value = getattr(depth, "loops", None)
    if value is None:
        return spec.steps
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= spec.steps:
        raise ValueError(f"PUT loops must be an integer in 1..{spec.steps}, got {value!r}")
    return value


@torch.no_grad()
def forward(model_dir, token_ids, depth: Any = None, *, return_decisions: bool = False, force=None,
            dtype: torch.dtype = torch.float64):
    """Logits [n_tokens, vocab] of the full-sequence forward with `loops` core passes (default T).
    PUT has no discrete decisions: with return_decisions the second value is {}."""
    cfg, spec, w = load(model_dir, dtype)
    loops = loops_of(spec, depth)
    x = w["model.embed_tokens.weight"][torch.as_tensor(list(token_ids), dtype=torch.long)]
    for i in range(spec.n_prefix):
        x = plain_layer(cfg, w, fmt.prefix_layer(i), x)
    for t in range(1, loops + 1):
        for j in range(spec.n_core):
            x = core_layer(cfg, w, j, t, x)
    for i in range(spec.n_suffix):
        x = plain_layer(cfg, w, fmt.suffix_layer(i), x)
    x = rms_norm(x, w["model.norm.weight"], float(cfg.get("rms_norm_eps", 1e-5)))
    head = w.get("lm_head.weight")
    if head is None or cfg.get("tie_word_embeddings"):
        head = w["model.embed_tokens.weight"]
    logits = x @ head.T
    return (logits, {}) if return_decisions else logits
