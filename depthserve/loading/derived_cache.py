"""Files derived once from a checkpoint file and reused by later starts: the tokenizer converted
from a GGUF's vocabulary, the index of a GGUF's config and tensors. Each lives under
`$XDG_CACHE_HOME/depthserve/<kind>/<key>` (`~/.cache` by default), the key a hash of the file's
resolved path, size and modification time, so a changed or replaced file gets a new entry."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "depthserve"


def derived_dir(source: Path, kind: str) -> Path:
    """The directory of what is derived from `source` (kind: "tokenizers", "gguf-index")."""
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / kind / key
