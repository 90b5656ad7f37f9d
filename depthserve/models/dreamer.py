"""Dreamer: depth recurrence with depth attention and expert attention (depth-semantics.md section 3;
paper 002, Eq. 2, 5, 7, 8).

One shared block applied `depth` times (the request's knob, 1..D). x_0 is the token embedding; for
depth index d = 0..depth-1:

    y       = x_d + DA(x_0..x_d) + SA(x_d)          DA, SA: each with its own pre-norm
    y       = y + EA(y)                              EA: its own pre-norm
    x_{d+1} = RMSNorm_out(y)                         the LM head reads x_depth

- SA: causal attention over tokens, QK-norm (per head, then RoPE over positions), one dense KV
  slot per depth (`depth{d}`): a request at depth n holds n slots' pages.
- DA: the token's own states across depths (append then attend: depth d sees 0..d), RoPE over the
  depth index (`da_rope`: "depth", or "reversed_half": the first half of the frequency pairs use d,
  the second half D - 1 - d with D the trained depth). Its cache is per token and of constant size
  (tokens x depth x 2 x d_DA values for one step): allocated when the step's tokens start their
  forward, compacted as tokens finish (a request's tokens finish at its depth), released at the end
  of the step. It never grows with the sequence (SlotKind.TOKEN_DEPTH, not in the page pool).
- EA: sigmoid-gated top-k MoE of SwiGLU experts; logits q.k_e / sqrt(r) with q = RoPE_d(W_q h)
  (rank r, rotated by the depth index, keys unrotated); top-k on logit + b (the checkpoint's
  selection bias); weights g_e / sum_topk g. Runs grouped by expert (tokens sorted by expert, one
  matmul per active expert).
- attn_experts = A > 0: the QKV and output projections are top-1 MoEs of linear experts; one
  router (same form as EA's) per token and depth picks e for both; projection = sigma_e x (W_e +
  W_shared) with the shared expert folded in at load time (Eq. 8).

The checkpoint reader (read_spec / DreamerSpec / read_weights) is shared with the reference
implementation (depthserve/models/dreamer_reference.py); nothing else is.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from depthserve.depth import DepthParams, KnobSpec
from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.kernels import ops
from depthserve.layers.attention import paged_attention
from depthserve.layers.norm import RMSNorm
from depthserve.layers.rotary import apply_rope, rope_tables
from depthserve.loading.checkpoint import FORMAT_VERSION, CheckpointFormatError

DA_ROPE_MODES = ("depth", "reversed_half")
# Expert attention runs all experts as one batched matmul (rows padded to the busiest expert's
# count) when that computes at most this many rows per (token, expert) pair; else one per expert.
PADDED_EXPERTS_MAX_ROWS_PER_PAIR = 4


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

    def to_section(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "architecture": "dreamer",
            "dreamer": {
                "depth": self.depth,
                "da_dim": self.da_dim,
                "da_heads": self.da_heads,
                "da_rope": self.da_rope,
                "da_rope_theta": self.da_rope_theta,
                "num_experts": self.num_experts,
                "top_k": self.top_k,
                "expert_rank": self.expert_rank,
                "expert_intermediate_size": self.expert_intermediate_size,
                "router_rope_theta": self.router_rope_theta,
                "attn_experts": self.attn_experts,
                "qk_norm_eps": self.qk_norm_eps,
            },
        }


def _int(body: dict, name: str, minimum: int, default: Any = None) -> int:
    value = body.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CheckpointFormatError(f"depth.dreamer.{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(body: dict, name: str, default: float, positive: bool = True) -> float:
    value = body.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (positive and not value > 0):
        raise CheckpointFormatError(f"depth.dreamer.{name} must be a positive number, got {value!r}")
    return float(value)


def read_spec(section: dict, hf_config: dict) -> DreamerSpec:
    """The config's `depth` section of a Dreamer checkpoint, checked (CheckpointFormatError naming the field)."""
    body = section.get("dreamer")
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


def read_weights(cfg: dict, spec: DreamerSpec, weights: dict[str, torch.Tensor], source: str = "checkpoint") -> dict:
    """Check every Dreamer tensor is present with its shape and nothing else is; returns the tensors."""
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
        out["lm_head.weight"] = weights["lm_head.weight"]  # tied in config: ignored
    return out


# ---- the engine's model ----------------------------------------------------------------------------------
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
    def from_hf(cls, cfg: dict) -> "DreamerConfig":
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(cfg.get("rope_theta", 10000.0)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def slot_name(depth_index: int) -> str:
    return f"depth{depth_index}"


@dataclass(frozen=True)
class DreamerPlan:
    """One request's depth, fixed for its lifetime, and its cache layout (`depth` dense slots)."""

    depth: int
    layout: CacheLayout


class DreamerRecord:
    """Per-position expert choices of one sequence: EA top-k ids [pos, D, k] and attention expert [pos, D]
    (-1: not run at that depth)."""

    def __init__(self, depth: int, top_k: int):
        self.ea = np.full((64, depth, top_k), -1, dtype=np.int32)
        self.attn = np.full((64, depth), -1, dtype=np.int32)

    def write(self, start: int, ea: np.ndarray, attn: np.ndarray) -> None:
        end = start + len(ea)
        if end > len(self.ea):
            grow = max(end, 2 * len(self.ea))
            self.ea = np.concatenate([self.ea, np.full((grow - len(self.ea),) + self.ea.shape[1:], -1, np.int32)])
            self.attn = np.concatenate([self.attn, np.full((grow - len(self.attn),) + self.attn.shape[1:], -1,
                                                           np.int32)])
        self.ea[start:end] = ea
        self.attn[start:end] = attn


def depth_rope_angles(dim: int, depth_index: int, trained_depth: int, theta: float, mode: str) -> torch.Tensor:
    """[dim // 2] fp32 rotary angles at a depth index (mode "reversed_half": the second half of the
    frequency pairs run at D - 1 - d)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    pos = torch.full((dim // 2,), float(depth_index), dtype=torch.float64)
    if mode == "reversed_half":
        pos[dim // 4:] = float(trained_depth - 1 - depth_index)
    return (pos * inv_freq).float()


class DreamerForCausalLM(nn.Module):
    uses_step_batch = True

    def __init__(self, cfg: DreamerConfig, spec: DreamerSpec, max_positions: int):
        super().__init__()
        self.config, self.spec = cfg, spec
        d, H, H_kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        E, f, A, dda = spec.num_experts, spec.expert_intermediate_size, spec.attn_experts, spec.da_dim
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        eps = cfg.rms_norm_eps
        self.da_norm, self.sa_norm, self.ea_norm, self.out_norm = (RMSNorm(d, eps) for _ in range(4))
        self.q_norm, self.k_norm = RMSNorm(hd, spec.qk_norm_eps), RMSNorm(hd, spec.qk_norm_eps)
        self.da_qkv = nn.Parameter(torch.zeros(3 * dda, d), requires_grad=False)
        self.da_o = nn.Parameter(torch.zeros(d, dda), requires_grad=False)
        self.q_size, self.kv_size = H * hd, H_kv * hd
        qkv_rows = self.q_size + 2 * self.kv_size
        if A == 0:
            self.sa_qkv = nn.Parameter(torch.zeros(qkv_rows, d), requires_grad=False)
            self.sa_o = nn.Parameter(torch.zeros(d, self.q_size), requires_grad=False)
        else:  # experts with the shared expert folded in (Eq. 8)
            self.sa_qkv = nn.Parameter(torch.zeros(A, qkv_rows, d), requires_grad=False)
            self.sa_o = nn.Parameter(torch.zeros(A, d, self.q_size), requires_grad=False)
        self.ea_gate_up = nn.Parameter(torch.zeros(E, 2 * f, d), requires_grad=False)
        self.ea_down = nn.Parameter(torch.zeros(E, d, f), requires_grad=False)
        # Routers run in fp32 whatever the model dtype (re-set by finish_load after a cast).
        self._fp32: dict[str, torch.Tensor] = {}
        self.routers: dict[str, dict[str, torch.Tensor]] = {}
        self.max_positions = max_positions
        self.scale = hd**-0.5
        self.da_scale = spec.da_head_dim**-0.5
        self._tables(torch.device("cpu"))
        # Per-token depth cache accounting (SlotKind.TOKEN_DEPTH): values held now (0 between steps),
        # and one record per step: (tokens, largest depth in the batch, peak values held).
        self.token_depth_live_values = 0
        self.token_depth_steps: deque[tuple[int, int, int]] = deque(maxlen=4096)
        self.checkpoint_path = "this checkpoint"

    def _tables(self, device) -> None:
        cfg, spec = self.config, self.spec
        cos, sin = rope_tables(cfg.head_dim, self.max_positions, cfg.rope_theta, device=device)
        self.rope_cos, self.rope_sin = cos, sin
        D = spec.depth
        da = torch.stack([depth_rope_angles(spec.da_head_dim, j, D, spec.da_rope_theta, spec.da_rope) for j in range(D)])
        router = torch.stack([depth_rope_angles(spec.expert_rank, j, D, spec.router_rope_theta, "depth")
                              for j in range(D)])
        self.da_cos, self.da_sin = da.cos().to(device), da.sin().to(device)
        self.router_cos, self.router_sin = router.cos().to(device), router.sin().to(device)

    # ---- what the engine asks of every model -------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def depth_knobs(self) -> dict[str, KnobSpec]:
        D = self.spec.depth
        return {"depth": KnobSpec("depth", f"recurrences of the shared block (trained depth D={D})", 1, D, D)}

    def plan_depth(self, depth: DepthParams) -> DreamerPlan:
        depth = depth.normalized(self.depth_knobs())
        n = self.spec.depth if depth.depth is None else depth.depth
        kv = self.config.num_kv_heads
        # base_slots=1: depth 0 is the one slot every request has (depth >= 1).
        layout = CacheLayout(tuple(SlotSpec(slot_name(j), SlotKind.DENSE, kv) for j in range(n)), base_slots=1)
        return DreamerPlan(n, layout)

    def cache_layout(self, depth: DepthParams) -> CacheLayout:
        return self.plan_depth(depth).layout

    def token_depth_values(self, num_tokens: int, depth: int | None = None) -> int:
        """Values of the per-token depth cache for `num_tokens` tokens (bound: tokens x D x 2 x d_DA)."""
        return num_tokens * (depth or self.spec.depth) * 2 * self.spec.da_dim

    def step_cache_bytes_bound(self, max_step_tokens: int) -> int:
        """The most bytes the per-token depth cache can take in one step of `max_step_tokens`
        tokens: the engine sets this aside from its cache memory before sizing the page pool."""
        return self.token_depth_values(max_step_tokens) * self.da_qkv.element_size()

    def step_cache_bytes(self) -> tuple[dict[SlotKind, int], dict[SlotKind, int]]:
        """Bytes of the per-token depth cache (outside the page pool): held now (0 between steps),
        and the peak of the last step."""
        size = self.da_qkv.element_size()
        last = self.token_depth_steps[-1][2] if self.token_depth_steps else 0
        return {SlotKind.TOKEN_DEPTH: self.token_depth_live_values * size}, {SlotKind.TOKEN_DEPTH: last * size}

    def depth_flops(self, tokens: int, depth: int, logit_rows: int) -> float:
        """FLOPs of `tokens` positions (0..tokens-1) at `depth` recurrences, plus the LM head rows."""
        cfg, spec = self.config, self.spec
        d, H, H_kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        r, f, E, A, dda = spec.expert_rank, spec.expert_intermediate_size, spec.num_experts, spec.attn_experts, spec.da_dim
        per_depth = 2 * d * 3 * dda + 2 * dda * d  # DA projections
        per_depth += 2 * d * (H + 2 * H_kv) * hd + 2 * H * hd * d  # SA projections (one expert when A > 0)
        per_depth += 2 * d * r + 2 * r * E + spec.top_k * 3 * 2 * d * f  # EA router + top-k experts
        if A:
            per_depth += 2 * d * r + 2 * r * A
        ctx_sum = tokens * (tokens + 1) / 2
        da_pairs = tokens * depth * (depth + 1) / 2  # depth j attends to j + 1 states
        return tokens * depth * per_depth + depth * 4 * H * hd * ctx_sum + 4 * dda * da_pairs \
            + logit_rows * 2 * d * cfg.vocab_size

    def depth_report(self, seq) -> dict:
        plan: DreamerPlan = seq.state["depth_plan"]
        tokens = seq.num_computed_tokens
        rows = len(seq.output_token_ids)
        flops = self.depth_flops(tokens, plan.depth, rows)
        plain = self.depth_flops(tokens, self.spec.depth, rows)
        return {
            "architecture": "dreamer",
            "depth": plan.depth,
            "trained_depth": self.spec.depth,
            "tokens": tokens,
            "flops": flops,  # this request's FLOPs
            "plain_flops": plain,  # the same tokens at the trained depth D (the model's default)
            "relative_compute": flops / plain if plain else 1.0,
        }

    def routing_record(self, seq) -> dict[str, np.ndarray] | None:
        """Expert choices over the computed tokens: {"ea": [n, D, k], "attn": [n, D]} (-1: depth not run)."""
        record: DreamerRecord | None = seq.state.get("dreamer_record")
        if record is None:
            return None
        n = seq.num_computed_tokens
        return {"ea": record.ea[:n].copy(), "attn": record.attn[:n].copy()}

    # ---- the forward --------------------------------------------------------------------------------
    def _router(self, name: str, h: torch.Tensor, depth_index: int) -> torch.Tensor:
        """Router logits q.k_e / sqrt(r), q = RoPE_d(W_q h), fp32 on every path. [rows, experts]"""
        router = self.routers[name]
        q = h.float() @ router["query"].t()
        r = q.shape[-1]
        cos, sin = self.router_cos[depth_index], self.router_sin[depth_index]
        q1, q2 = q[:, : r // 2], q[:, r // 2 :]
        q = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
        return (q @ router["keys"].t()) / math.sqrt(r)

    @staticmethod
    def _grouped(x: torch.Tensor, weight: torch.Tensor, order: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x[i] @ weight[e_i]^T, grouped by expert: rows sorted by expert, one matmul per active expert."""
        out = x.new_empty(x.shape[0], weight.shape[1])
        start = 0
        for e, count in enumerate(counts):
            if count:
                rows = order[start : start + count]
                out[rows] = x.index_select(0, rows) @ weight[e].t()
                start += count
        return out

    def _sa(self, x, cos, sin, pool, meta, depth_index):
        cfg = self.config
        n = x.shape[0]
        h = self.sa_norm(x)
        choice = None
        if self.spec.attn_experts:
            logits = self._router("sa", h, depth_index)
            choice = (logits + self.routers["sa"]["bias"]).argmax(-1)
            sigma = torch.sigmoid(logits.gather(1, choice[:, None]))[:, 0].to(x.dtype)[:, None]
            order = torch.argsort(choice, stable=True)
            counts = torch.bincount(choice, minlength=self.spec.attn_experts).tolist()
            qkv = self._grouped(h, self.sa_qkv, order, counts) * sigma
        else:
            qkv = h @ self.sa_qkv.t()
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(n, cfg.num_heads, cfg.head_dim))
        k = self.k_norm(k.reshape(n, cfg.num_kv_heads, cfg.head_dim))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        out = paged_attention(q, k, v, pool, meta, slice(None), self.scale).reshape(n, self.q_size)
        if choice is not None:
            return self._grouped(out, self.sa_o, order, counts) * sigma, choice
        return out @ self.sa_o.t(), None

    def _da(self, x, k_cache, v_cache, depth_index):
        """Depth attention: append this depth's key/value to each token's depth cache, then attend over 0..d."""
        spec = self.spec
        n = x.shape[0]
        q, k, v = (self.da_norm(x) @ self.da_qkv.t()).view(n, 3, spec.da_heads, spec.da_head_dim).unbind(1)
        cos = self.da_cos[depth_index].expand(n, -1)
        sin = self.da_sin[depth_index].expand(n, -1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache[:, depth_index] = k
        v_cache[:, depth_index] = v
        valid = torch.full((n,), depth_index + 1, dtype=torch.int32, device=x.device)
        out = ops.depth_attention(q, k_cache, v_cache, valid, self.da_scale)
        return out.reshape(n, spec.da_dim) @ self.da_o.t()

    def _ea(self, y, depth_index):
        """Expert attention: sigmoid gates, top-k on logit + b, grouped by expert."""
        spec = self.spec
        h = self.ea_norm(y)
        logits = self._router("ea", h, depth_index)
        top = torch.topk(logits + self.routers["ea"]["bias"], spec.top_k, dim=-1).indices  # [n, k]
        gates = torch.sigmoid(logits.gather(1, top))
        weights = (gates / gates.sum(-1, keepdim=True)).to(y.dtype)
        flat = top.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts = flat[order]  # each (token, expert) pair's expert, sorted
        tokens = torch.arange(h.shape[0], device=h.device).repeat_interleave(spec.top_k)[order]
        counts = torch.bincount(flat, minlength=spec.num_experts)
        width = int(counts.max())
        if spec.num_experts * width <= PADDED_EXPERTS_MAX_ROWS_PER_PAIR * len(flat):
            expert_out = self._experts_padded(h, tokens, experts, counts, width)
        else:
            expert_out = self._experts_looped(h, tokens, counts.tolist())
        out = torch.zeros_like(y)
        out.index_add_(0, tokens, expert_out * weights.reshape(-1)[order][:, None])
        return out, top

    def _expert_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """SwiGLU expert MLP; weights [..., 2f, d] and [..., d, f] (one expert, or a stack of experts)."""
        f = self.spec.expert_intermediate_size
        gate, up = (x @ gate_up.transpose(-1, -2)).split([f, f], dim=-1)
        return (F.silu(gate) * up) @ down.transpose(-1, -2)

    def _experts_looped(self, h, tokens, counts: list[int]) -> torch.Tensor:
        """Each (token, expert) pair's expert output, in pair order: one matmul per active expert."""
        outs, start = [], 0
        for e, count in enumerate(counts):
            if count:
                rows = tokens[start : start + count]
                outs.append(self._expert_mlp(h.index_select(0, rows), self.ea_gate_up[e], self.ea_down[e]))
                start += count
        return torch.cat(outs)

    def _experts_padded(self, h, tokens, experts, counts, width: int) -> torch.Tensor:
        """The same in two batched matmuls over all experts, each expert's rows padded to `width`: for
        decode batches, where the pairs spread over most experts a few rows each and one small matmul
        per expert costs more in calls than in arithmetic."""
        slot = torch.arange(len(tokens), device=h.device) - (torch.cumsum(counts, 0) - counts)[experts]
        position = experts * width + slot
        x = h.new_zeros(self.spec.num_experts * width, h.shape[1]).index_copy_(0, position, h.index_select(0, tokens))
        out = self._expert_mlp(x.view(self.spec.num_experts, width, -1), self.ea_gate_up, self.ea_down)
        return out.reshape(-1, h.shape[1]).index_select(0, position)

    def forward(self, input_ids, positions, pool, meta) -> torch.Tensor:
        step = meta.batch
        spec, cfg = self.spec, self.config
        kv = cfg.num_kv_heads
        x = self.embed_tokens(input_ids)
        out = torch.empty_like(x)
        n_rows = x.shape[0]
        depths = [item.plan.depth for item in step.items]
        max_depth = max(depths)
        # The step's per-token depth cache: its tokens x the batch's largest depth (<= D).
        shape = (n_rows, max_depth, spec.da_heads, spec.da_head_dim)
        k_cache, v_cache = x.new_zeros(shape), x.new_zeros(shape)  # zeros: unread depths stay finite
        live = peak = 2 * k_cache.numel()
        self.token_depth_live_values = live
        cos, sin = self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype)
        ea_record = torch.full((n_rows, spec.depth, spec.top_k), -1, dtype=torch.int32, device=x.device)
        attn_record = torch.full((n_rows, spec.depth), -1, dtype=torch.int32, device=x.device)
        active = list(step.items)
        rows = np.arange(n_rows)  # packed rows of the active tokens, ascending
        rows_t = None  # the same as a tensor (None: every row)
        for j in range(max_depth):
            still = [item for item in active if item.plan.depth > j]
            if len(still) < len(active):
                # Tokens whose request stops at depth j finish their forward: x_j is final, their
                # depth cache is released (the cache is compacted to the tokens still running).
                new_rows = np.concatenate([np.arange(i.row, i.row + i.num_tokens) for i in still])
                keep = torch.from_numpy(np.searchsorted(rows, new_rows)).to(x.device)
                done = torch.from_numpy(np.setdiff1d(np.arange(len(rows)), keep.cpu().numpy())).to(x.device)
                out[torch.from_numpy(rows).to(x.device)[done]] = x.index_select(0, done)
                x, cos, sin = x.index_select(0, keep), cos.index_select(0, keep), sin.index_select(0, keep)
                k_cache, v_cache = k_cache.index_select(0, keep), v_cache.index_select(0, keep)
                live = 2 * k_cache.numel()
                self.token_depth_live_values = live
                active, rows = still, new_rows
                rows_t = torch.from_numpy(rows).to(x.device)
            sa_meta = step.slot_meta(active, [slice(j * kv, (j + 1) * kv)] * len(active))
            sa, choice = self._sa(x, cos, sin, pool, sa_meta, j)
            y = x + self._da(x, k_cache, v_cache, j) + sa
            ea, top = self._ea(y, j)
            x = self.out_norm(y + ea)
            index = slice(None) if rows_t is None else rows_t
            ea_record[index, j] = top.to(torch.int32)
            if choice is not None:
                attn_record[index, j] = choice.to(torch.int32)
        out[slice(None) if rows_t is None else rows_t] = x
        del k_cache, v_cache
        self.token_depth_live_values = 0
        self.token_depth_steps.append((n_rows, max_depth, peak))
        self._record(step, ea_record.cpu().numpy(), attn_record.cpu().numpy())
        return out

    def _record(self, step, ea: np.ndarray, attn: np.ndarray) -> None:
        for item in step.items:
            record = item.seq.state.get("dreamer_record")
            if record is None:
                record = item.seq.state["dreamer_record"] = DreamerRecord(self.spec.depth, self.spec.top_k)
            rows = slice(item.row, item.row + item.num_tokens)
            record.write(item.start, ea[rows], attn[rows])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # the LM head reads x_depth (already normed)

    # ---- weights ------------------------------------------------------------------------------------
    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        cfg, spec = self.config, self.spec
        hf = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "tie_word_embeddings": cfg.tie_word_embeddings}
        w = read_weights(hf, spec, weights, self.checkpoint_path)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(w["model.embed_tokens.weight"])
            if cfg.tie_word_embeddings or "lm_head.weight" not in w:
                self.lm_head.weight = self.embed_tokens.weight
            else:
                self.lm_head.weight.copy_(w["lm_head.weight"])
            for norm in ("da_norm", "sa_norm", "ea_norm", "out_norm"):
                getattr(self, norm).weight.copy_(w[P + norm + ".weight"])
            self.q_norm.weight.copy_(w[P + "sa.q_norm.weight"])
            self.k_norm.weight.copy_(w[P + "sa.k_norm.weight"])
            self.da_qkv.copy_(torch.cat([w[P + f"da.{n}_proj.weight"] for n in "qkv"]))
            self.da_o.copy_(w[P + "da.o_proj.weight"])
            if spec.attn_experts == 0:
                self.sa_qkv.copy_(torch.cat([w[P + f"sa.{n}_proj.weight"] for n in "qkv"]))
                self.sa_o.copy_(w[P + "sa.o_proj.weight"])
            else:  # Eq. 8: sigma_e x W_e + sigma_e x W_shared = sigma_e x (W_e + W_shared)
                experts = torch.cat([w[P + f"sa.experts.{n}_proj.weight"] for n in "qkv"], dim=1)
                shared = torch.cat([w[P + f"sa.shared_expert.{n}_proj.weight"] for n in "qkv"])
                self.sa_qkv.copy_(experts + shared[None])
                self.sa_o.copy_(w[P + "sa.experts.o_proj.weight"] + w[P + "sa.shared_expert.o_proj.weight"][None])
            self.ea_gate_up.copy_(torch.cat([w[P + "ea.experts.gate_proj.weight"],
                                             w[P + "ea.experts.up_proj.weight"]], dim=1))
            self.ea_down.copy_(w[P + "ea.experts.down_proj.weight"])
        names = ["ea"] + (["sa"] if spec.attn_experts else [])
        for name in names:
            for part in ("query.weight", "keys", "bias"):
                self._fp32[f"{name}.{part}"] = w[P + f"{name}.router.{part}"].float().clone()
        self.finish_load(torch.device("cpu"))

    def finish_load(self, device: torch.device) -> None:
        """Routers and rotary tables stay fp32 whatever dtype the model was cast to."""
        self.routers = {}
        for key, value in self._fp32.items():
            name, part = key.split(".", 1)
            self.routers.setdefault(name, {})[part.split(".")[0]] = value.to(device)
        self._tables(device)


def build_model(hf_config: dict, spec: DreamerSpec, max_len: int) -> DreamerForCausalLM:
    return DreamerForCausalLM(DreamerConfig.from_hf(hf_config), spec, max_len)


def reference_forward(model_dir, token_ids, depth=None, *, dtype=torch.float64, **kwargs):
    from depthserve.models import dreamer_reference

    return dreamer_reference.forward(model_dir, token_ids, depth, dtype=dtype, **kwargs)


# ---- make-tiny ----------------------------------------------------------------------------------------
def tiny_spec(like: str | None = None, *, depth: int = 4, attn_experts: int = 2, da_rope: str = "reversed_half",
              num_experts: int | None = None, top_k: int = 2) -> DreamerSpec:
    if like:
        return DreamerSpec(depth=depth, da_dim=64, num_experts=num_experts or 32, top_k=top_k, expert_rank=32,
                           expert_intermediate_size=256, attn_experts=attn_experts, da_rope=da_rope)
    return DreamerSpec(depth=depth, da_dim=16, num_experts=num_experts or 6, top_k=top_k, expert_rank=8,
                       expert_intermediate_size=32, attn_experts=attn_experts, da_rope=da_rope,
                       router_rope_theta=100.0, da_rope_theta=100.0)


def random_weights(cfg: dict, spec: DreamerSpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    from depthserve.tiny import EMBED_STD, LOGIT_STD, QK_STD

    d = cfg["hidden_size"]
    dda, f, r = spec.da_dim, spec.expert_intermediate_size, spec.expert_rank
    H, hd = cfg["num_attention_heads"], cfg["head_dim"]
    w = {}
    for name, shape in tensor_shapes(cfg, spec).items():
        fan_in = shape[-1]
        std = 1.0 / fan_in**0.5
        if name == "model.embed_tokens.weight":
            std = EMBED_STD
        elif name == "lm_head.weight":
            std = LOGIT_STD / d**0.5  # peaked output distributions
        elif name.startswith(P + "da.q_proj") or name.startswith(P + "da.k_proj"):
            std = QK_STD / d**0.5
        elif "shared_expert" in name or ".experts." in name and ".sa." in name:
            std = 0.8 / fan_in**0.5
        elif name.endswith("router.keys"):
            std = 2.0  # spread-out router logits: clear top-k margins
        elif name.endswith("router.bias"):
            std = 0.2
        tensor = torch.randn(*shape, generator=gen) * std
        if name.endswith("norm.weight"):
            tensor = 1 + torch.randn(*shape, generator=gen) * 0.1
        w[name] = tensor.contiguous()
    del dda, f, r, H, hd
    return w


def make_tiny(out: Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None, tokenizer=None,
              **options) -> Path:
    """A random Dreamer checkpoint (options: depth, attn_experts, da_rope, num_experts, top_k)."""
    from depthserve.loading.checkpoint import depth_section, write_checkpoint
    from depthserve.tiny import base_config, load_default_tokenizer, model_shapes

    shapes = model_shapes(like, num_kv_heads)
    spec = tiny_spec(like, **options)
    tokenizer = tokenizer or load_default_tokenizer()
    cfg = base_config(tokenizer, shapes, tied=bool(like))
    cfg.update(architectures=["DreamerForCausalLM"], model_type="dreamer",
               num_hidden_layers=1,  # the one shared block
               intermediate_size=spec.expert_intermediate_size, depth=depth_section(spec))
    return write_checkpoint(Path(out), cfg, random_weights(cfg, spec, torch.Generator().manual_seed(seed)), tokenizer)
