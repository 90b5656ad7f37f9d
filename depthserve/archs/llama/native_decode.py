"""Llama decoder layers' decode step as one native call on the CPU (kernels/csrc/decode_layer.cpp).

The eager layer (model.py) dispatches about thirty torch ops and seven module calls per layer; in a
one-row decode step of SmolLM2-135M that Python costs more than the layer's arithmetic. Where the
layers' projections all run on the native group GEMM (bf16 activations, quantized weights,
kernels/cpu_native.py) and the step is decode only, a layer calls `llama_decode_layers` instead, and
the plain model runs all its layers in that one call (no module call or table slicing per layer):
the same ops in the same order, so the result is bit-identical (tests/test_native_decode.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from depthserve.kernels import cpu_native
from depthserve.layers.attention import AttentionMetadata, KVPool
from depthserve.layers.native_decode import NativeProjections, native_decode_applies, one_native_attention_shape


@dataclass(frozen=True)
class NativeDecodeLayers:
    norms: list[torch.Tensor]  # input and post-attention RMSNorm weights, two per layer
    eps: float
    projections: NativeProjections  # qkv, o, gate_up, down of each layer
    num_heads: int
    kv_heads: int
    scale: float

    @classmethod
    def of(cls, layers: Sequence) -> NativeDecodeLayers | None:
        """The native step of plain Llama decoder layers (model.py checks that each is one: exactly
        LlamaDecoderLayer, LlamaAttention and LlamaMLP) of one shape whose projections all run on the
        native kernel; None where one does not."""
        attns = [layer.self_attn for layer in layers]
        projections = NativeProjections.of([p for layer in layers for p in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)])
        if projections is None:
            return None
        if not one_native_attention_shape(attns):
            return None
        norms = [norm for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        if len({norm.eps for norm in norms}) != 1:
            return None
        return cls(norms=[norm.weight for norm in norms], eps=norms[0].eps, projections=projections,
                   num_heads=attns[0].num_heads, kv_heads=attns[0].num_kv_heads, scale=attns[0].scale)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A decode-only step of bf16 rows on the engine's default kernels, outside a compiled graph."""
        return native_decode_applies(x, meta, self.projections.max_rows)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: KVPool,
                 meta: AttentionMetadata, first_columns: list[int]) -> torch.Tensor:
        """The layers in turn, layer i on the cache columns from first_columns[i] (its kv_heads of them)."""
        return cpu_native.llama_decode_layers(
            x.contiguous(), self.norms, self.eps, self.projections.weights, self.projections.bits,
            self.projections.out_features, cos.contiguous(),
            sin.contiguous(), self.num_heads, self.kv_heads, pool.k_pages, pool.v_pages, meta.slot_index,
            meta.decode_page_table, meta.decode_context_lens, self.scale, first_columns)
