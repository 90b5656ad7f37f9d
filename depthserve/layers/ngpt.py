"""nGPT's arithmetic on the unit sphere (Dory's decoder layers): the L2 projection N, the
interpolation that replaces the residual addition, and the two gates whose output N normalises.

Each is one op (kernels/ops.py): the torch form computes as transformers' Dory modules do (N in
fp32, rounded to the input's dtype; the other products rounded in the input's dtype), and is what a
compiled step traces; the CPU form is one native call (kernels/csrc/ngpt.cpp) that computes every
step in fp32 and rounds once, so in fp32 the two agree to rounding and in bf16 the native form is the
closer to an fp32 model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from depthserve.kernels import cpu_native
from depthserve.kernels.ops import KernelOp
from depthserve.layers.rotary import apply_rope


def _l2_normalize_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).sum(-1, keepdim=True) + eps)).type_as(x)


def _interpolate_torch(h: torch.Tensor, y: torch.Tensor, rate: torch.Tensor, eps: float,
                       normalize: bool) -> torch.Tensor:
    moved = h + rate * (_l2_normalize_torch(y, eps) - h)
    return _l2_normalize_torch(moved, eps) if normalize else moved


def _gated_torch(x: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return _l2_normalize_torch(x * torch.sigmoid(gate * scale), eps)


def _swiglu_torch(gate: torch.Tensor, up: torch.Tensor, gate_scale: torch.Tensor, up_scale: torch.Tensor,
                  eps: float) -> torch.Tensor:
    return _l2_normalize_torch(F.silu(gate * gate_scale) * (up * up_scale), eps)


def _unit_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor | None,
                     eps: float) -> torch.Tensor:
    rotated = apply_rope(_l2_normalize_torch(x, eps), cos, sin)
    return rotated if scale is None else rotated * scale.view(x.shape[1:])


def _unit_rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    if x.dim() == 3 and x.stride(-1) == 1 and cos.dtype in cpu_native.FLOAT_DTYPES:
        return cpu_native.unit_rope(x, cos.contiguous(), sin.contiguous(), scale, eps)
    return _unit_rope_torch(x, cos, sin, scale, eps)


L2_NORMALIZE = KernelOp("l2_normalize", torch=_l2_normalize_torch, cpu=cpu_native.l2_normalize)
NGPT_INTERPOLATE = KernelOp("ngpt_interpolate", torch=_interpolate_torch, cpu=cpu_native.ngpt_interpolate)
GATED_L2_NORMALIZE = KernelOp("gated_l2_normalize", torch=_gated_torch, cpu=cpu_native.gated_l2_normalize)
SWIGLU_L2_NORMALIZE = KernelOp("swiglu_l2_normalize", torch=_swiglu_torch, cpu=cpu_native.swiglu_l2_normalize)
UNIT_ROPE = KernelOp("unit_rope", torch=_unit_rope_torch, cpu=_unit_rope_cpu)


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """N(x): x projected onto the unit sphere along its last dimension."""
    return L2_NORMALIZE(x, eps)


def interpolate(h: torch.Tensor, y: torch.Tensor, rate: torch.Tensor, eps: float, normalize: bool) -> torch.Tensor:
    """h + rate * (N(y) - h): nGPT's step from h towards a block's output y (rate [width]); with
    `normalize`, projected back onto the sphere."""
    return NGPT_INTERPOLATE(h, y, rate, eps, normalize)


def gated_l2_normalize(x: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """N(x * sigmoid(gate * scale)): attention's output gate, normalised before W_O."""
    return GATED_L2_NORMALIZE(x, gate, scale, eps)


def swiglu_l2_normalize(gate: torch.Tensor, up: torch.Tensor, gate_scale: torch.Tensor, up_scale: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """N(silu(gate * gate_scale) * (up * up_scale)): the MLP's scaled SwiGLU, normalised before W_down."""
    return SWIGLU_L2_NORMALIZE(gate, up, gate_scale, up_scale, eps)


def unit_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor | None,
              eps: float) -> torch.Tensor:
    """Queries or keys x [tokens, heads, head_dim]: each head projected onto the unit sphere, rotated
    (layers/rotary.py), then times `scale` [heads * head_dim] where given."""
    return UNIT_ROPE(x, cos, sin, scale, eps)
