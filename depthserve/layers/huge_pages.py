"""CPU tensors on transparent huge pages (2 MiB), where Linux offers them.

A CPU decode step streams every weight of the model (SmolLM2-135M's 4-bit codes: ~94 MB) and every
running sequence's KV pages through the caches. On 4 KiB pages each 4 KiB of that costs an address
translation the TLB does not hold, and the KV pages, scattered over the pool, give the hardware
prefetcher no stride to follow across them. Held on 2 MiB pages the same reads took 6% less time
for the quantized weight matmuls of a one-row step and 9% less for paged attention at 32 sequences,
and the 32-sequence decode step 6% less (docs/quantization.md, "Huge pages").

Linux gives anonymous memory huge pages when `/sys/kernel/mm/transparent_hugepage/enabled` is
`always`, or `madvise` (the common default) and the region asks with MADV_HUGEPAGE, which is what
this module does. Elsewhere (THP `never`, other systems) the tensors are ordinary torch allocations.
"""

from __future__ import annotations

import functools
import mmap
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # each tensor in an arena starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def available() -> bool:
    """Whether anonymous memory can be asked for on transparent huge pages here."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _arena(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of `nbytes` starting on a 2 MiB boundary of a mapping advised
    MADV_HUGEPAGE (the mapping lives as long as any view of the tensor does)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, on huge pages where available. Every page is written
    now, as torch.zeros does, so that the memory is committed at start-up, not in the first steps."""
    if not available():
        return torch.zeros(shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for size in shape:
        numel *= size
    tensor = _arena(numel * itemsize).view(dtype).view(tuple(shape))
    return tensor.zero_()


def copy_to_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU tensors laid out one after another in one huge-page arena (the
    tensors themselves where huge pages are not available)."""
    if not available() or not tensors:
        return list(tensors)
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    arena = _arena(total)
    copies = []
    for tensor, offset in zip(tensors, offsets, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        copy = arena[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies.append(copy)
    return copies
