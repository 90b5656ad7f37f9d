"""The C heap the grammar engine allocates from (glibc's malloc: llguidance is Rust on the system
allocator), read and trimmed through ctypes.

A failed or evicted grammar frees its lexer's memory to malloc, but glibc keeps freed pages in its
arenas (one per compile thread) instead of returning them to the system, so the server's resident
memory would stay at its peak (docs/server.md, "Structured outputs and tools"). Elsewhere (musl,
macOS) both functions report nothing and do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallinfo2") or not hasattr(libc, "malloc_trim"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


_LIBC = _glibc()
_TRIM_LOCK = threading.Lock()


def heap_bytes_in_use() -> int | None:
    """Bytes malloc has handed out and not had back, over every arena (None where unknown)."""
    if _LIBC is None:
        return None
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def release_free_heap() -> None:
    """Returns malloc's free pages to the system (a few ms on a heap of some hundred MB)."""
    if _LIBC is None:
        return
    if _TRIM_LOCK.acquire(blocking=False):  # one trim at a time is enough: it covers every arena
        try:
            _LIBC.malloc_trim(0)
        finally:
            _TRIM_LOCK.release()
