"""The single place where an op is bound to an implementation.

`ops.<name>(...)` runs the Triton kernel when the op's first tensor argument lives on a CUDA
device (and Triton imports), else the torch fallback of the same signature. `force_triton()`
runs the Triton kernels on any device: on CPU that needs `TRITON_INTERPRET=1` set before the
first kernel is used (the kernel tests and the engine tests' Triton variant do this).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable, Iterator

import torch

from depthserve.kernels import torch_ops

OP_NAMES = (
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_prefill_attention_varlen",
    "itt_route",
    "itt_update",
    "depth_attention",
    "saobp_decode_attention",
    "saobp_bias_update",
    "saobp_prefill_attention",
)
# paged_prefill_attention: the varlen kernel covers single prompts; saobp_prefill_attention: torch only
_TRITON_OPS = frozenset(OP_NAMES) - {"paged_prefill_attention", "saobp_prefill_attention"}

_force_triton = os.environ.get("DEPTHSERVE_FORCE_TRITON", "") == "1"


@functools.cache
def _triton_module():
    try:
        return importlib.import_module("depthserve.kernels.triton_ops")
    except ImportError:
        return None


def triton_available() -> bool:
    return _triton_module() is not None


@contextlib.contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Run every op that has a Triton kernel through it, on any device, inside the block."""
    global _force_triton
    previous, _force_triton = _force_triton, enabled
    try:
        yield
    finally:
        _force_triton = previous


def _uses_triton(name: str, first_arg) -> bool:
    if name not in _TRITON_OPS:
        return False
    on_gpu = isinstance(first_arg, torch.Tensor) and first_arg.is_cuda
    if not (on_gpu or _force_triton):
        return False
    if not triton_available():
        if _force_triton:
            raise RuntimeError("force_triton() is on but triton cannot be imported")
        return False
    return True


def _dispatcher(name: str) -> Callable:
    fallback = getattr(torch_ops, name)

    @functools.wraps(fallback)
    def call(*args, **kwargs):
        if _uses_triton(name, args[0] if args else None):
            return getattr(_triton_module(), name)(*args, **kwargs)
        return fallback(*args, **kwargs)

    return call


class _Ops:
    """Namespace of dispatched ops (attributes are the names in OP_NAMES)."""

    def __init__(self) -> None:
        for name in OP_NAMES:
            setattr(self, name, _dispatcher(name))


ops = _Ops()
