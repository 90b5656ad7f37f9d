"""Reference implementations: a plain full-sequence forward per architecture, the test oracle.

Written straight from ../shared/design/depth-semantics.md (section numbers in the comments;
"Eq." numbers are the papers'), with no cache, no paging, no batching tricks, and nothing of the
engine's model code or kernels: it shares only the checkpoint reader. Kept simple on purpose.

    logits = forward(model_dir, token_ids, depth=None)                       # [n_tokens, vocab]
    logits, decisions = forward(model_dir, ids, depth, return_decisions=True)  # ITT routing
    logits = forward(model_dir, ids, depth, force={(layer, step): bool[n]})   # teacher-forced

A decision is {"selected": bool[n], "score": float32[n], "threshold": float, "margin": |s - tau|}:
the margin rule of the contract compares decisions only where the margin exceeds a small delta.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from depthserve.loading.checkpoint import (
    NUM_QUANTILES,
    ITTSpec,
    LlamaSpec,
    SGTSpec,
    pop_itt_weights,
    read_depth_spec,
    threshold,
)
from depthserve.loading.hf_loader import load_hf_dir


@dataclass
class Reference:
    cfg: dict[str, Any]
    spec: LlamaSpec | SGTSpec | ITTSpec
    w: dict[str, torch.Tensor]  # HF names, fp32
    itt: dict[int, dict[str, Any]]  # ITT layer -> router_w [T, d], router_b [T], phi [T+1, d], quantiles [T, 101]

    @property
    def num_layers(self) -> int:
        return self.cfg["num_hidden_layers"]


def load(model_dir: str | Path, dtype: torch.dtype = torch.float64) -> Reference:
    path = Path(model_dir)
    stamp = max(os.stat(f).st_mtime_ns for f in [path / "config.json", *path.glob("*.safetensors")])
    return _load(str(path.resolve()), stamp, dtype)


@functools.lru_cache(maxsize=4)
def _load(path: str, stamp: int, dtype: torch.dtype) -> Reference:
    cfg, weights = load_hf_dir(Path(path), progress=False)
    spec = read_depth_spec(cfg)
    itt = {}
    if isinstance(spec, ITTSpec):
        itt = pop_itt_weights(spec, weights, path, require_calibration=False)
        for entry in itt.values():
            entry["router_w"], entry["phi"] = entry["router_w"].to(dtype), entry["phi"].to(dtype)
    weights = {k: v.to(dtype) for k, v in weights.items()}
    return Reference(cfg, spec, weights, itt)


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
    cfg, w = ref.cfg, ref.w
    H, H_kv, hd, theta = attention_dims(cfg)
    p = f"model.layers.{layer}.self_attn."
    B, n, _ = x.shape
    positions = torch.arange(n)
    out = torch.zeros_like(x)
    for j, i in enumerate(heads):
        g = i // (H // H_kv)
        wq = w[p + "q_proj.weight"][i * hd : (i + 1) * hd]
        wk = w[p + "k_proj.weight"][g * hd : (g + 1) * hd]
        wv = w[p + "v_proj.weight"][g * hd : (g + 1) * hd]
        q, k, v = x @ wq.T, x @ wk.T, x @ wv.T
        if p + "q_proj.bias" in w:  # an attention bias is added on every use, loops included
            q = q + w[p + "q_proj.bias"][i * hd : (i + 1) * hd]
            k = k + w[p + "k_proj.bias"][g * hd : (g + 1) * hd]
            v = v + w[p + "v_proj.bias"][g * hd : (g + 1) * hd]
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(~mask, float("-inf"))
        head_out = torch.softmax(scores, dim=-1) @ v  # [B, n, hd]
        scale = 1.0 if head_scales is None else head_scales[j]
        out = out + scale * (head_out @ w[p + "o_proj.weight"][:, i * hd : (i + 1) * hd].T)
    return out


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


def logits_of(ref: Reference, x: torch.Tensor) -> torch.Tensor:
    x = rms_norm(x, ref.w["model.norm.weight"], float(ref.cfg.get("rms_norm_eps", 1e-5)))
    head = ref.w.get("lm_head.weight")
    if head is None or ref.cfg.get("tie_word_embeddings"):
        head = ref.w["model.embed_tokens.weight"]
    return x @ head.T


# ---- section 1: SGT ---------------------------------------------------------------------------------
def sgt_loops(spec: SGTSpec, depth: Any) -> dict[int, int]:
    """The `loops` knob: an int for every looped layer or a map layer -> count (others: trained K_l)."""
    loops = {s.layer: s.loops for s in spec.layers}
    value = _knob(depth, "loops")
    if isinstance(value, int):
        loops = {layer: value for layer in loops}
    elif isinstance(value, dict):
        loops.update({int(k): int(v) for k, v in value.items()})
    return loops


def sgt_layer(ref: Reference, layer: int, x: torch.Tensor, loops: int, mask: torch.Tensor) -> torch.Tensor:
    spec = ref.spec.layer(layer)
    h = x + attention(ref, layer, norm(ref, layer, "a", x), list(range(ref.cfg["num_attention_heads"])), mask)
    for _ in range(loops):
        # Eq. 6 / section 1: h = h + sum_{i in S_l} W_O^(i) Attn_i(RMSNorm_a(h)), the layer's own weights and norm
        h = h + attention(ref, layer, norm(ref, layer, "a", h), list(spec.heads), mask, spec.head_scales)
    return h + mlp(ref, layer, norm(ref, layer, "m", h))  # the MLP once, after the loops


# ---- section 2: ITT ---------------------------------------------------------------------------------
def itt_ratios(spec: ITTSpec, depth: Any) -> list[float]:
    """selection_ratios (default: trained), zeroed after `thinking_steps`."""
    ratios = _knob(depth, "selection_ratios")
    ratios = [float(r) for r in (ratios if ratios is not None else spec.trained_ratios)]
    steps = _knob(depth, "thinking_steps")
    if steps is not None:
        ratios = [r if t < steps else 0.0 for t, r in enumerate(ratios)]
    return ratios


def itt_layer(ref: Reference, layer: int, x: torch.Tensor, ratios: list[float], mask: torch.Tensor,
              decisions: dict, force: dict | None, calibration: dict | None) -> torch.Tensor:
    spec: ITTSpec = ref.spec
    p = ref.itt[layer]
    phi = p["phi"]
    y = full_layer(ref, layer, x, mask) * phi[0]  # 2.1: y = f(x) ⊙ phi_0 (Eq. 7's Y^(0) ⊙ phi^(0))
    B, n, _ = y.shape
    for t in range(1, spec.steps + 1):
        # 2.2 (Eq. 5): s = sigmoid(r_t . y + b_t), in the reference's precision (fp64 by default, >= fp32)
        score = torch.sigmoid(y @ p["router_w"][t - 1] + float(p["router_b"][t - 1]))
        if calibration is not None:
            # Calibration: this (layer, step)'s score distribution under threshold routing of every
            # earlier (layer, step) at its trained ratio; 101 quantiles.
            levels = torch.linspace(0, 1, NUM_QUANTILES, dtype=torch.float64)
            valid = calibration.get("valid")  # [B, n]: real tokens of right-padded sequences
            scores = score[valid] if valid is not None else score.flatten()
            table = torch.quantile(scores.double(), levels)
            calibration.setdefault(layer, [None] * spec.steps)[t - 1] = table.float()
            table = table.float().double()  # route with the table as it will be stored
            quantiles = table.numpy()
        else:
            quantiles = p["quantiles"][t - 1].double().numpy() if p["quantiles"] is not None else None
        rho = ratios[t - 1]
        if rho <= 0:
            continue  # rho_t = 0: step t is off, no update for any token
        if quantiles is None:
            raise ValueError(f"layer {layer} has no calibration table (run `depthserve calibrate`)")
        tau = threshold(quantiles, rho)  # causal rule: tau_t(rho) = the (1 - rho) quantile
        selected = score >= tau
        if force is not None and (layer, t) in force:
            selected = torch.as_tensor(np.asarray(force[(layer, t)], dtype=bool)).reshape(B, n)
        decisions[(layer, t)] = {
            "selected": selected[0].numpy().copy() if B == 1 else selected.numpy().copy(),
            "score": score[0].numpy().copy() if B == 1 else score.numpy().copy(),
            "threshold": tau,
            "margin": (score - tau).abs()[0].numpy() if B == 1 else (score - tau).abs().numpy(),
        }
        # 2.3: f_t attends over the step-t slot: earlier tokens also selected at step t, and itself.
        step_mask = mask & selected[:, None, :]
        step_mask = step_mask | torch.eye(n, dtype=torch.bool)[None]  # rows of skipped tokens are discarded
        f_t = full_layer(ref, layer, y, step_mask)
        s = score[..., None]
        chosen = y + p_alpha(spec, t) * s * f_t * phi[t]  # Eq. 6-7: y + alpha_t * s * f_t(y) ⊙ phi_t
        skipped = y + y * phi[t] if spec.skip_rule == "paper" else y  # skipped: y + y ⊙ phi_t
        y = torch.where(selected[..., None], chosen, skipped)
    return y


def p_alpha(spec: ITTSpec, t: int) -> float:
    return float(spec.alphas[t - 1])


# ---- the forward ------------------------------------------------------------------------------------
def run(ref: Reference, ids: torch.Tensor, depth: Any = None, force: dict | None = None,
        calibration: dict | None = None, with_logits: bool = True):
    """ids: [B, n] (every row its own sequence from position 0). Returns (logits [B, n, V] or None, decisions)."""
    B, n = ids.shape
    x = ref.w["model.embed_tokens.weight"][ids]
    mask = causal_mask(B, n)
    decisions: dict = {}
    spec = ref.spec
    loops = sgt_loops(spec, depth) if isinstance(spec, SGTSpec) else {}
    ratios = itt_ratios(spec, depth) if isinstance(spec, ITTSpec) else None
    for layer in range(ref.num_layers):
        if layer in loops:
            x = sgt_layer(ref, layer, x, loops[layer], mask)
        elif isinstance(spec, ITTSpec) and layer in spec.layers:
            x = itt_layer(ref, layer, x, ratios, mask, decisions, force, calibration)
        else:
            x = full_layer(ref, layer, x, mask)
    return (logits_of(ref, x) if with_logits else None), decisions


@torch.no_grad()
def forward(model_dir: str | Path, token_ids: list[int], depth: Any = None, *, return_decisions: bool = False,
            force: dict | None = None, dtype: torch.dtype = torch.float64):
    """Logits [n_tokens, vocab] of the plain full-sequence forward with these depth settings
    (computed in float64 by default: the oracle's own rounding stays far below fp32 tolerances).

    depth: a DepthParams, a dict of knobs, or None (the checkpoint's defaults).
    force: {(layer, step): bool[n_tokens]} ITT decisions to use instead of the threshold rule.
    return_decisions: also return {(layer, step): {"selected", "score", "threshold", "margin"}}.
    """
    from depthserve.architectures import ARCHITECTURE_MODULES, architecture_module

    architecture = json.loads((Path(model_dir) / "config.json").read_text()).get("depth", {}).get("architecture")
    if architecture in ARCHITECTURE_MODULES:  # its own reference (depthserve/architectures.py)
        return architecture_module(architecture).reference_forward(
            model_dir, token_ids, depth, return_decisions=return_decisions, force=force, dtype=dtype)
    ref = load(model_dir, dtype)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)[None]
    logits, decisions = run(ref, ids, depth, force)
    return (logits[0], decisions) if return_decisions else logits[0]


@torch.no_grad()
def calibrate(model_dir: str | Path, sequences, dtype: torch.dtype = torch.float32,
              batch_tokens: int = 65536) -> dict[int, torch.Tensor]:
    """Router-score quantiles per ITT layer ([T, 101]) over calibration sequences (each from
    position 0: a [B, n] tensor or a list of token lists), computed in forward order with threshold
    routing, every step at its trained ratio (section 2, causal routing)."""
    ref = load(model_dir, dtype)
    if not isinstance(ref.spec, ITTSpec):
        raise ValueError(f"{model_dir} is not an ITT checkpoint")
    seqs = [list(map(int, s)) for s in (sequences.tolist() if torch.is_tensor(sequences) else sequences)]
    seqs = [s for s in seqs if s]
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)  # right padding: causal, so it never reaches real tokens
    valid = torch.zeros(len(seqs), n, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        valid[i, : len(s)] = True
    tables: dict = {"valid": valid}
    run(ref, ids, None, None, tables, with_logits=False)
    tables.pop("valid")
    return {layer: torch.stack(rows) for layer, rows in tables.items()}


def _knob(depth: Any, name: str) -> Any:
    if depth is None:
        return None
    if isinstance(depth, dict):
        return depth.get(name)
    return getattr(depth, name, None)
