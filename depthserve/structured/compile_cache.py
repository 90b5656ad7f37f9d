"""The backend's cache of compiled constraints: bounded by bytes, not entries, and with a small
record of the constraints that failed, so a repeat gets the same 400 at once without compiling.

A compiled grammar's size is what the compile took from the C heap (native_heap.py), at least its
text's length; a grammar larger than the whole budget is handed out but not kept. A failure keeps
only its error (type and reason, at most `MAX_REASON_CHARS` characters), never the grammar.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

from depthserve.structured.backend import GrammarLimits
from depthserve.structured.errors import StructuredOutputError

Compiled = TypeVar("Compiled")


@dataclass(frozen=True)
class CacheKey:
    """A grammar text's digest and the limits it was compiled under (a grammar that passed looser
    limits may fail tighter ones); the digest keeps a megabyte of grammar text out of the key."""

    digest: bytes
    limits: GrammarLimits

    @classmethod
    def of(cls, grammar: str, limits: GrammarLimits) -> CacheKey:
        return cls(hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).digest(), limits)


@dataclass(frozen=True)
class _Kept(Generic[Compiled]):
    compiled: Compiled
    nbytes: int


class CompileCache(Generic[Compiled]):
    """Least recently used compiled grammars within `max_bytes`, and the last `max_failures` errors."""

    def __init__(self, max_bytes: int, max_failures: int):
        if max_bytes < 0 or max_failures < 0:
            raise ValueError("cache bounds must be >= 0")
        self.max_bytes = max_bytes
        self.max_failures = max_failures
        self._kept: OrderedDict[CacheKey, _Kept[Compiled]] = OrderedDict()
        self._failures: OrderedDict[CacheKey, StructuredOutputError] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """The estimated bytes of the grammars kept."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._kept)

    def compiled(self, key: CacheKey) -> Compiled | None:
        with self._lock:
            kept = self._kept.get(key)
            if kept is None:
                return None
            self._kept.move_to_end(key)
            return kept.compiled

    def failure(self, key: CacheKey) -> StructuredOutputError | None:
        """A fresh copy of the error `key` failed with, if it is remembered."""
        with self._lock:
            error = self._failures.get(key)
            if error is None:
                return None
            self._failures.move_to_end(key)
        return type(error)(error.reason)

    def keep(self, key: CacheKey, compiled: Compiled, nbytes: int) -> int:
        """Keeps `compiled` (unless it alone exceeds the budget); returns the bytes evicted for it."""
        if nbytes > self.max_bytes:
            return 0
        evicted = 0
        with self._lock:
            self._failures.pop(key, None)
            old = self._kept.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._kept[key] = _Kept(compiled, nbytes)
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                _, dropped = self._kept.popitem(last=False)
                self._bytes -= dropped.nbytes
                evicted += dropped.nbytes
        return evicted

    def remember_failure(self, key: CacheKey, error: StructuredOutputError) -> int:
        """Forgets any grammar kept for `key` and records its error; returns the bytes dropped."""
        with self._lock:
            old = self._kept.pop(key, None)
            dropped = 0 if old is None else old.nbytes
            self._bytes -= dropped
            if self.max_failures:
                self._failures[key] = type(error)(error.reason)
                self._failures.move_to_end(key)
                while len(self._failures) > self.max_failures:
                    self._failures.popitem(last=False)
        return dropped
