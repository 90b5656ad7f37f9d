"""The single place where an op is bound to an implementation."""

from __future__ import annotations

from types import SimpleNamespace

from depthserve.kernels import torch_ops

# GPU kernels (Triton) register here as they land; until then every device runs the torch ops.
ops = SimpleNamespace(
    store_kv=torch_ops.store_kv,
    paged_decode_attention=torch_ops.paged_decode_attention,
    paged_prefill_attention=torch_ops.paged_prefill_attention,
)
