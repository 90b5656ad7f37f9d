"""A Llama decoder layer's decode step as one native call on the CPU (kernels/csrc/decode_layer.cpp).

The eager layer (model.py) dispatches about thirty torch ops and seven module calls per layer; in a
one-row decode step of SmolLM2-135M that Python costs more than the layer's arithmetic. Where the
layer's projections all run on the native group GEMM (bf16 activations, quantized weights,
kernels/cpu_native.py) and the step is decode only, the layer calls `llama_decode_layer` instead:
the same ops in the same order, so the result is bit-identical (tests/test_native_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from depthserve.kernels import cpu_native
from depthserve.layers.attention import AttentionMetadata, KVPool
from depthserve.layers.quantized import QuantLinear


@dataclass(frozen=True)
class NativeDecodeLayer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    weights: tuple[torch.Tensor, ...]  # (codes, scale, low) of qkv, o, gate_up, down
    bits: tuple[int, ...]
    out_features: tuple[int, ...]
    num_heads: int
    scale: float
    max_rows: int  # the most rows every projection runs on the group GEMM (QuantPolicy.native_max_rows)

    @classmethod
    def of(cls, layer) -> NativeDecodeLayer | None:
        """The native step of a plain Llama decoder layer (model.py checks that it is one: exactly
        LlamaDecoderLayer, LlamaAttention and LlamaMLP) whose projections all run on the native
        kernel; None where one does not."""
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(p, QuantLinear) and p.native is not None and p.bias is None and not p.refine_activations
                   and p.padded_out == p.out_features and p.activation_dtype == torch.bfloat16 for p in projections):
            return None
        if not cpu_native.attention_fits(attn.head_dim, attn.num_heads, attn.num_kv_heads):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if norms[0].eps != norms[1].eps:
            return None
        return cls(
            input_norm=norms[0].weight, post_norm=norms[1].weight, eps=norms[0].eps,
            weights=tuple(t for p in projections for t in (p.native.codes, p.native.scale, p.native.low)),
            bits=tuple(p.native.bits for p in projections), out_features=tuple(p.out_features for p in projections),
            num_heads=attn.num_heads, scale=attn.scale, max_rows=min(p.max_kernel_rows for p in projections))

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A decode-only step of bf16 rows on the engine's default kernels, outside a compiled graph."""
        return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= self.max_rows and not meta.prefills
                and meta.num_decodes == x.shape[0] and meta.kernels.backend == "auto" and not meta.kernels.traceable
                and not torch.compiler.is_compiling())

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool,
                 meta: AttentionMetadata, columns: slice) -> torch.Tensor:
        return cpu_native.llama_decode_layer(
            x.contiguous(), self.input_norm, self.post_norm, self.eps, self.weights, self.bits, self.out_features,
            cos.contiguous(), sin.contiguous(), self.num_heads, pool.k_pages, pool.v_pages,
            meta.slot_index[:, columns], meta.decode_page_table[:, :, columns].transpose(1, 2),
            meta.decode_context_lens, self.scale)
