"""Rotary position embedding, half-split ("rotate_half", NeoX/HF Llama) layout."""

from __future__ import annotations

import torch
from torch import nn

from depthserve.kernels import cpu_native
from depthserve.kernels.ops import KernelOp, triton_kernel


def rope_tables(head_dim: int, max_positions: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_positions, head_dim // 2], computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def register_rope_buffers(module: nn.Module, head_dim: int, max_positions: int) -> None:
    """The module's `rope_cos` and `rope_sin` buffers, [max_positions, head_dim // 2], left empty: the
    model is built on the meta device and computes them in finish_load, after its cast (they stay
    fp32). Computed on meta, arange would run through torch's Python references, which import
    torch._dynamo, about a second of an eager engine's start-up (layers/embedding.py)."""
    module.register_buffer("rope_cos", torch.empty(max_positions, head_dim // 2), persistent=False)
    module.register_buffer("rope_sin", torch.empty(max_positions, head_dim // 2), persistent=False)


def _apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _apply_rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One native call in fp32 (the torch form dispatches a dozen ops, rounding each in x's dtype),
    where the layout fits the kernel: [tokens, heads, head_dim] rows of unit stride, float tables."""
    if x.dim() == 3 and x.stride(-1) == 1 and cos.dtype in cpu_native.FLOAT_DTYPES:
        return cpu_native.apply_rope(x, cos.contiguous(), sin.contiguous())
    return _apply_rope_torch(x, cos, sin)


# On CUDA one Triton launch in fp32 (kernels/triton/pointwise.py) instead of the torch form's eight.
APPLY_ROPE = KernelOp("apply_rope", torch=_apply_rope_torch, cpu=_apply_rope_cpu,
                      cuda=triton_kernel("pointwise", "apply_rope"))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim // 2] at each token's position."""
    return APPLY_ROPE(x, cos, sin)
