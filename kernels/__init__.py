"""Attention and cache kernels, installed as `depthserve.kernels`.

`ops` is the one dispatch point: the model code calls `ops.<name>` and gets the Triton
kernel on a GPU (when one is registered for that op) or the torch fallback, which has the
same signature and is what the CPU path runs.
"""

from depthserve.kernels.dispatch import ops

__all__ = ["ops"]
