"""SwiGLU's gating: SiLU(gate) * up of the packed [gate | up] projection."""

import torch
import torch.nn.functional as F

from depthserve.kernels import cpu_native
from depthserve.kernels.ops import KernelOp, triton_kernel


def _silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# The CPU form takes bf16 rows only: one native call that computes in fp32 and rounds once (the torch
# form dispatches three ops and rounds twice; the native decoder layer, kernels/csrc/decode_layer.cpp,
# calls the same op, so the eager and native layers stay bit-identical). The CUDA form is the same
# arithmetic in one Triton launch (kernels/triton/pointwise.py).
SILU_AND_MUL = KernelOp("silu_and_mul", torch=_silu_and_mul_torch, cpu=cpu_native.silu_and_mul,
                        cpu_dtypes=(torch.bfloat16,), cuda=triton_kernel("pointwise", "silu_and_mul"))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [..., 2 * width] = [gate | up] (SILU_AND_MUL's form for its device
    and dtype)."""
    return SILU_AND_MUL(gate_up)
