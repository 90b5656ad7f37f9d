"""Triton kernel of Dreamer's per-token depth attention (torch version: `kernels/depth.py`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from depthserve.kernels.triton.common import pow2

# ---- per-token depth attention (Dreamer DA) ----------------------------------------------------


@triton.jit
def _depth_attention_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, out_ptr, scale,
                            NUM_HEADS: tl.constexpr, MAX_DEPTH: tl.constexpr, BLOCK_T: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    valid = tl.load(valid_ptr + token)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    t_mask = t < valid
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (token * NUM_HEADS + head) * HEAD_DIM + d, mask=d_mask, other=0.0).to(tl.float32)
    kv_offs = ((token * MAX_DEPTH + t) * NUM_HEADS + head).to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
    s = tl.where(t_mask, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
    p = tl.exp(s - tl.max(s, axis=0))
    out = tl.sum(p[:, None] * v, axis=0) / tl.sum(p, axis=0)
    tl.store(out_ptr + (token * NUM_HEADS + head) * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def depth_attention(q, k_cache, v_cache, num_valid, scale):
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    max_depth = k_cache.shape[1]
    _depth_attention_kernel[(num_tokens, num_heads)](
        q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), num_valid, out, float(scale),
        NUM_HEADS=num_heads, MAX_DEPTH=max_depth, BLOCK_T=pow2(max_depth), HEAD_DIM=head_dim, BLOCK_D=pow2(head_dim),
    )
    return out
