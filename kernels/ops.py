"""One op, its forms, and the one rule that picks the form that runs.

A `KernelOp` is one computation with up to four forms of the same meaning:

- `torch`: portable torch code, the reference and the path every device can take;
- `cpu`: the CPU's own form, a native kernel (kernels/cpu_native.py, built from kernels/csrc) or a
  CPU-specific layout, for the dtypes in `cpu_dtypes` and only where `cpu_built()` says it runs here;
- `cuda`: the Triton kernel (kernels/triton);
- `compiled`: what a forward traced by torch.compile calls (default: the torch form, which the
  compiler fuses with its neighbours; an op that must stay one opaque node names its custom op).

`KernelOp.form(target)` is the rule, the only place that looks at a device, a dtype, the compile
mode, the kernel backend or what is built. `Target` is what it decides from. A layer calls the op
(`RMS_NORM(x, weight, eps)`): the op picks its form from its first tensor's device and dtype once,
memoises it (an engine's model runs one device and dtype), and from then on pays one dictionary
look-up per call; inside a torch.compile trace it calls the compiled form. `Kernels`
(kernels/dispatch.py) binds the attention ops with the same rule once per engine, from the
engine's backend. A layer whose weights are laid out for one form (the quantized and the CPU
linear layers) asks `op.form(target)` once when it is built. A new architecture's layer gets the
fast path by calling the op.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from depthserve.kernels import cpu_native


class Form(enum.Enum):
    TORCH = "torch"
    CPU = "cpu"
    CUDA = "cuda"
    COMPILED = "compiled"


@dataclass(frozen=True)
class Target:
    """What a form is chosen from. dtype None: the op's CPU form checks its tensors' dtypes itself
    (the attention kernels, bound before any tensor is seen). backend: the engine's kernel backend
    ("auto", "torch" or "triton", EngineArgs.kernel_backend); native_cpu: the engine may use the
    native CPU kernels (False for an engine on CUDA, which never builds them)."""

    device: str
    dtype: torch.dtype | None = None
    compiling: bool = False
    backend: str = "auto"
    native_cpu: bool = True


def always() -> bool:
    return True


@functools.cache
def triton_installed() -> bool:
    """Whether triton can be found, without importing it (~0.2 s)."""
    return importlib.util.find_spec("triton") is not None


def triton_kernel(family: str, name: str) -> Callable:
    """The Triton kernel `name` of kernels/triton/<family>.py as an op's CUDA form, its module
    imported at the first call (a CPU process never imports Triton for it)."""
    kernel: Callable | None = None

    def call(*args, **kwargs):
        nonlocal kernel
        if kernel is None:
            kernel = getattr(importlib.import_module(f"depthserve.kernels.triton.{family}"), name)
        return kernel(*args, **kwargs)

    call.__qualname__ = call.__name__ = f"triton.{family}.{name}"
    return call


@dataclass(eq=False)
class KernelOp:
    """One op and its forms (module docstring)."""

    name: str
    torch: Callable
    cpu: Callable | None = None
    cpu_dtypes: tuple[torch.dtype, ...] | None = cpu_native.FLOAT_DTYPES  # None: any (the form checks)
    cpu_built: Callable[[], bool] = cpu_native.available
    cuda: Callable | None = None
    compiled: Callable | None = None
    _eager: dict[tuple[str, torch.dtype], Callable] = field(default_factory=dict, repr=False)

    def form(self, target: Target) -> Form:
        """The rule. The CPU form's `cpu_built` (which may build the native kernels) is asked last,
        only where that form would otherwise run."""
        if target.compiling:
            return Form.COMPILED if self.compiled is not None else Form.TORCH
        if target.backend == "triton" or (target.backend == "auto" and target.device == "cuda"):
            return Form.CUDA if self.cuda is not None else Form.TORCH
        if (target.backend == "auto" and target.device == "cpu" and target.native_cpu and self.cpu is not None
                and (self.cpu_dtypes is None or target.dtype in self.cpu_dtypes) and self.cpu_built()):
            return Form.CPU
        return Form.TORCH

    def implementation(self, form: Form) -> Callable:
        chosen = {Form.TORCH: self.torch, Form.CPU: self.cpu, Form.CUDA: self.cuda, Form.COMPILED: self.compiled}[form]
        if chosen is None:
            raise ValueError(f"op {self.name} has no {form.value} form")
        return chosen

    def for_target(self, target: Target) -> Callable:
        return self.implementation(self.form(target))

    def __call__(self, first: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling():
            return (self.compiled or self.torch)(first, *args, **kwargs)
        key = (first.device.type, first.dtype)
        chosen = self._eager.get(key)
        if chosen is None:
            chosen = self._eager[key] = self.for_target(Target(*key))
        return chosen(first, *args, **kwargs)
