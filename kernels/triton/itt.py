"""Triton kernels of ITT's routed step (torch versions: `kernels/itt.py`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from depthserve.kernels.triton.common import pow2

# ---- ITT routed step ------------------------------------------------------------------------------


@triton.jit
def _itt_route_kernel(y_ptr, w_ptr, bias, thr_ptr, scores_ptr, slot_ptr, rows_ptr, count_ptr, num_rows,
                      DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: score every row, select by threshold, compact the selected rows in order."""
    offset = tl.program_id(0) * 0  # an int32 scalar carried through the loop
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    for start in range(0, num_rows, BLOCK_R):
        rows = start + r
        r_mask = rows < num_rows
        logit = tl.zeros([BLOCK_R], tl.float32)
        for k in range(0, DIM, BLOCK_D):
            cols = k + d
            c_mask = cols < DIM
            y = tl.load(y_ptr + rows.to(tl.int64)[:, None] * DIM + cols[None, :],
                        mask=r_mask[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
            logit += tl.sum(y * w[None, :], axis=1)
        score = tl.sigmoid(logit + bias)
        thr = tl.load(thr_ptr + rows, mask=r_mask, other=float("inf"))
        enabled = thr < float("inf")  # +inf: the step is off for this row's request
        selected = (score >= thr) & enabled & r_mask
        rank = tl.cumsum(selected.to(tl.int32), axis=0)
        slot = tl.where(selected, offset + rank - 1, tl.where(enabled, -1, -2))
        tl.store(scores_ptr + rows, score, mask=r_mask)
        tl.store(slot_ptr + rows, slot, mask=r_mask)
        tl.store(rows_ptr + offset + rank - 1, rows, mask=selected)
        offset += tl.sum(selected.to(tl.int32), axis=0)
    tl.store(count_ptr, offset)


def itt_route(y, router_weight, router_bias: float, thresholds):
    num_rows, dim = y.shape
    scores = torch.empty(num_rows, dtype=torch.float32, device=y.device)
    slot_of_row = torch.empty(num_rows, dtype=torch.int32, device=y.device)
    rows = torch.empty(num_rows, dtype=torch.int32, device=y.device)
    count = torch.zeros(1, dtype=torch.int32, device=y.device)
    if num_rows:
        _itt_route_kernel[(1,)](y.contiguous(), router_weight.contiguous(), float(router_bias),
                                thresholds.to(torch.float32).contiguous(), scores, slot_of_row, rows, count, num_rows,
                                DIM=dim, BLOCK_R=128, BLOCK_D=min(pow2(dim), 128))
    selected = int(count.item())
    return scores, slot_of_row, rows[:selected].long()


@triton.jit
def _itt_update_kernel(y_ptr, f_ptr, slot_ptr, scores_ptr, phi_ptr, alpha,
                       DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAPER_SKIP: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    d = tl.arange(0, BLOCK_D)
    offs = row.to(tl.int64) * DIM + d
    mask = d < DIM
    phi = tl.load(phi_ptr + d, mask=mask, other=0.0).to(tl.float32)
    if slot >= 0:  # selected: y += alpha * s * f_t(y) * phi_t
        y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
        f = tl.load(f_ptr + slot.to(tl.int64) * DIM + d, mask=mask).to(tl.float32)
        s = tl.load(scores_ptr + row)
        tl.store(y_ptr + offs, (y + alpha * s * f * phi).to(y_ptr.dtype.element_ty), mask=mask)
    elif slot == -1:
        if PAPER_SKIP:  # skipped: y += y * phi_t
            y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
            tl.store(y_ptr + offs, (y + y * phi).to(y_ptr.dtype.element_ty), mask=mask)


def itt_update(y, step_out, slot_of_row, scores, phi, alpha: float, skip_rule: str) -> None:
    num_rows, dim = y.shape
    if num_rows == 0:
        return
    _itt_update_kernel[(num_rows,)](y, step_out.contiguous(), slot_of_row.to(torch.int32), scores, phi.contiguous(),
                                    float(alpha), DIM=dim, BLOCK_D=pow2(dim), PAPER_SKIP=skip_rule == "paper")
