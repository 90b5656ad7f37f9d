"""Token bitmasks: which tokens a constrained row may sample next, and masking logits with them.

Layout (llguidance's and xgrammar's): one row per constrained sequence, `ceil(vocab / 32)` int32
words per row; token `t` is allowed when bit `t % 32` of word `t // 32` is set. The masks are filled
on the CPU (by the grammar engine, off the GIL) and applied to logits of any device and width: the
model's vocabulary may be padded past the tokenizer's, and those extra columns are never allowed.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import torch

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_token_bitmask(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """A CPU bitmask of `rows` rows with every token allowed. Pinned memory lets a CUDA engine copy
    it to the device without a synchronous staging copy."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def _bit_values(device: torch.device) -> torch.Tensor:
    # 1 << 31 wraps to int32's sign bit, which is exactly bit 31 of the word.
    return (torch.ones(BITS_PER_WORD, dtype=torch.int64) << torch.arange(BITS_PER_WORD)).to(torch.int32).to(device)


def unpack_token_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """Bool [rows, width]: True where the token is allowed; columns past the bitmask are False."""
    allowed = (bitmask.unsqueeze(-1) & _bit_values(bitmask.device)).reshape(bitmask.shape[0], -1) != 0
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    out = torch.zeros(bitmask.shape[0], width, dtype=torch.bool, device=bitmask.device)
    out[:, :allowed.shape[1]] = allowed
    return out


def apply_token_bitmask_(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: Sequence[int] | torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Sets `logits[rows[i], t] = -inf` wherever bitmask row `i` disallows token `t`, in place.

    `logits` is [B, V]; `bitmask` is [R, W] int32 (R = len(rows), or B when `rows` is None); rows of
    `logits` not listed are untouched. Columns at or past `vocab_size` (the tokenizer's vocabulary;
    default: all the bitmask covers) are masked in every listed row. Returns `logits`.
    """
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits [B, V] and bitmask [R, W] expected, got {tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"the bitmask must be int32, not {bitmask.dtype}")
    row_index = _row_index(rows, logits.shape[0], bitmask.shape[0], logits.device)
    if row_index is not None and row_index.numel() == 0:
        return logits
    width = logits.shape[1]
    limit = min(width, bitmask.shape[1] * BITS_PER_WORD, width if vocab_size is None else vocab_size)
    # Adding a 0 / -inf bias (exact for allowed tokens) is one pass over the rows; on the CPU it
    # measured several times faster than masked_fill_ with an unpacked bool mask.
    bias = _disallowed_bias(bitmask.to(logits.device, non_blocking=True), logits.dtype)[:, :limit]
    if row_index is None:
        logits[:, :limit].add_(bias)
        logits[:, limit:] = float("-inf")
    else:
        logits[:, :limit].index_add_(0, row_index, bias)
        logits[:, limit:].index_fill_(0, row_index, float("-inf"))
    return logits


def _disallowed_bias(bitmask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[R, 32 W] of 0 (allowed) and -inf (disallowed), in `dtype`."""
    if sys.byteorder != "little":  # the byte table below reads each word's low byte first
        allowed = unpack_token_bitmask(bitmask, bitmask.shape[1] * BITS_PER_WORD)
        return torch.zeros(allowed.shape, dtype=dtype, device=bitmask.device).masked_fill_(~allowed, float("-inf"))
    table = _byte_bias_table(dtype, bitmask.device)
    return table.index_select(0, bitmask.contiguous().view(torch.uint8).reshape(-1).long()).reshape(bitmask.shape[0], -1)


@functools.lru_cache(maxsize=16)
def _byte_bias_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, the bias of its 8 tokens (bit k = token k of the byte)."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)


def _row_index(rows, batch: int, mask_rows: int, device: torch.device) -> torch.Tensor | None:
    if rows is None:
        if mask_rows != batch:
            raise ValueError(f"the bitmask has {mask_rows} rows for {batch} rows of logits; pass `rows`")
        return None
    index = torch.as_tensor(rows, dtype=torch.long).to(device)
    if index.dim() != 1 or index.numel() != mask_rows:
        raise ValueError(f"{index.numel()} row indices for a bitmask of {mask_rows} rows")
    return index
