import torch
import torch.nn.functional as F
from torch import nn

from depthserve.kernels import cpu_native


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op in every dtype: for bf16/fp16 inputs torch accumulates and normalises in fp32
        # and rounds once at the end (the Hugging Face form rounds before the weight multiply too;
        # measured on bf16 rows of SmolLM2's width, the fused op is the closer of the two to a
        # float64 reference). In eager bf16 decode it replaces seven dispatched ops per norm.
        if (x.device.type == "cpu" and x.dtype in cpu_native.FLOAT_DTYPES and not torch.compiler.is_compiling()
                and cpu_native.available()):
            # the same arithmetic in one native call (eager F.rms_norm dispatches ~10 ops on the CPU;
            # a compiled step fuses it anyway)
            return cpu_native.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
