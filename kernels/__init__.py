"""Attention and cache kernels, installed as `depthserve.kernels`.

Every op has a torch implementation (the CPU path and the reference) and the hot ones a Triton
kernel of the same signature; `dispatch.Kernels(backend)` binds them. The engine passes its
binding to the model in each step's metadata; `ops` is the "auto" one (Triton on CUDA tensors).
"""

from depthserve.kernels.dispatch import Kernels, ops

__all__ = ["Kernels", "ops"]
