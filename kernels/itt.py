"""ITT's routed thinking step (depth-semantics.md section 2): score and select rows, then apply the
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
    scores = torch.sigmoid(y.float() @ router_weight.float() + router_bias)
    enabled = thresholds < float("inf")
    selected = (scores >= thresholds) & enabled
    rank = torch.cumsum(selected.to(torch.int32), dim=0) - 1
    off = torch.full_like(rank, -2, dtype=torch.int32)
    slot_of_row = torch.where(selected, rank.to(torch.int32), torch.where(enabled, off + 1, off))
    return scores, slot_of_row, selected.nonzero().squeeze(1)


def itt_update(
    y: torch.Tensor,  # [rows, d], updated in place
    step_out: torch.Tensor,  # [selected, d] f_t(y) of the selected rows, in selection order
    slot_of_row: torch.Tensor,  # [rows] from itt_route
    scores: torch.Tensor,  # [rows] fp32
    phi: torch.Tensor,  # [d] step encoding phi_t
    alpha: float,
    skip_rule: str,  # "paper": y += y * phi_t for skipped rows; "identity": unchanged
) -> None:
    """ITT step update (depth-semantics 2): selected y += alpha * s * f_t(y) * phi_t.

    Computed densely over all rows and blended with `where` (a decode batch has few rows, and a
    fixed handful of ops costs less than gathering and scattering the selected and skipped rows)."""
    phi = phi.float()
    old = y.float()
    new = old * (1 + phi) if skip_rule == "paper" else old
    new = torch.where((slot_of_row == -1).unsqueeze(1), new, old)
    if len(step_out):
        selected = (slot_of_row >= 0).unsqueeze(1)
        f = step_out.index_select(0, slot_of_row.clamp(min=0).long()).float()
        new = torch.where(selected, old + (alpha * scores).unsqueeze(1) * f * phi, new)
    y.copy_(new)
