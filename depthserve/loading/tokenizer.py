"""Tokenizer and chat template from the checkpoint itself (HF files or GGUF metadata)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from depthserve.loading.registry import ModelSource


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "depthserve" / "tokenizers"


def _gguf_cache_dir(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return _cache_root() / key


def load_tokenizer(source: ModelSource):
    """Returns a transformers tokenizer. GGUF vocabularies are converted once, then cached on disk."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if source.format == "hf":
        return AutoTokenizer.from_pretrained(str(source.path))
    cache = _gguf_cache_dir(source.path)
    if (cache / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cache))
    tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(cache))
    except OSError:
        pass  # a read-only cache only costs the conversion time next start
    return tokenizer
