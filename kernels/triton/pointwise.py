"""A layer's pointwise ops as one Triton launch each: the CUDA forms of the rotary embedding and of
SwiGLU's gate (layers/rotary.py APPLY_ROPE, layers/activation.py SILU_AND_MUL).

An eager step on a GPU launches one kernel per torch op, and the torch forms of these two launch
about eight (rotary: four products, a sum, a difference, the concatenation and the tables' cast) and
two (SiLU, the product); a prefill step runs them in every layer. Each kernel here reads its inputs
once, computes in fp32 and rounds once to the input's dtype, as the CPU's native forms do
(kernels/csrc/rotary.cpp, activation.cpp) and as a compiled step's fused torch forms do. A compiled
step keeps calling the torch forms (KernelOp's compiled rule), which Inductor fuses itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from depthserve.kernels.triton.common import pow2

GATE_BLOCK = 1024  # gate columns per program of silu_and_mul


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_x_token, stride_x_head, stride_table,
                 HALF: tl.constexpr, BLOCK: tl.constexpr):
    token, head = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    row = x_ptr + token * stride_x_token + head * stride_x_head
    x1 = tl.load(row + offs, mask=mask).to(tl.float32)
    x2 = tl.load(row + HALF + offs, mask=mask).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_table + offs, mask=mask).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_table + offs, mask=mask).to(tl.float32)
    out = out_ptr + (token * heads + head) * (2 * HALF)
    tl.store(out + offs, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF + offs, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] (any row strides, unit stride within a head), cos/sin [tokens,
    head_dim // 2] at each token's position: the rotated x, contiguous, in x's dtype."""
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens and heads:
        _rope_kernel[(tokens, heads)](x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0),
                                      HALF=dim // 2, BLOCK=pow2(dim // 2))
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, stride_x_row, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + width + cols, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [..., 2 * width] = [gate | up]: [..., width] in its dtype."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and width:
        block = min(GATE_BLOCK, pow2(width))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](rows, out, width, rows.stride(0), BLOCK=block)
    return out.view(*gate_up.shape[:-1], width)
