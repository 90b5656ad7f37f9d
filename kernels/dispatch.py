"""The attention and cache ops bound to their forms once per engine.

Each family of ops has a torch implementation (`kernels/<family>.py`: the CPU path and the
reference) and, for the hot ones, a Triton kernel of the same signature and meaning
(`kernels/triton/<family>.py`). A `Kernels` object binds every op once, by its backend, with the
rule every op follows (kernels/ops.py, `KernelOp.form`):

- "auto": the Triton kernel when the op's first tensor lives on a CUDA device (and triton
  imports); on the CPU, the decode step's KV store and attention (`NATIVE_CPU_OPS`) as native
  kernels where they load (kernels/cpu_native.py; bound only for a CPU engine, `native_cpu`, so
  that a GPU engine never builds them), else the torch implementation;
- "torch": always torch;
- "triton": the Triton kernel on any device (on CPU that needs `TRITON_INTERPRET=1` set before
  the first kernel runs: the tests' Triton variants).

The engine picks the backend (EngineArgs.kernel_backend, `--kernel-backend`) and passes its
Kernels to the model in every step's metadata (`AttentionMetadata.kernels`), so two engines in
one process may run different backends. The torch implementations of the ops a decode step calls
(kernels/library.py) take no host synchronisation (no data-dependent branch or shape: padding rows
are written as harmless duplicates, `paged.masked_index_copy_`), so a compiled decode step captures
as a CUDA graph on every backend (tests/test_kernel_fallbacks.py).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType

import torch

from depthserve.errors import ConfigurationError
from depthserve.kernels.ops import KernelOp, Target, triton_installed, triton_kernel

FAMILIES: dict[str, tuple[str, ...]] = {
    "paged": ("store_kv", "paged_decode_attention", "paged_window_decode_attention", "paged_prefill_attention",
              "paged_prefill_attention_varlen", "paged_window_prefill_attention"),
    "itt": ("itt_route", "itt_update"),
    "depth": ("depth_attention",),
    "saobp": ("saobp_decode_attention", "saobp_bias_update", "saobp_prefill_attention"),
}
OP_NAMES = tuple(name for names in FAMILIES.values() for name in names)
# paged_prefill_attention: the varlen kernel covers single prompts; paged_window_decode_attention: the
# Triton kernel takes no window (paged_window_prefill_attention's CUDA form is flash for fresh chunks,
# kernels/flash.py, else torch); saobp_prefill_attention: torch only
TRITON_OPS = frozenset(OP_NAMES) - {"paged_prefill_attention", "paged_window_decode_attention", "saobp_prefill_attention"}
BACKENDS = ("auto", "torch", "triton")
# kernels/csrc/paged_attention.cpp; greedy_pick and apply_token_bitmask (csrc/sampling.cpp) have no torch
# twin here: the sampler's and depthserve/structured/bitmask.py's own torch code is their fallback
NATIVE_CPU_OPS = frozenset({"store_kv", "paged_decode_attention", "paged_window_decode_attention",
                            "paged_prefill_attention_varlen", "greedy_pick", "apply_token_bitmask"})


def native_cpu_op(name: str) -> Callable | None:
    """The native CPU kernel of an op, where it has one and the kernels load here."""
    from depthserve.kernels import cpu_native

    return getattr(cpu_native, name) if name in NATIVE_CPU_OPS and cpu_native.available() else None


@functools.cache
def module(family: str, triton: bool) -> ModuleType | None:
    """The torch (or, with triton=True, the Triton) implementations of a family; None where triton
    cannot be imported."""
    name = f"depthserve.kernels.{'triton.' if triton else ''}{family}"
    try:
        return importlib.import_module(name)
    except ImportError:
        if not triton:
            raise
        return None


def kernel_op(family: str, name: str) -> KernelOp:
    """An op of FAMILIES with its forms: torch, the native CPU kernel (NATIVE_CPU_OPS; it checks its
    own tensors' dtypes and shapes, falling back to torch) and the Triton kernel (TRITON_OPS, where
    triton is installed; imported at its first call, so an engine on the CPU never imports Triton)."""
    from depthserve.kernels import cpu_native

    triton = name in TRITON_OPS and triton_installed()
    return KernelOp(name, torch=getattr(module(family, False), name),
                    cpu=getattr(cpu_native, name) if name in NATIVE_CPU_OPS else None, cpu_dtypes=None,
                    cuda=triton_kernel(family, name) if triton else None)


def triton_available() -> bool:
    return module("paged", True) is not None


class Kernels:
    """Every op of OP_NAMES as an attribute, bound by `backend` (see the module docstring);
    `traceable`: the ops of a decode step as torch.library custom ops (kernels/library.py), for
    forwards compiled with torch.compile; `native_cpu`: bind the native CPU kernels where they load
    (an engine on the CPU; building them costs a minute on 2 cores, which a GPU engine need not pay)."""

    def __init__(self, backend: str = "auto", traceable: bool = False, native_cpu: bool = True):
        if backend not in BACKENDS:
            raise ConfigurationError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "triton" and not triton_available():
            raise ConfigurationError("kernel_backend='triton' needs triton, which cannot be imported "
                                     "(pip install 'depthserve[gpu]')")
        self.backend = backend
        self.traceable = traceable
        self.native_cpu = native_cpu = native_cpu and backend == "auto"
        # Greedy sampling's argmax and log-normalizer as one native call on the CPU (Sampler), else None.
        self.greedy_pick = native_cpu_op("greedy_pick") if native_cpu else None
        # A structured-output bitmask applied to fp32 logits in one native call on the CPU, else None.
        self.apply_token_bitmask = native_cpu_op("apply_token_bitmask") if native_cpu else None
        for family, names in FAMILIES.items():
            for name in names:
                setattr(self, name, self._bind(family, name))
        if traceable:  # the decode ops as custom ops: one opaque node each in a compiled graph
            from depthserve.kernels.library import SCHEMAS, custom_op

            for name in SCHEMAS:
                setattr(self, name, custom_op(backend, name))

    def _bind(self, family: str, name: str) -> Callable:
        """The op's form by kernels/ops.py's rule; under "auto" with a Triton kernel, the CPU's and
        CUDA's forms each for its device (a Kernels object is made before any tensor is seen)."""
        op = kernel_op(family, name)
        on_cpu = op.for_target(Target("cpu", backend=self.backend, native_cpu=self.native_cpu))
        on_cuda = op.for_target(Target("cuda", backend=self.backend, native_cpu=self.native_cpu))
        if op.cuda is None or on_cuda is on_cpu:  # no Triton kernel here: the engine's tensors are on one device
            return on_cpu

        @functools.wraps(on_cpu)
        def by_device(*args, **kwargs):
            first = args[0] if args else None
            on_gpu = isinstance(first, torch.Tensor) and first.is_cuda
            return (on_cuda if on_gpu else on_cpu)(*args, **kwargs)

        return by_device
