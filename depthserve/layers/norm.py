import torch
import torch.nn.functional as F
from torch import nn


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
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
