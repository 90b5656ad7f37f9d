"""The reference decoder (docs/depth-semantics.md section 0): a plain full-sequence forward, the test
oracle of the Llama family and the base the other Llama-built references (SGT, ITT, PUT, SAOBP)
compose.

Written straight from the equations, with no cache, no paging, no batching tricks, and nothing of
the engine's model code or kernels: it shares only the checkpoint reader. Kept simple on purpose.
Computed in float64 by default, so its own rounding stays far below the engine's fp32 tolerances.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from depthserve.loading.checkpoint import depth_section
from depthserve.loading.hf_loader import load_hf_dir


@dataclass
class Reference:
    cfg: dict[str, Any]
    w: dict[str, torch.Tensor]  # HF names, in the reference's dtype
    spec: Any = None  # the architecture's spec (its format.read_spec), None for a plain Llama
    extras: dict[str, Any] = field(default_factory=dict)  # tensors an architecture keeps apart (ITT routers)

    @property
    def num_layers(self) -> int:
        return self.cfg["num_hidden_layers"]


def load(model_dir: str | Path, dtype: torch.dtype = torch.float64,
         read_spec: Callable[[dict | None, dict], Any] | None = None,
         take_extras: Callable[[Any, dict, str], dict] | None = None) -> Reference:
    """The checkpoint's config and weights in `dtype` (cached per file state). `read_spec` parses
    the architecture's section; `take_extras(spec, weights, path)` pops the tensors it keeps apart."""
    path = Path(model_dir)
    stamp = max(os.stat(f).st_mtime_ns for f in [path / "config.json", *path.glob("*.safetensors")])
    return _load(str(path.resolve()), stamp, dtype, read_spec, take_extras)


@functools.lru_cache(maxsize=4)
def _load(path: str, stamp: int, dtype: torch.dtype, read_spec, take_extras) -> Reference:
    cfg, weights = load_hf_dir(Path(path), progress=False)
    spec = read_spec(depth_section(cfg)[1], cfg) if read_spec is not None else None
    extras = take_extras(spec, weights, path) if take_extras is not None else {}
    weights = {k: v.to(dtype) for k, v in weights.items()}
    return Reference(cfg, weights, spec, extras)


# ---- section 0: the base decoder --------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, half-split layout, at each token's true position. x: [..., n, head_dim]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angle = positions.double()[:, None] * inv_freq[None, :]  # [n, dim/2]
    angle = angle.to(x.dtype)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_dims(cfg: dict) -> tuple[int, int, int, float]:
    """(query heads, KV heads, head dim, RoPE theta) of a Hugging Face config dict."""
    H = cfg["num_attention_heads"]
    return H, cfg.get("num_key_value_heads", H), cfg.get("head_dim") or cfg["hidden_size"] // H, \
        float(cfg.get("rope_theta", 10000.0))


def attention(ref: Reference, layer: int, x: torch.Tensor, heads: list[int], mask: torch.Tensor,
              head_scales: list[float] | None = None) -> torch.Tensor:
    """sum_{i in heads} c_i W_O^(i) . softmax(q_i k_g^T / sqrt(d_h) + mask) v_g, g = i's KV group.

    x: [B, n, d] already normed; mask: [B, n, n] bool (True = may attend).
    """
    head_out = head_attention(ref, layer, x, heads, mask)  # [B, h, n, hd]
    if head_scales is not None:
        head_out = head_out * torch.tensor(head_scales, dtype=head_out.dtype)[None, :, None, None]
    _, _, hd, _ = attention_dims(ref.cfg)
    w_o = ref.w[f"model.layers.{layer}.self_attn.o_proj.weight"]
    w_o = w_o.view(w_o.shape[0], -1, hd)[:, torch.tensor(heads)]  # W_O^(i): [d, h, hd]
    return torch.einsum("bhnc,dhc->bnd", head_out, w_o)


def head_attention(ref: Reference, layer: int, x: torch.Tensor, heads: list[int], mask: torch.Tensor) -> torch.Tensor:
    """softmax(q_i k_g^T / sqrt(d_h) + mask) v_g of each query head i in `heads` [B, len(heads), n, hd]
    (x [B, n, d] already normed; every head computed at once, each from its own rows of W_Q and
    its KV group's rows of W_K and W_V)."""
    cfg, w = ref.cfg, ref.w
    H, H_kv, hd, theta = attention_dims(cfg)
    p = f"model.layers.{layer}.self_attn."
    index = torch.tensor(heads)
    group = index // (H // H_kv)  # query head i reads KV head g
    rows = {"q": index, "k": group, "v": group}
    proj = {}
    for name, sel in rows.items():
        weight = w[p + f"{name}_proj.weight"]
        out = torch.einsum("bnd,hcd->bhnc", x, weight.view(-1, hd, weight.shape[-1])[sel])
        if p + f"{name}_proj.bias" in w:  # an attention bias is added on every use, loops included
            out = out + w[p + f"{name}_proj.bias"].view(-1, hd)[sel][None, :, None, :]
        proj[name] = out
    positions = torch.arange(x.shape[1])
    q, k = rope(proj["q"], positions, theta), rope(proj["k"], positions, theta)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ proj["v"]


def mlp(ref: Reference, layer: int, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: W_down (SiLU(W_gate x) * W_up x)."""
    p = f"model.layers.{layer}.mlp."
    w = ref.w
    return (torch.nn.functional.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) \
        @ w[p + "down_proj.weight"].T


def norm(ref: Reference, layer: int, which: str, x: torch.Tensor) -> torch.Tensor:
    name = "input_layernorm" if which == "a" else "post_attention_layernorm"
    return rms_norm(x, ref.w[f"model.layers.{layer}.{name}.weight"], float(ref.cfg.get("rms_norm_eps", 1e-5)))


def full_layer(ref: Reference, layer: int, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """f(x): section 0, h = x + W_O.Attn(RMSNorm_a(x)); x' = h + MLP(RMSNorm_m(h))."""
    all_heads = list(range(ref.cfg["num_attention_heads"]))
    h = x + attention(ref, layer, norm(ref, layer, "a", x), all_heads, mask)
    return h + mlp(ref, layer, norm(ref, layer, "m", h))


def causal_mask(B: int, n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None].expand(B, n, n)


def level_mask(mask: torch.Tensor, ran: torch.Tensor) -> torch.Tensor:
    """The attention of a level only some tokens run (an ITT step's selected tokens; with per-token
    depth, docs/depth-semantics.md section 6, the tokens deep enough): each token attends to the earlier
    tokens that ran the level and to itself. mask [B, n, n], ran [B, n] bool."""
    return mask & ran[:, None, :] | torch.eye(mask.shape[-1], dtype=torch.bool)[None]


def logits_of(ref: Reference, x: torch.Tensor) -> torch.Tensor:
    x = rms_norm(x, ref.w["model.norm.weight"], float(ref.cfg.get("rms_norm_eps", 1e-5)))
    head = ref.w.get("lm_head.weight")
    if head is None or ref.cfg.get("tie_word_embeddings"):
        head = ref.w["model.embed_tokens.weight"]
    return x @ head.T


# ---- the forward ------------------------------------------------------------------------------------
Layer = Callable[[Reference, int, torch.Tensor, torch.Tensor], torch.Tensor]


def run_layers(ref: Reference, ids: torch.Tensor, layer_fn: Layer = full_layer, with_logits: bool = True,
               layers_done: Callable[[int], None] | None = None):
    """ids [B, n] (every row its own sequence from position 0) -> logits [B, n, V] (or the final
    states when with_logits is False); `layer_fn(ref, layer, x, mask)` computes each layer, and
    `layers_done(1)` is called after each (a progress bar's update)."""
    B, n = ids.shape
    x = ref.w["model.embed_tokens.weight"][ids]
    mask = causal_mask(B, n)
    for layer in range(ref.num_layers):
        x = layer_fn(ref, layer, x, mask)
        if layers_done is not None:
            layers_done(1)
    return logits_of(ref, x) if with_logits else x


@torch.no_grad()
def forward(model_dir: str | Path, token_ids: list[int], depth: Any = None, *, return_decisions: bool = False,
            force: dict | None = None, dtype: torch.dtype = torch.float64):
    """Logits [n_tokens, vocab] of the plain decoder (a Llama has no depth knobs or decisions)."""
    if knob_values(depth):
        raise ValueError(f"a plain Llama has no depth knobs, got {knob_values(depth)}")
    ref = load(model_dir, dtype)
    logits = run_layers(ref, torch.as_tensor(list(token_ids), dtype=torch.long)[None])[0]
    return (logits, {}) if return_decisions else logits


def knob_values(depth: Any) -> dict[str, Any]:
    """The knobs set in a DepthParams, a dict of knobs, or None."""
    if depth is None:
        return {}
    if isinstance(depth, dict):
        return {k: v for k, v in depth.items() if v is not None}
    return depth.set_knobs()
