"""What a decoder layer's native decode step (kernels/csrc/decode_layer.cpp) needs, whatever the
architecture: projections on the native group GEMM as they are (no bias, no padding, bf16
activations), flattened into the lists the native call takes, and a step it may run (decode rows
only, on the engine's default kernels, outside a compiled graph)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from depthserve.kernels import cpu_native
from depthserve.layers.attention import AttentionMetadata
from depthserve.layers.quantized import QuantLinear


def bare_native_projection(projection: nn.Module) -> bool:
    """A projection the native step can run as one group GEMM: a quantized layer on the native CPU
    kernel with bf16 activations, no bias, no refined activations, no padded outputs."""
    return (isinstance(projection, QuantLinear) and projection.native is not None and projection.bias is None
            and not projection.refine_activations and projection.padded_out == projection.out_features
            and projection.activation_dtype == torch.bfloat16)


@dataclass(frozen=True)
class NativeProjections:
    """Layers' projections as the native call takes them: per projection, in order, its (codes,
    scale, low), its bits and its output width."""

    weights: list[torch.Tensor]
    bits: list[int]
    out_features: list[int]
    max_rows: int  # the most rows every projection runs on the group GEMM (QuantPolicy.native_max_rows)

    @classmethod
    def of(cls, projections: Sequence[nn.Module]) -> NativeProjections | None:
        """None where one of them is not a bare native projection."""
        if not projections or not all(bare_native_projection(p) for p in projections):
            return None
        return cls(weights=[t for p in projections for t in (p.native.codes, p.native.scale, p.native.low)],
                   bits=[p.native.bits for p in projections], out_features=[p.out_features for p in projections],
                   max_rows=min(p.max_kernel_rows for p in projections))


def one_native_attention_shape(attentions: Sequence[nn.Module]) -> bool:
    """The layers' attentions share one (head_dim, heads, KV heads, scale), as the native call takes
    them once, and the native decode attention kernel takes that shape."""
    shapes = {(a.head_dim, a.num_heads, a.num_kv_heads, a.scale) for a in attentions}
    return len(shapes) == 1 and cpu_native.attention_fits(*next(iter(shapes))[:3])


def native_decode_applies(x: torch.Tensor, meta: AttentionMetadata, max_rows: int) -> bool:
    """A decode-only step of at most `max_rows` bf16 rows on the engine's default kernels, outside a
    compiled graph."""
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= max_rows and not meta.prefills
            and meta.num_decodes == x.shape[0] and meta.kernels.backend == "auto" and not meta.kernels.traceable
            and not torch.compiler.is_compiling())
