"""torch's flash varlen attention (`torch.nn.attention.varlen.varlen_attn`, FlashAttention kernels
shipped inside torch) for prompt chunks that start their sequences.

A prefill step whose every chunk starts its sequence (no cached key: no earlier chunk, no
prefix-cache hit) attends only over its own keys, which the layer has in hand, packed like its
queries: the field's tuned varlen kernel runs on them as they are, with no read of the page pool.
Chunks over cached keys take the Triton kernel, which reads the pool through the page tables
(flash's own paged mode wants pages of whole tokens, all KV heads together, and at least 256 of
them per page in its FlashAttention-2 form; a page here holds one head of 16 tokens).

Flash runs on CUDA devices of compute capability 8.0 or later, in fp16 and bf16, for head dims
that are multiples of 8 up to 256, with a torch whose `varlen_attn` takes a scale and a window
(`runs`); the engine's fp32 runs, older GPUs and older torches take the Triton kernel. Docs:
docs/design.md, "Kernels".
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable

import torch

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# What the call below passes by name: torch 2.9's first form took `is_causal` and neither of these,
# and is left to the Triton kernel; `enable_gqa` came later still and is used where present.
NEEDED_KEYWORDS = frozenset({"scale", "window_size"})


def varlen_attn() -> Callable:
    from torch.nn.attention.varlen import varlen_attn as attend

    return attend


@functools.cache
def keywords(attend: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(attend).parameters)


@functools.cache
def _device_runs_flash(index: int) -> bool:
    return (torch.cuda.get_device_capability(index) >= (8, 0)
            and importlib.util.find_spec("torch.nn.attention.varlen") is not None
            and NEEDED_KEYWORDS <= keywords(varlen_attn()))


def runs(q: torch.Tensor) -> bool:
    """Whether flash varlen attention takes these queries [tokens, heads, head_dim]."""
    head_dim = q.shape[-1]
    return (q.is_cuda and q.dtype in DTYPES and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM
            and _device_runs_flash(q.device.index if q.device.index is not None else torch.cuda.current_device()))


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    """The kernel reads rows through their strides (a view of a fused QKV output is fine) but each
    head's elements must be adjacent."""
    return x if x.stride(-1) == 1 else x.contiguous()


def fresh_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_starts: torch.Tensor,
                            max_queries: int, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention of packed chunks, each over its own keys: q [tokens, q_heads, d], k and v
    [tokens, kv_heads, d] packed alike, `query_starts` [chunks + 1] (the same boundaries for queries
    and keys), `max_queries` the longest chunk; `window`: the keys a query sees, its own included (a
    sliding-window layer; None: every earlier key). Returns [tokens, q_heads, d]."""
    attend = varlen_attn()
    group = q.shape[1] // k.shape[1]
    k, v = k.to(q.dtype), v.to(q.dtype)
    grouped = {}
    if group > 1 and "enable_gqa" in keywords(attend):
        grouped["enable_gqa"] = True
    elif group > 1:  # a torch whose form takes as many KV heads as query heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    starts = query_starts.to(torch.int32)
    return attend(_last_dim_dense(q), _last_dim_dense(k), _last_dim_dense(v), starts, starts, max_queries,
                  max_queries, scale=scale, window_size=(-1 if window is None else window - 1, 0), **grouped)
