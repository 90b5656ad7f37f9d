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
import math
import mmap
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+ (Python 3.13 names it)
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


class _Arena:
    """An anonymous mapping of at least `nbytes` past its first 2 MiB boundary, advised MADV_HUGEPAGE;
    tensors are cut from it at offsets from that boundary. Each is its own storage at offset 0, as
    torch's allocations are: with the KV pool a view at a storage offset into the mapping, PUT's
    compiled decode step generated other tokens than its eager step (tests/test_static_decode.py).
    The mapping lives as long as any of the tensors does."""

    def __init__(self, nbytes: int) -> None:
        self.mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mapping.madvise(mmap.MADV_HUGEPAGE)
        self.start = -torch.frombuffer(self.mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE

    def commit(self) -> bool:
        """Fault in every page of the mapping now, writable, in the kernel (one pass over fresh zeroed
        pages instead of a fault per page from user space); False where the kernel cannot."""
        try:
            self.mapping.madvise(MADV_POPULATE_WRITE)
        except OSError:  # EINVAL before Linux 5.14
            return False
        return True

    def tensor(self, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        count = math.prod(shape)
        if count == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        return torch.frombuffer(self.mapping, dtype=dtype, count=count, offset=self.start + offset).view(tuple(shape))


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, on huge pages where available. Every page is committed
    now, as torch.zeros does by writing it, not in the first steps: a fresh anonymous mapping reads as
    zeros, so the kernel's populate is enough where it has one: one pass in the kernel instead of a
    fault per page and a second pass writing zeros (docs/benchmarks.md, "Start-up")."""
    if not available():
        return torch.zeros(shape, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    arena = _Arena(nbytes)
    tensor = arena.tensor(0, shape, dtype)
    return tensor if arena.commit() else tensor.zero_()


def copy_to_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU tensors laid out one after another in one huge-page arena (the
    tensors themselves where huge pages are not available)."""
    if not available() or not tensors:
        return list(tensors)
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    arena = _Arena(total)
    copies = []
    for tensor, offset in zip(tensors, offsets, strict=True):
        copy = arena.tensor(offset, tensor.shape, tensor.dtype)
        copy.copy_(tensor)
        copies.append(copy)
    return copies
