"""The SAOBP reference (docs/depth-semantics.md section 5; paper 003, Eq. 9-11): the plain decoder whose
SAOBP layers refine each head's attention with the one-step belief-propagation bias, computed from
the materialised [n, n] attention matrix of the full sequence, no cache."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from depthserve.oracles.llama import (
    Reference,
    attention_dims,
    full_layer,
    knob_values,
    load,
    mlp,
    logits_of,
    norm,
    rope,
    run_layers,
)
from depthserve.archs.saobp.format import SAOBPSpec, read_spec
from depthserve.errors import InvalidDepthError


def load_saobp(model_dir: str | Path, dtype: torch.dtype = torch.float64) -> Reference:
    return load(model_dir, dtype, read_spec)


def saobp_attention(ref: Reference, layer: int, x: torch.Tensor, spec: SAOBPSpec) -> torch.Tensor:
    """Section 5 from the materialised [n, n] attention matrix of each head. x: [n, d], normed."""
    cfg, w = ref.cfg, ref.w
    H, H_kv, hd, theta = attention_dims(cfg)
    p = f"model.layers.{layer}.self_attn."
    n = x.shape[0]
    positions = torch.arange(n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()  # [j, k]: k <= j
    m0 = spec.m0
    out = torch.zeros_like(x)
    for i in range(H):
        g = i // (H // H_kv)
        q = x @ w[p + "q_proj.weight"][i * hd : (i + 1) * hd].T
        k = x @ w[p + "k_proj.weight"][g * hd : (g + 1) * hd].T
        v = x @ w[p + "v_proj.weight"][g * hd : (g + 1) * hd].T
        if p + "q_proj.bias" in w:
            q = q + w[p + "q_proj.bias"][i * hd : (i + 1) * hd]
            k = k + w[p + "k_proj.bias"][g * hd : (g + 1) * hd]
            v = v + w[p + "v_proj.bias"][g * hd : (g + 1) * hd]
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        s = (q @ k.T) / math.sqrt(hd)  # s_jk
        s = s.masked_fill(~causal, float("-inf"))
        A = torch.softmax(s, dim=-1)  # unrefined causal rows; A_ik = 0 for k > i
        M = A + m0 * (1 - A)  # Eq. 9: the message of row i about key k (masked entries: exactly m_0)
        L = torch.log(M / m0)  # log(M_ik / m_0): 0 for masked entries, in [-lambda, 0] (high) / [0, lambda] (low)
        del M
        # c_k for row j = sum over rows i < j (k <= i by construction); with self_message also i = j.
        C = torch.cumsum(L, dim=0)
        if not spec.self_message:
            C = C - L
        del L
        refined = torch.softmax(s + C, dim=-1)  # masked entries stay -inf
        del C, s, A
        out = out + (refined @ v) @ w[p + "o_proj.weight"][:, i * hd : (i + 1) * hd].T
    return out


@torch.no_grad()
def forward(model_dir: str | Path, token_ids: list[int], depth: Any = None, *, return_decisions: bool = False,
            force: dict | None = None, dtype: torch.dtype = torch.float64):
    """Logits [n_tokens, vocab] of the full-sequence SAOBP forward (section 0 with section 5's attention)."""
    knobs = knob_values(depth)
    if knobs:
        raise InvalidDepthError(f"SAOBP has no depth knobs (lambda is trained); got {sorted(knobs)}")
    ref, states = final_states(model_dir, token_ids, dtype)
    logits = logits_of(ref, states)
    return (logits, {}) if return_decisions else logits


@torch.no_grad()
def final_states(model_dir: str | Path, token_ids: list[int],
                 dtype: torch.dtype = torch.float64) -> tuple[Reference, torch.Tensor]:
    """The reference and its last layer's states [n_tokens, hidden] (before the final norm): a long
    sequence's logits can then be taken a block of rows at a time (`logits_of`)."""
    ref = load_saobp(model_dir, dtype)
    spec: SAOBPSpec = ref.spec
    saobp_layers = set(spec.layer_indices(ref.num_layers))

    def layer_fn(ref: Reference, layer: int, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if layer not in saobp_layers:
            return full_layer(ref, layer, x, mask)
        h = x + saobp_attention(ref, layer, norm(ref, layer, "a", x[0]), spec)[None]
        return h + mlp(ref, layer, norm(ref, layer, "m", h))

    return ref, run_layers(ref, torch.as_tensor(list(token_ids), dtype=torch.long)[None], layer_fn, with_logits=False)[0]
