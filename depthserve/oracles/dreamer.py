"""Reference forward of Dreamer (docs/depth-semantics.md section 3), the test oracle.

Plain full-sequence equations in float64: no cache, no paging, no batching, no grouping, and
nothing of the engine's model code or kernels (it shares only the checkpoint reader of
depthserve/archs/dreamer/format.py: read_spec, read_weights). For depth index d = 0..depth-1:

    y       = x_d + DA(x_0..x_d) + SA(x_d)
    y       = y + EA(y)
    x_{d+1} = RMSNorm_out(y)                   logits = W_lm x_depth

    logits = forward(model_dir, ids, depth=None)
    logits, decisions = forward(model_dir, ids, depth, return_decisions=True)
    logits = forward(model_dir, ids, depth, force={("ea", d): int[n, k], ("attn", d): int[n]})
    logits = forward(model_dir, ids, schedule=[{"depth": 3}, {"depth": 1}, ...])   # per-token depth
    logits, decisions = run(cfg, spec, weights, ids[B, n], depth)       # batched, autograd-friendly

Per-token depth (section 6): token n runs depths 0..depth_n - 1; the sequence-attention slot of
depth d holds the tokens with depth_n > d, and a token running depth d attends to the earlier of
them and to itself; the LM head reads x_{depth_n}. A constant schedule is the fixed knob.

Decisions: {("ea", d): {"choice": int[n, k] (sorted ids), "margin": float[n]},
            ("attn", d): {"choice": int[n], "margin": float[n]}} where the margin is the gap between
the k-th and (k+1)-th biased score (logit + b): a choice may flip under rounding only where it is
small; a token that does not run depth d has choice -1 and an infinite margin there. With `force`,
the forced choices replace the rule (teacher forcing) and the gates are those of the forced
experts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from depthserve.archs.dreamer.format import P, read_spec, read_weights
from depthserve.oracles.llama import knob_values, level_mask, rms_norm
from depthserve.oracles.llama import load as load_reference

NO_MARGIN = float("inf")


def load(model_dir, dtype=torch.float64):
    """(HF config, spec, weights in `dtype`) of a Dreamer checkpoint, every tensor checked."""
    ref = load_reference(model_dir, dtype, read_spec)
    read_weights(ref.cfg, ref.spec, ref.w, str(model_dir))
    return ref.cfg, ref.spec, ref.w


def rotate(x, angle):
    """Half-split rotary embedding of x [..., dim] by angles [..., dim/2] (broadcast)."""
    half = x.shape[-1] // 2
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def depth_angle(dim: int, d: int, D: int, theta: float, mode: str) -> torch.Tensor:
    """Angles of depth index d: every pair at d ("depth"); "reversed_half": pairs in the second
    half of the frequency pairs at D - 1 - d."""
    pos = torch.full((dim // 2,), float(d), dtype=torch.float64)
    if mode == "reversed_half":
        pos[dim // 4:] = float(D - 1 - d)
    return pos * inv_freq(dim, theta)


def router_logits(w, name: str, h, d: int, spec) -> torch.Tensor:
    """logit_e = RoPE_d(W_q h) . k_e / sqrt(r) (keys unrotated). [n, experts]"""
    r = spec.expert_rank
    q = h @ w[P + f"{name}.router.query.weight"].T
    q = rotate(q, depth_angle(r, d, spec.depth, spec.router_rope_theta, "depth").to(q.dtype))
    return q @ w[P + f"{name}.router.keys"].T / math.sqrt(r)


def choose(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, np.ndarray]:
    """Top-k ids of the biased scores (sorted ids) and the margin between the k-th and (k+1)-th."""
    ordered = scores.sort(dim=-1, descending=True)
    ids = ordered.indices[:, :k].sort(dim=-1).values
    if scores.shape[-1] > k:
        margin = (ordered.values[:, k - 1] - ordered.values[:, k]).detach().double().numpy()
    else:
        margin = np.full(scores.shape[0], NO_MARGIN)
    return ids, margin


def not_run(choice: torch.Tensor, margin: np.ndarray, runs: torch.Tensor) -> dict:
    """A decision entry: -1 and an infinite margin where the token did not run the depth."""
    ran = runs.numpy()
    shape = (-1,) + (1,) * (choice.dim() - 1)
    return {"choice": np.where(ran.reshape(shape), choice.numpy(), -1), "margin": np.where(ran, margin, NO_MARGIN)}


def knob_depth(depth: Any, D: int) -> int:
    """The `depth` knob: recurrences in 1..D (default D)."""
    value = knob_values(depth).get("depth")
    if value is None:
        return D
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= D:
        raise ValueError(f"depth must be an integer in 1..{D}, got {value!r}")
    return value


@torch.no_grad()
def forward(model_dir, token_ids, depth=None, *, return_decisions: bool = False, force: dict | None = None,
            dtype: torch.dtype = torch.float64, schedule: list | None = None):
    """Logits [n, V] at the `depth` knob, or with `schedule` (one knob setting per token) at each
    token's own depth."""
    cfg, spec, w = load(model_dir, dtype)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)[None]
    if schedule is None:
        logits, decisions = run(cfg, spec, w, ids, knob_depth(depth, spec.depth), force)
    else:
        if len(schedule) != ids.shape[1]:
            raise ValueError(f"a schedule needs one setting per token: {len(schedule)} for {ids.shape[1]} tokens")
        token_depths = torch.tensor([[knob_depth(setting, spec.depth) for setting in schedule]])
        logits, decisions = run(cfg, spec, w, ids, int(token_depths.max()), force, token_depths=token_depths)
    return (logits[0], decisions) if return_decisions else logits[0]


def run(cfg: dict, spec, w: dict, ids: torch.Tensor, depth: int, force: dict | None = None,
        every_depth: bool = False, token_depths: torch.Tensor | None = None):
    """ids [B, n] (every row its own sequence from position 0) -> (logits [B, n, V], decisions);
    with `every_depth`, a list of the logits read at depth 1..depth instead. `token_depths` [B, n]
    (at most `depth`): each token's own depth (section 6), else every token runs `depth`.

    Everything but SA is per token, so it runs over the B * n tokens flattened; the decisions and
    `force` index those flattened tokens (row-major), which for B = 1 are the sequence's tokens.
    """
    D = spec.depth
    force = force or {}
    B, n = ids.shape
    ids = ids.reshape(-1)
    N = len(ids)
    dtype = w["model.embed_tokens.weight"].dtype
    H = cfg["num_attention_heads"]
    H_kv = cfg.get("num_key_value_heads", H)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // H
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    theta = float(cfg.get("rope_theta", 10000.0))
    positions = torch.arange(n, dtype=torch.float64)
    pos_angle = (positions[:, None] * inv_freq(hd, theta)[None, :]).to(dtype)  # [n, hd/2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    dh = spec.da_head_dim
    decisions: dict = {}

    token_depths = torch.full((B, n), depth) if token_depths is None else token_depths
    x = w["model.embed_tokens.weight"][ids]
    states = [x]  # x_0 .. x_d of every token (a token past its depth keeps its last state)
    for d in range(depth):
        runs = token_depths.reshape(-1) > d  # [N]: the tokens that run depth d
        level = level_mask(causal[None].expand(B, n, n), runs.view(B, n))  # SA over slot d
        # ---- DA: each token over its own states x_0..x_d (one or more heads), RoPE over depth ----
        h_da = rms_norm(x, w[P + "da_norm.weight"], eps)
        q = (h_da @ w[P + "da.q_proj.weight"].T).view(N, spec.da_heads, dh)
        q = rotate(q, depth_angle(dh, d, D, spec.da_rope_theta, spec.da_rope).to(dtype))
        keys, values = [], []
        for j, s in enumerate(states):
            hj = rms_norm(s, w[P + "da_norm.weight"], eps)
            kj = (hj @ w[P + "da.k_proj.weight"].T).view(N, spec.da_heads, dh)
            keys.append(rotate(kj, depth_angle(dh, j, D, spec.da_rope_theta, spec.da_rope).to(dtype)))
            values.append((hj @ w[P + "da.v_proj.weight"].T).view(N, spec.da_heads, dh))
        K, Vd = torch.stack(keys, 2), torch.stack(values, 2)  # [N, heads, d+1, dh]
        p = torch.softmax(torch.einsum("nhc,nhjc->nhj", q, K) / math.sqrt(dh), dim=-1)
        da = torch.einsum("nhj,nhjc->nhc", p, Vd).reshape(N, spec.da_dim) @ w[P + "da.o_proj.weight"].T

        # ---- SA: causal over tokens, QK-norm then RoPE over positions; projections maybe top-1 experts ----
        h = rms_norm(x, w[P + "sa_norm.weight"], eps)
        if spec.attn_experts:
            logits = router_logits(w, "sa", h, d, spec)
            chosen, margin = choose(logits + w[P + "sa.router.bias"], 1)
            chosen = chosen[:, 0]
            if ("attn", d) in force:
                chosen = torch.where(runs, torch.as_tensor(np.asarray(force[("attn", d)]), dtype=torch.long), chosen)
            decisions[("attn", d)] = not_run(chosen, margin, runs)
            sigma = torch.sigmoid(logits.gather(1, chosen[:, None]))  # [N, 1]

            def project(inp, name):  # Eq. 7 at inference: sigma x W_e + sigma x W_shared
                we = w[P + f"sa.experts.{name}_proj.weight"][chosen]  # [N, out, in]
                return sigma * torch.einsum("ni,noi->no", inp, we) + sigma * (
                    inp @ w[P + f"sa.shared_expert.{name}_proj.weight"].T)
        else:
            def project(inp, name):
                return inp @ w[P + f"sa.{name}_proj.weight"].T
        q = project(h, "q").view(B, n, H, hd).transpose(1, 2)  # [B, H, n, hd]
        k = project(h, "k").view(B, n, H_kv, hd).transpose(1, 2)
        v = project(h, "v").view(B, n, H_kv, hd).transpose(1, 2)
        q = rotate(rms_norm(q, w[P + "sa.q_norm.weight"], spec.qk_norm_eps), pos_angle)
        k = rotate(rms_norm(k, w[P + "sa.k_norm.weight"], spec.qk_norm_eps), pos_angle)
        group = H // H_kv
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        attn = torch.softmax(scores.masked_fill(~level[:, None], float("-inf")), dim=-1) @ v  # [B, H, n, hd]
        sa = project(attn.transpose(1, 2).reshape(N, H * hd), "o")

        y = x + da + sa

        # ---- EA: sigmoid-gated top-k of SwiGLU experts, top-k on logit + b ----
        h = rms_norm(y, w[P + "ea_norm.weight"], eps)
        logits = router_logits(w, "ea", h, d, spec)
        top, margin = choose(logits + w[P + "ea.router.bias"], spec.top_k)
        if ("ea", d) in force:
            forced = torch.as_tensor(np.asarray(force[("ea", d)]), dtype=torch.long).sort(dim=-1).values
            top = torch.where(runs[:, None], forced, top)
        decisions[("ea", d)] = not_run(top, margin, runs)
        gates = torch.sigmoid(logits.gather(1, top))
        weights = gates / gates.sum(-1, keepdim=True)
        ea = torch.zeros_like(y)
        for slot in range(spec.top_k):
            for e in top[:, slot].unique().tolist():
                mask = top[:, slot] == e
                he = h[mask]
                gate = he @ w[P + "ea.experts.gate_proj.weight"][e].T
                up = he @ w[P + "ea.experts.up_proj.weight"][e].T
                out = (torch.nn.functional.silu(gate) * up) @ w[P + "ea.experts.down_proj.weight"][e].T
                ea = ea.index_put((mask,), ea[mask] + weights[mask, slot, None] * out)
        x = torch.where(runs[:, None], rms_norm(y + ea, w[P + "out_norm.weight"], eps), x)
        states.append(x)

    head = w.get("lm_head.weight") if not cfg.get("tie_word_embeddings", False) else None
    head = w["model.embed_tokens.weight"] if head is None else head
    if every_depth:  # what the model reads at depth 1..depth (training gives every depth a loss)
        return [(x_d @ head.T).view(B, n, -1) for x_d in states[1:]], decisions
    return (x @ head.T).view(B, n, -1), decisions
