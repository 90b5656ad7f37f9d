"""Rotary position embedding, half-split ("rotate_half", NeoX/HF Llama) layout."""

from __future__ import annotations

import torch

from depthserve.kernels import cpu_native


def rope_tables(head_dim: int, max_positions: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_positions, head_dim // 2], computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim // 2] at each token's position."""
    native = cpu_native.FLOAT_DTYPES
    if (x.device.type == "cpu" and x.dim() == 3 and x.dtype in native and cos.dtype in native and x.stride(-1) == 1
            and not torch.compiler.is_compiling() and cpu_native.available()):
        # one native call, in fp32 (the torch form below dispatches a dozen ops, rounding each in x's dtype)
        return cpu_native.apply_rope(x, cos.contiguous(), sin.contiguous())
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
