import torch
import torch.nn.functional as F
from torch import nn

from depthserve.kernels import cpu_native
from depthserve.kernels.ops import KernelOp


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


# One fused op in every dtype: for bf16/fp16 inputs torch accumulates and normalises in fp32 and
# rounds once at the end (the Hugging Face form rounds before the weight multiply too; measured on
# bf16 rows of SmolLM2's width, the fused op is the closer of the two to a float64 reference). The
# CPU form is the same arithmetic in one native call (eager F.rms_norm dispatches ~10 ops on the CPU);
# a compiled step fuses the torch form anyway.
RMS_NORM = KernelOp("rms_norm", torch=_rms_norm_torch, cpu=cpu_native.rms_norm)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMS_NORM(x, self.weight, self.eps)
