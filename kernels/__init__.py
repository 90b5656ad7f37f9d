"""Attention and cache kernels, installed as `depthserve.kernels`.

Every op has a torch implementation (the CPU path and the reference) and the hot ones a Triton
kernel of the same signature; `dispatch.Kernels(backend)` binds them. The engine passes its
binding to the model in each step's metadata.
"""

from depthserve.kernels.dispatch import Kernels

__all__ = ["Kernels"]
