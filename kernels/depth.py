"""Dreamer's per-token depth attention (docs/depth-semantics.md section 3): a token attends over its own
states at the depths it has run. The torch implementation; the Triton kernel is in `triton/depth.py`."""

from __future__ import annotations

import torch


def depth_attention(
    q: torch.Tensor,  # [tokens, heads, d]
    k_cache: torch.Tensor,  # [tokens, max_depth, heads, d] each token's own depth states
    v_cache: torch.Tensor,
    num_valid: torch.Tensor,  # [tokens] depth entries each token has written (>= 1)
    scale: float,
) -> torch.Tensor:
    """Each token attends over its own first num_valid depth states (Dreamer DA)."""
    scores = torch.einsum("thd,tjhd->thj", q.float(), k_cache.float()) * scale
    beyond = torch.arange(k_cache.shape[1], device=q.device)[None, :] >= num_valid[:, None]
    scores.masked_fill_(beyond[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("thj,tjhd->thd", probs, v_cache.float()).to(q.dtype)
