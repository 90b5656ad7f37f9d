"""The ITT reference (docs/depth-semantics.md section 2; paper 001, Eq. 4-7): each ITT layer's dense pass
and T routed thinking steps over the full sequence, no cache. A step's attention is masked to the
tokens selected at that step (and each token to itself); skipped tokens take the skip update.

    logits = forward(model_dir, ids, depth)
    logits, decisions = forward(model_dir, ids, depth, return_decisions=True)
    logits = forward(model_dir, ids, depth, force={(layer, step): bool[n]})   # teacher-forced

A decision is {"selected": bool[n], "score": float[n], "threshold": float, "margin": |s - tau|}: the
contract compares decisions only where the margin exceeds a small delta. `calibrate` computes the
router-score quantile table the causal routing rule reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from depthserve.archs.itt.format import NUM_QUANTILES, ITTSpec, pop_itt_weights, read_spec
from depthserve.oracles.llama import Reference, full_layer, knob_values, level_mask, load, run_layers


def _take_itt(spec: ITTSpec, weights: dict, path: str) -> dict:
    return pop_itt_weights(spec, weights, path, require_calibration=False)


def load_itt(model_dir: str | Path, dtype: torch.dtype) -> Reference:
    ref = load(model_dir, dtype, read_spec, _take_itt)
    for entry in ref.extras.values():
        entry["router_w"], entry["phi"] = entry["router_w"].to(dtype), entry["phi"].to(dtype)
    return ref


def itt_ratios(spec: ITTSpec, depth: Any) -> list[float]:
    """selection_ratios (default: trained), zeroed after `thinking_steps`."""
    knobs = knob_values(depth)
    ratios = knobs.get("selection_ratios")
    ratios = [float(r) for r in (ratios if ratios is not None else spec.trained_ratios)]
    steps = knobs.get("thinking_steps")
    if steps is not None:
        ratios = [r if t < steps else 0.0 for t, r in enumerate(ratios)]
    return ratios


def tau(quantiles: np.ndarray, ratio: float) -> float:
    """The causal rule's threshold: the (1 - rho) quantile of the calibrated scores, linear between
    the 101 levels, as a float32 value (rho = 1: every token; rho = 0 is handled as 'step off')."""
    if ratio >= 1.0:
        return -np.inf
    levels = np.linspace(0.0, 1.0, len(quantiles))
    return float(np.float32(np.interp(1.0 - ratio, levels, np.asarray(quantiles, dtype=np.float64))))


def thresholds(quantiles: np.ndarray, rho: torch.Tensor) -> torch.Tensor:
    """tau(quantiles, rho) of every token's own ratio (section 6); +inf where its step is off."""
    out = torch.full(rho.shape, float("inf"), dtype=torch.float64)
    for ratio in rho.unique().tolist():
        if ratio > 0:
            out[rho == ratio] = tau(quantiles, ratio)
    return out


def itt_layer(ref: Reference, layer: int, x: torch.Tensor, ratios: torch.Tensor, mask: torch.Tensor,
              decisions: dict, force: dict | None, calibration: dict | None) -> torch.Tensor:
    """The ITT layer; `ratios` [B, n, T] holds every token's own ratios (a fixed knob: the same row)."""
    spec: ITTSpec = ref.spec
    p = ref.extras[layer]
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
            table = torch.quantile(scores.detach().double(), levels)
            calibration.setdefault(layer, [None] * spec.steps)[t - 1] = table.float()
            quantiles = table.float().double().numpy()  # route with the table as it will be stored
        else:
            quantiles = p["quantiles"][t - 1].double().numpy() if p["quantiles"] is not None else None
        rho = ratios[..., t - 1]
        on = rho > 0  # rho_t = 0: step t is off for the token, no update
        if not on.any():
            continue
        if quantiles is None:
            raise ValueError(f"layer {layer} has no calibration table (run `depthserve calibrate`)")
        threshold = thresholds(quantiles, rho)  # causal rule: tau_t(rho) = the (1 - rho) quantile
        selected = on & (score >= threshold)
        if force is not None and (layer, t) in force:
            selected = torch.as_tensor(np.asarray(force[(layer, t)], dtype=bool)).reshape(B, n)
        plain = score.detach()
        margin = torch.where(on, (plain - threshold).abs(), torch.inf)

        def row(values: torch.Tensor) -> np.ndarray:
            return (values[0] if B == 1 else values).numpy().copy()

        decisions[(layer, t)] = {"selected": row(selected), "score": row(plain), "threshold": row(threshold),
                                 "margin": row(margin)}
        # 2.3: f_t attends over the step-t slot: earlier tokens also selected at step t, and itself.
        f_t = full_layer(ref, layer, y, level_mask(mask, selected))  # rows of skipped tokens are discarded
        s = score[..., None]
        chosen = y + float(spec.alphas[t - 1]) * s * f_t * phi[t]  # Eq. 6-7: y + alpha_t * s * f_t(y) ⊙ phi_t
        skipped = y + y * phi[t] if spec.skip_rule == "paper" else y  # skipped: y + y ⊙ phi_t
        y = torch.where(selected[..., None], chosen, torch.where(on[..., None], skipped, y))
    return y


def run(ref: Reference, ids: torch.Tensor, depth: Any = None, force: dict | None = None,
        calibration: dict | None = None, with_logits: bool = True, layers_done=None,
        token_ratios: torch.Tensor | None = None):
    """ids [B, n] -> (logits [B, n, V] or final states, decisions); `token_ratios` [B, n, T]: every
    token's own ratios (section 6) instead of the knob's."""
    if token_ratios is None:
        token_ratios = torch.tensor(itt_ratios(ref.spec, depth), dtype=torch.float64).expand(*ids.shape, -1)
    decisions: dict = {}

    def layer_fn(ref: Reference, layer: int, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if layer in ref.spec.layers:
            return itt_layer(ref, layer, x, token_ratios, mask, decisions, force, calibration)
        return full_layer(ref, layer, x, mask)

    return run_layers(ref, ids, layer_fn, with_logits, layers_done), decisions


@torch.no_grad()
def forward(model_dir: str | Path, token_ids: list[int], depth: Any = None, *, return_decisions: bool = False,
            force: dict | None = None, dtype: torch.dtype = torch.float64, schedule: list | None = None):
    """Logits [n_tokens, vocab] with these ratios, or with `schedule` (one knob setting per token)
    each token's own; `force` replaces the threshold rule's decisions."""
    ref = load_itt(model_dir, dtype)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)[None]
    token_ratios = None
    if schedule is not None:
        if len(schedule) != ids.shape[1]:
            raise ValueError(f"a schedule needs one setting per token: {len(schedule)} for {ids.shape[1]} tokens")
        token_ratios = torch.tensor([[itt_ratios(ref.spec, setting) for setting in schedule]], dtype=torch.float64)
    logits, decisions = run(ref, ids, depth, force, None, token_ratios=token_ratios)
    return (logits[0], decisions) if return_decisions else logits[0]


@torch.no_grad()
def calibrate(model_dir: str | Path, sequences, dtype: torch.dtype = torch.float32) -> dict[int, torch.Tensor]:
    """Router-score quantiles per ITT layer ([T, 101]) over calibration sequences (each from
    position 0: a [B, n] tensor or a list of token lists), computed in forward order with threshold
    routing, every step at its trained ratio (section 2, causal routing). A progress bar over the
    layers shows on stderr when it is a terminal."""
    ref = load_itt(model_dir, dtype)
    seqs = [list(map(int, s)) for s in (sequences.tolist() if torch.is_tensor(sequences) else sequences)]
    seqs = [s for s in seqs if s]
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)  # right padding: causal, so it never reaches real tokens
    valid = torch.zeros(len(seqs), n, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        valid[i, : len(s)] = True
    tables: dict = {"valid": valid}
    with tqdm(total=ref.num_layers, desc="calibrating", unit="layer", disable=None) as bar:
        run(ref, ids, None, None, tables, with_logits=False, layers_done=bar.update)
    tables.pop("valid")
    return {layer: torch.stack(rows) for layer, rows in tables.items()}
