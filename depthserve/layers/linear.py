"""Fast linear layers for the CPU path: fp32 column blocks, and bf16 rows on the native kernel.

Two things make `x @ W.T` slow for decode-sized batches (a few to a few dozen rows) with MKL:
it repacks the [out, in] weight on every call, and it splits the work across threads by rows,
so with fewer rows than a tile every thread streams the whole weight. So on CPU each linear keeps
its weight as `splits` contiguous [in, out / splits] column blocks, one per torch thread, and
computes them as one batched GEMM: each thread streams only its own block, once. The one
exception is a very wide layer (the LM head): for 5 to 48 rows oneDNN with a weight prepacked once
at load beats that, so that layer keeps a prepacked copy as well.

Measured on a 2-core AMD EPYC (AVX-512; fp32, 2 threads, SmolLM2-135M shapes, the 30 layers' weights
streamed from memory as in a decode step): the layers' GEMMs at 1 / 8 / 32 rows take
27 / 43 / 98 ms as column blocks against 35 / 68 / 126 ms as one [in, out] matrix (x @ W_t),
and the same at 512 rows; the 576x49152 LM head at 32 rows 25 ms (oneDNN) vs 47 ms (blocks)
vs 63 ms (x @ W_t), at 1 row 5.5 ms (blocks) vs 7.8 ms (x @ W_t) vs 8.9 ms (oneDNN).

A bf16 weight keeps its own layout and runs on the native kernel (kernels/csrc/bf16_gemm.cpp),
which streams the weight once at the read bandwidth, for up to `native_bf16_max_rows()` rows, more
rows on F.linear. Where torch's bf16 GEMM runs on the CPU's bf16 instructions (AVX-512 BF16 or AMX)
that is decode-sized calls: torch's reads the weight at 15-20 GB/s (2-core AMD EPYC, 8 x [14336,
2560] weights: the kernel 1.3-1.5x F.linear's rate at 1 / 2 / 4 rows), and from 8 rows oneDNN's bf16
dot products outrun the kernel's fp32 FMAs. Where oneDNN emulates bf16 (AVX-512 without BF16: the
2-core Xeon without it, or the EPYC with ONEDNN_MAX_CPU_ISA=AVX512_CORE) the kernel is every call's:
2-3x F.linear's rate at 2 to 512 rows (bench/bf16_kernels.py).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import torch.utils.mkldnn
from torch import nn

from depthserve.kernels import cpu_native
from depthserve.kernels.ops import Form, KernelOp, Target

SMALL_BATCH_ROWS = 4
EVERY_ROW_COUNT = sys.maxsize
NATIVE_BF16_MAX_ROWS = 4  # with a native bf16 GEMM (module docstring)
NATIVE_BF16_WIDTH = 32  # the kernel's step: the input width must be a multiple of it
PACKED_MAX_ROWS = 48
PACKED_MIN_OUT_FEATURES = 8192  # only layers this wide keep a oneDNN-prepacked copy


class CpuLinear(nn.Module):
    def __init__(self, linear: nn.Linear, threads: int | None = None):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.splits = column_splits(self.out_features, threads or torch.get_num_threads())
        blocks = weight.t().reshape(self.in_features, self.splits, self.out_features // self.splits)
        self.register_buffer("weight_blocks", blocks.permute(1, 0, 2).contiguous(), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.packed = _prepacked(linear) if self.out_features >= PACKED_MIN_OUT_FEATURES else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.packed is not None and SMALL_BATCH_ROWS < rows.shape[0] <= PACKED_MAX_ROWS:
            out = self.packed(rows.contiguous())
        else:
            out = self._blocked_matmul(rows)
            if self.bias is not None:
                out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _blocked_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return BLOCKED_MATMUL(rows, self.weight_blocks)


def _blocked_matmul(rows: torch.Tensor, weight_blocks: torch.Tensor) -> torch.Tensor:
    """rows [n, in] times the weight kept as column blocks [splits, in, out / splits]: [n, out]."""
    splits = weight_blocks.shape[0]
    if splits == 1:
        return rows @ weight_blocks[0]
    parts = torch.bmm(rows.expand(splits, -1, -1), weight_blocks)  # [splits, n, out / splits]
    return parts.transpose(0, 1).reshape(rows.shape[0], splits * weight_blocks.shape[2])


@torch.library.custom_op("depthserve::blocked_matmul", mutates_args=())
def blocked_matmul(rows: torch.Tensor, weight_blocks: torch.Tensor) -> torch.Tensor:
    return _blocked_matmul(rows, weight_blocks)


@blocked_matmul.register_fake
def _(rows: torch.Tensor, weight_blocks: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weight_blocks.shape[0] * weight_blocks.shape[2])


# Compiled, the op stays one opaque node: inductor would otherwise turn a GEMM of one or a few rows
# into its own reduction loops, 1.5x slower than MKL's (SmolLM2 batch-1 decode step on 2 cores).
BLOCKED_MATMUL = KernelOp("blocked_matmul", torch=_blocked_matmul, compiled=blocked_matmul)


def column_splits(out_features: int, threads: int) -> int:
    """The most column blocks, at most one per thread, that divide the output features evenly."""
    return next(s for s in range(max(threads, 1), 0, -1) if out_features % s == 0)


def _prepacked(linear: nn.Linear) -> nn.Module:
    packed = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    with torch.no_grad():
        packed.weight.copy_(linear.weight)
        if linear.bias is not None:
            packed.bias.copy_(linear.bias)
    return torch.utils.mkldnn.to_mkldnn(packed)


# The linear layer's forms: nn.Linear's, or on a CPU with oneDNN, for fp32 weights, CpuLinear's
# column blocks (module docstring). The form needs its own weight layout, so the choice is made once
# per layer when the model is loaded (optimize_linears_for_cpu), not per call.
LINEAR = KernelOp("linear", torch=nn.Linear.forward, cpu=CpuLinear.forward, cpu_dtypes=(torch.float32,),
                  cpu_built=torch.backends.mkldnn.is_available)


def native_bf16_max_rows() -> int:
    """The most rows of a bf16 linear call the native kernel takes on this CPU (module docstring)."""
    return NATIVE_BF16_MAX_ROWS if cpu_native.cpu_has_native_bf16_gemm() else EVERY_ROW_COUNT


def _native_bf16_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        max_rows: int) -> torch.Tensor:
    """Up to `max_rows` rows on the native kernel, more on F.linear (module docstring)."""
    if rows.shape[0] > max_rows:
        return F.linear(rows, weight, bias)
    out = cpu_native.bf16_gemm(rows, weight)
    return out if bias is None else out + bias


def _bf16_linear_torch(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       max_rows: int) -> torch.Tensor:
    return F.linear(rows, weight, bias)


# A bf16 linear layer's forms: F.linear, or on a CPU with the native kernels built, the native kernel
# for up to `max_rows` rows (compiled: F.linear, which the compiler sees through).
BF16_LINEAR = KernelOp("bf16_linear", torch=_bf16_linear_torch, cpu=_native_bf16_linear, cpu_dtypes=(torch.bfloat16,))


class NativeBf16Linear(nn.Module):
    """A bf16 linear layer through BF16_LINEAR (module docstring). The weight and bias are the
    original layer's own tensors (a tied head stays tied)."""

    def __init__(self, linear: nn.Linear, max_native_rows: int | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.max_native_rows = native_bf16_max_rows() if max_native_rows is None else max_native_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = BF16_LINEAR(x.reshape(-1, self.in_features), self.weight, self.bias, self.max_native_rows)
        return out.view(*x.shape[:-1], self.out_features)


def native_bf16_applies(linear: nn.Linear) -> bool:
    return linear.in_features % NATIVE_BF16_WIDTH == 0 and linear.weight.is_contiguous()


def optimize_linears_for_cpu(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear of the model whose weight takes LINEAR's CPU form for a CpuLinear
    (weights shared at load, then re-laid out), and every one that takes BF16_LINEAR's for a
    NativeBf16Linear (the same tensors)."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            weight = child.weight if type(child) is nn.Linear else None
            if weight is None:
                continue
            target = Target(weight.device.type, weight.dtype)
            if LINEAR.form(target) is Form.CPU:
                setattr(module, child_name, CpuLinear(child))
            elif BF16_LINEAR.form(target) is Form.CPU and native_bf16_applies(child):
                setattr(module, child_name, NativeBf16Linear(child))
    return model
