"""torch's flash varlen attention stood in on the CPU, where it does not run: for the tests of the
code that lays out its inputs (the engine's prefill, bench/kernels.py)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F


def flash_varlen_on_cpu(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                        enable_gqa=False, seqused_k=None, block_table=None, **_):
    """torch's varlen_attn as its documentation states it, in plain torch (it runs only on CUDA): each
    batch element's queries attend to its keys (packed by cu_seq_k, or its pages through the block
    table, the first seqused_k of them), the causal mask aligned to the keys' end; window_size
    (left, 0): causal, a query seeing the `left` keys before its own too (-1: all of them)."""
    left, right = window_size
    assert right == 0, "the callers ask for causal attention"
    assert cu_seq_q.dtype == torch.int32 and (cu_seq_k is None or cu_seq_k.dtype == torch.int32)
    out = q.new_empty(q.shape)
    for i in range(len(cu_seq_q) - 1):
        rows = slice(int(cu_seq_q[i]), int(cu_seq_q[i + 1]))
        if block_table is None:
            keys, values = (t[int(cu_seq_k[i]): int(cu_seq_k[i + 1])] for t in (k, v))
        else:
            keys, values = (t[block_table[i].long()].flatten(0, 1)[: int(seqused_k[i])] for t in (k, v))
        n, m = rows.stop - rows.start, keys.shape[0]
        assert n <= max_q and m <= max_k
        key_pos, query_pos = torch.arange(m, device=q.device)[None, :], torch.arange(m - n, m, device=q.device)[:, None]
        mask = (key_pos <= query_pos) & ((key_pos >= query_pos - left) if left >= 0 else True)
        out[rows] = F.scaled_dot_product_attention(q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                                   attn_mask=mask, scale=scale, enable_gqa=enable_gqa).transpose(0, 1)
    return out


def stand_in_flash(monkeypatch: pytest.MonkeyPatch, takes_gqa: bool = True) -> list[tuple[int, int]]:
    """Flash varlen attention stood in by `flash_varlen_on_cpu`, and taken for every query tensor its
    probe passes (kernels/flash.py's `supported`; the probe runs on the stand-in); returns the list to which each call appends its chunk count and the
    left end of its window (-1: none).
    takes_gqa=False: the form of a torch whose varlen_attn has no `enable_gqa` (as many KV heads as
    query heads)."""
    import torch.nn.attention.varlen

    from depthserve.kernels import flash

    calls: list[tuple[int, int]] = []
    probing = [False]  # kernels/flash.py's probe calls are not the caller's: left out of `calls`
    if takes_gqa:
        def recorded(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False, seqused_k=None, block_table=None):
            calls.extend([] if probing[0] else [(len(cu_seq_q) - 1, window_size[0])])
            return flash_varlen_on_cpu(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
                                       enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table)
    else:
        def recorded(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            assert k.shape[1] == v.shape[1] == q.shape[1]
            calls.extend([] if probing[0] else [(len(cu_seq_q) - 1, window_size[0])])
            return flash_varlen_on_cpu(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", recorded)
    monkeypatch.setattr(flash, "supported", lambda q: True)
    unprobed = flash.probe.__wrapped__

    def probe(*args):
        probing[0] = True
        try:
            return unprobed(*args)
        finally:
            probing[0] = False

    monkeypatch.setattr(flash, "probe", functools.cache(probe))  # this stand-in's own probes
    return calls
