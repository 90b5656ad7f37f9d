"""The PUT reference (docs/depth-semantics.md section 4; paper 004, Eq. 6-9): the test oracle.

A plain full-sequence forward written from the equations, in float64 by default: no cache, no
paging, no batching, nothing of the engine's model code.

    x = embed(ids)
    prefix layers (plain Llama, section 0)
    for t = 1..loops, for each core layer (H = the normed input):
        h  = x + W_O . (SiLU(O) * O),   O = causal softmax attention of RMSNorm_a(x), per head
        Z  = ReLU(H W_gate + P(t)) * (H W_up),   H = RMSNorm_m(h)
        U  = SiLU(Z + DWConv_k(Z)),   DWConv_k(Z)_n = sum_{j<k} w_j * Z_{n-j}   (Z_m = 0 for m < 0)
        x  = h + U W_down
    suffix layers (plain Llama); logits = lm_head(RMSNorm(x))

The checkpoint's layers are read as the Llama layers of one unrolled pass (prefix i at layer i,
core j at n_prefix + j, suffix i after the core), so the plain layers are section 0's as written
in depthserve/oracles/llama.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from depthserve.oracles.llama import (
    Reference,
    causal_mask,
    full_layer,
    head_attention,
    knob_values,
    level_mask,
    load,
    logits_of,
    norm,
)
from depthserve.archs.put.format import PUTSpec, layer_prefixes, read_spec


def _as_llama_layers(spec: PUTSpec, weights: dict, path: str) -> dict:
    """Rename every layer's tensors to `model.layers.{index}.` in one pass's order (nothing kept apart)."""
    for index, prefix in enumerate(layer_prefixes(spec)):
        for name in [name for name in weights if name.startswith(prefix)]:
            weights[f"model.layers.{index}." + name[len(prefix):]] = weights.pop(name)
    return {}


def load_put(model_dir: str | Path, dtype: torch.dtype = torch.float64) -> Reference:
    return load(model_dir, dtype, read_spec, _as_llama_layers)


def head_outputs(ref: Reference, layer: int, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """O: every head's causal softmax attention output, concatenated [B, n, H * head_dim]. x is normed."""
    heads = head_attention(ref, layer, x, list(range(ref.cfg["num_attention_heads"])), mask)  # [B, H, n, hd]
    return heads.transpose(1, 2).flatten(2)


def dwconv(z: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
    """Causal depthwise convolution over tokens (dim -2): out_n = sum_{j<k} conv[j] * z_{n-j}, z_m = 0 for m < 0."""
    n = z.shape[-2]
    out = torch.zeros_like(z)
    for j in range(conv.shape[0]):
        if j < n:
            out[..., j:, :] = out[..., j:, :] + conv[j] * z[..., : n - j, :]
    return out


def dwconv_over(z: torch.Tensor, conv: torch.Tensor, ran: torch.Tensor) -> torch.Tensor:
    """dwconv over each row's subsequence of the tokens that ran the pass (section 6: the pass-t
    conv state is the last k-1 rows of Z of the tokens that ran pass t); other rows are zero.
    z [B, n, f], ran [B, n] bool."""
    out = torch.zeros_like(z)
    for b in range(z.shape[0]):
        index = ran[b].nonzero()[:, 0]
        out[b, index] = dwconv(z[b, index], conv)
    return out


def core_layer(ref: Reference, j: int, t: int, x: torch.Tensor, mask: torch.Tensor,
               ran: torch.Tensor | None = None) -> torch.Tensor:
    """Core layer j at step t (section 4); with `ran` [B, n] (per-token loops, section 6) only those
    tokens run it, attending to the earlier of them, and the others keep x."""
    layer = ref.spec.n_prefix + j
    w = ref.w
    p = f"model.layers.{layer}."
    O = head_outputs(ref, layer, norm(ref, layer, "a", x), mask if ran is None else level_mask(mask, ran))
    h = x + (F.silu(O) * O) @ w[p + "self_attn.o_proj.weight"].T  # Eq. 7, elementwise per head
    H = norm(ref, layer, "m", h)
    P_t = w[p + "mlp.step_embedding"][t - 1]
    Z = torch.relu(H @ w[p + "mlp.gate_proj.weight"].T + P_t) * (H @ w[p + "mlp.up_proj.weight"].T)  # Eq. 9
    conv = dwconv(Z, w[p + "mlp.conv.weight"]) if ran is None else dwconv_over(Z, w[p + "mlp.conv.weight"], ran)
    U = F.silu(Z + conv)  # Eq. 8
    out = h + U @ w[p + "mlp.down_proj.weight"].T
    return out if ran is None else torch.where(ran[..., None], out, x)


def put_loops(spec: PUTSpec, depth: Any) -> int:
    """The `loops` knob: core passes in 1..T (default T)."""
    value = knob_values(depth).get("loops")
    if value is None:
        return spec.steps
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= spec.steps:
        raise ValueError(f"PUT loops must be an integer in 1..{spec.steps}, got {value!r}")
    return value


@torch.no_grad()
def forward(model_dir: str | Path, token_ids: list[int], depth: Any = None, *, return_decisions: bool = False,
            force: dict | None = None, dtype: torch.dtype = torch.float64, schedule: list | None = None):
    """Logits [n_tokens, vocab] of the full-sequence forward with `loops` core passes (default T), or
    with `schedule` (one knob setting per token) each token's own loops (section 6). PUT has no
    discrete decisions: with return_decisions the second value is {}."""
    ref = load_put(model_dir, dtype)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)[None]
    if schedule is None:
        logits = run(ref, ids, put_loops(ref.spec, depth))[0]
    else:
        if len(schedule) != ids.shape[1]:
            raise ValueError(f"a schedule needs one setting per token: {len(schedule)} for {ids.shape[1]} tokens")
        token_loops = torch.tensor([[put_loops(ref.spec, setting) for setting in schedule]])
        logits = run(ref, ids, int(token_loops.max()), token_loops)[0]
    return (logits, {}) if return_decisions else logits


def run(ref: Reference, ids: torch.Tensor, loops: int, token_loops: torch.Tensor | None = None) -> torch.Tensor:
    """ids [B, n] (every row its own sequence from position 0) -> logits [B, n, V] after `loops` core
    passes, or each token after its own `token_loops` [B, n] (at most `loops`; section 6)."""
    *_, logits = run_each_loop(ref, ids, loops, every_loop=False, token_loops=token_loops)
    return logits


def run_each_loop(ref: Reference, ids: torch.Tensor, loops: int, every_loop: bool = True,
                  token_loops: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The logits the model gives at loops = 1..`loops` (suffix layers and head after each core
    pass), from one run of the shared passes; only the last with `every_loop` False. With
    `token_loops`, token n runs passes 1..token_loops[n] and the suffix reads its last pass."""
    spec: PUTSpec = ref.spec
    mask = causal_mask(ids.shape[0], ids.shape[1])
    x = ref.w["model.embed_tokens.weight"][ids]
    for i in range(spec.n_prefix):
        x = full_layer(ref, i, x, mask)
    out = []
    for t in range(1, loops + 1):
        ran = None if token_loops is None else token_loops >= t
        for j in range(spec.n_core):
            x = core_layer(ref, j, t, x, mask, ran)
        if every_loop or t == loops:
            out.append(logits_of(ref, _suffix(ref, x, mask)))
    return out


def _suffix(ref: Reference, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    spec: PUTSpec = ref.spec
    for i in range(spec.n_suffix):
        x = full_layer(ref, spec.n_prefix + spec.n_core + i, x, mask)
    return x
