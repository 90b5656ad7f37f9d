"""Dory decoder layers' decode step as one native call on the CPU (kernels/csrc/decode_layer.cpp).

The eager layer (model.py) dispatches about twenty torch ops and three module calls per layer; at
one row of the 4B shapes that Python costs ~0.5 ms a layer pass against the ~3 ms its weights take
to read. Where the layers' projections all run on the native group GEMM (bf16 activations,
quantized weights) and the step is decode only, consecutive layers that attend through one step's
metadata run as one `dory_decode_layers` call: the same native ops in the same order, so the result
is bit-identical (tests/test_dory_native_decode.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from depthserve.kernels import cpu_native
from depthserve.layers.attention import AttentionMetadata, KVPool
from depthserve.layers.native_decode import NativeProjections, native_decode_applies, one_native_attention_shape

Rope = dict[str, tuple[torch.Tensor, torch.Tensor]]  # a layer type's rotary tables over the step's rows


@dataclass(frozen=True)
class NativeDoryLayers:
    projections: NativeProjections  # qkvg, o, gate_up, down of each layer
    scales: list[torch.Tensor]  # each layer's six learned scales, in decode_layer.cpp's DoryScale order
    layer_types: list[str]  # each layer's rotary table (DoryConfig.layer_types)
    windows: list[int]  # each layer's sliding window, 0 for full attention
    eps: float
    num_heads: int
    kv_heads: int
    scale: float

    @classmethod
    def of(cls, layers: Sequence, eps: float) -> NativeDoryLayers | None:
        """The native step of Dory decoder layers whose projections all run on the native kernel;
        None where one does not or the attention's shape does not fit the native kernel."""
        attns, mlps = [layer.self_attn for layer in layers], [layer.mlp for layer in layers]
        projections = NativeProjections.of([p for a, m in zip(attns, mlps)
                                            for p in (a.qkvg_proj, a.o_proj, m.gate_up_proj, m.down_proj)])
        if projections is None:
            return None
        if not one_native_attention_shape(attns):
            return None
        scales = [s for layer in layers for s in (layer.self_attn.q_scale, layer.self_attn.gate_scale,
                                                  layer.mlp.gate_scale, layer.mlp.up_scale, layer.attention_rate,
                                                  layer.mlp_rate)]
        return cls(projections=projections, scales=[s.contiguous() for s in scales],
                   layer_types=[layer.layer_type for layer in layers],
                   windows=[a.window or 0 for a in attns], eps=eps, num_heads=attns[0].num_heads,
                   kv_heads=attns[0].num_kv_heads, scale=attns[0].scale)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        return native_decode_applies(x, meta, self.projections.max_rows)

    def __call__(self, x: torch.Tensor, rope: Rope, pool: KVPool, meta: AttentionMetadata,
                 first_columns: list[int]) -> torch.Tensor:
        """The layers in turn over `meta`'s tables, layer i on the cache columns from first_columns[i]."""
        tables = {kind: (cos.contiguous(), sin.contiguous()) for kind, (cos, sin) in rope.items()}
        return cpu_native.dory_decode_layers(
            x.contiguous(), self.scales, self.eps, self.projections.weights, self.projections.bits,
            self.projections.out_features, [tables[kind][0] for kind in self.layer_types],
            [tables[kind][1] for kind in self.layer_types], self.windows, self.num_heads, self.kv_heads,
            pool.k_pages, pool.v_pages, meta.slot_index, meta.decode_page_table, meta.decode_context_lens,
            self.scale, first_columns)
