"""ITT's routed thinking step (docs/depth-semantics.md section 2): score and select rows, then apply the
step's update. The torch implementations; Triton kernels in `triton/itt.py`."""

from __future__ import annotations

import torch


def itt_route(
    y: torch.Tensor,  # [rows, d] states entering an ITT step
    router_weight: torch.Tensor,  # [d]
    router_bias: float,
    thresholds: torch.Tensor,  # [rows] fp32; +inf where the row's request has the step off
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router score s = sigmoid(r·y + b) in fp32 and causal threshold selection (s >= tau).

    Returns (scores [rows] fp32, slot_of_row [rows] int32: the row's index among the selected
    rows, -1 if skipped, -2 if the step is off for it, selected_rows [selected] int64 in order).
    """
    scores, selected, enabled = itt_select(y, router_weight, router_bias, thresholds)
    rank = torch.cumsum(selected.to(torch.int32), dim=0) - 1
    off = torch.full_like(rank, -2, dtype=torch.int32)
    slot_of_row = torch.where(selected, rank.to(torch.int32), torch.where(enabled, off + 1, off))
    return scores, slot_of_row, selected.nonzero().squeeze(1)


def itt_select(y: torch.Tensor, router_weight: torch.Tensor, router_bias: float,
               thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router scores s = sigmoid(r·y + b) [rows] fp32, and per row: selected (s >= tau, step on)
    and enabled (the step on for its request: tau finite)."""
    scores = torch.sigmoid(y.float() @ router_weight.float() + router_bias)
    enabled = thresholds < float("inf")
    return scores, (scores >= thresholds) & enabled, enabled


def itt_blend(old: torch.Tensor, step_out: torch.Tensor | None, selected: torch.Tensor, skipped: torch.Tensor,
              scores: torch.Tensor, phi: torch.Tensor, alpha: float, skip_rule: str) -> torch.Tensor:
    """The ITT step update over every row in fp32 (old [rows, d] fp32, step_out [rows, d] fp32 or
    None when no row is selected): selected rows old + alpha * s * f_t * phi_t, skipped rows
    old * (1 + phi_t) (skip rule "paper") or old, the others (step off) old."""
    phi = phi.float()
    new = torch.where(skipped.unsqueeze(1), old * (1 + phi) if skip_rule == "paper" else old, old)
    if step_out is None:
        return new
    return torch.where(selected.unsqueeze(1), old + (alpha * scores).unsqueeze(1) * step_out * phi, new)


def itt_update(
    y: torch.Tensor,  # [rows, d], updated in place
    step_out: torch.Tensor,  # [selected, d] f_t(y) of the selected rows, in selection order
    slot_of_row: torch.Tensor,  # [rows] from itt_route
    scores: torch.Tensor,  # [rows] fp32
    phi: torch.Tensor,  # [d] step encoding phi_t
    alpha: float,
    skip_rule: str,  # "paper": y += y * phi_t for skipped rows; "identity": unchanged
) -> None:
    """ITT step update (docs/depth-semantics.md 2): selected y += alpha * s * f_t(y) * phi_t.

    Computed densely over all rows and blended with `where` (a decode batch has few rows, and a
    fixed handful of ops costs less than gathering and scattering the selected and skipped rows)."""
    f = step_out.index_select(0, slot_of_row.clamp(min=0).long()).float() if len(step_out) else None
    y.copy_(itt_blend(y.float(), f, slot_of_row >= 0, slot_of_row == -1, scores, phi, alpha, skip_rule))
