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
(`supported`), once a probe on two short chunks has matched SDPA there (`probe`); the engine's fp32
runs, older GPUs and older torches take the Triton kernel. Docs: docs/design.md, "Kernels".
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from collections.abc import Callable

import torch

from depthserve.kernels.paged import longest_chunk

log = logging.getLogger(__name__)

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


def torch_has_flash() -> bool:
    """Whether the installed torch has a varlen_attn of the form called here."""
    return (importlib.util.find_spec("torch.nn.attention.varlen") is not None
            and NEEDED_KEYWORDS <= keywords(varlen_attn()))


@functools.cache
def _device_runs_flash(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0) and torch_has_flash()


def supported(q: torch.Tensor) -> bool:
    """Whether the device, dtype and head size of these queries [tokens, heads, head_dim], and the
    installed torch's form of varlen_attn, are ones flash takes."""
    head_dim = q.shape[-1]
    return (q.is_cuda and q.dtype in DTYPES and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM
            and _device_runs_flash(q.device.index if q.device.index is not None else torch.cuda.current_device()))


def runs(q: torch.Tensor, kv_heads: int) -> bool:
    """Whether prefill attention of these queries over `kv_heads` KV heads goes to flash: where it is
    supported and its probe on this device, dtype and head layout gave the reference's results."""
    return supported(q) and probe(str(q.device), q.dtype, q.shape[-1], q.shape[1], kv_heads)


@functools.cache
def probe(device: str, dtype: torch.dtype, head_dim: int, q_heads: int, kv_heads: int) -> bool:
    """Flash on two short chunks, causal and with a window of 2, against SDPA in fp32, once per
    device, dtype and head layout: a torch whose kernel raises or disagrees there (a form this module
    was not written against) leaves prefill attention to the Triton kernel, with a warning saying why,
    instead of failing or corrupting every prefill."""
    gen = torch.Generator().manual_seed(0)
    lengths = (3, 6)
    q = torch.randn(sum(lengths), q_heads, head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(sum(lengths), kv_heads, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    starts = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=device)
    for window in (None, 2):
        try:
            got = fresh_prefill_attention(q, k, v, starts, max(lengths), head_dim ** -0.5, window)
        except Exception as exc:  # noqa: BLE001 (any failure means: not this kernel here)
            log.warning("flash varlen attention failed its probe on %s (%s: %s): prefill attention runs the Triton "
                        "kernel", device, type(exc).__name__, exc)
            return False
        expected = _reference(q.float(), k.float(), v.float(), lengths, head_dim ** -0.5, window)
        error = float((got.float() - expected).norm() / expected.norm())
        if not error < 1e-2:
            log.warning("flash varlen attention disagrees with SDPA on %s (relative error %.3g with window %s): "
                        "prefill attention runs the Triton kernel", device, error, window)
            return False
    return True


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...], scale: float,
               window: int | None) -> torch.Tensor:
    """Causal attention of each chunk over its own keys (the last `window` of them), by SDPA."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lengths:
        rows = slice(start, start + n)
        position = torch.arange(n, device=q.device)
        mask = position[None, :] <= position[:, None]
        if window is not None:
            mask &= position[None, :] > position[:, None] - window
        keys, values = (t[rows].repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        out.append(torch.nn.functional.scaled_dot_product_attention(q[rows].transpose(0, 1), keys, values,
                                                                    attn_mask=mask, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(out)


def attend_fresh(q: torch.Tensor, fresh_kv: tuple[torch.Tensor, torch.Tensor] | None, query_starts: torch.Tensor,
                 max_queries: int | None, scale: float, window: int | None = None) -> torch.Tensor | None:
    """The prefill ops' CUDA forms' first choice: fresh_prefill_attention over the chunks' own keys
    and values `fresh_kv` (given only when every chunk starts its sequence) where flash runs; None
    where it does not (no fresh keys, no queries, or flash not taken here), for the caller's kernel."""
    if fresh_kv is None or q.shape[0] == 0 or not runs(q, fresh_kv[0].shape[1]):
        return None
    if max_queries is None:
        max_queries = longest_chunk(query_starts)
    return fresh_prefill_attention(q, *fresh_kv, query_starts, max_queries, scale, window)


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
