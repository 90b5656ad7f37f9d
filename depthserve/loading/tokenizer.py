"""Tokenizer and chat template from the checkpoint itself (HF files or GGUF metadata)."""

from __future__ import annotations

import json
from pathlib import Path

from depthserve.loading.derived_cache import derived_dir
from depthserve.loading.registry import ModelSource


def load_tokenizer(source: ModelSource):
    """Returns a transformers tokenizer. GGUF vocabularies are converted once, then cached on disk."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if source.format == "hf":
        return AutoTokenizer.from_pretrained(str(source.path))
    cache = derived_dir(source.path, "tokenizers")
    if (cache / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cache))
    tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(cache))
    except OSError:
        pass  # a read-only cache only costs the conversion time next start
    return tokenizer


def default_tokenizer():
    """The default model's (SmolLM2's) tokenizer, or a byte-level one built with `tokenizers` where
    that model's package is absent: the vocabulary of a random test checkpoint."""
    from depthserve.loading.registry import DEFAULT_MODEL, resolve_model

    try:
        return load_tokenizer(resolve_model(DEFAULT_MODEL))
    except Exception:  # noqa: BLE001 - the default model's package is optional here
        return byte_tokenizer()


def tokenizer_from(path: str | Path):
    """The tokenizer saved in a directory (a checkpoint's, or one written by save_pretrained), read
    as the engine reads a checkpoint's."""
    from depthserve.errors import ConfigurationError

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ConfigurationError(f"no tokenizer in {path} (tokenizer.json or tokenizer_config.json)")
    return load_tokenizer(ModelSource(path.name, "hf", path))


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (256 byte tokens and an end-of-text token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, **{ch: i + 1 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def text_sequences(tokenizer, text_file: Path, max_len: int, max_tokens: int | None,
                   max_documents: int | None = None) -> list[list[int]]:
    """Tokenize a text file (.jsonl: each line's "text" is a document, the first `max_documents`
    of them; else the whole file is one): each document is a sequence from position 0, as a prompt
    would be, cut every `max_len` tokens."""
    if text_file.suffix == ".jsonl":
        docs = [json.loads(line).get("text", "") for line in text_file.read_text().splitlines() if line.strip()]
        docs = docs[:max_documents]
    else:
        docs = [text_file.read_text()]
    sequences: list[list[int]] = []
    total = 0
    for doc in docs:
        ids = tokenizer.encode(doc, add_special_tokens=False)
        for start in range(0, len(ids), max_len):
            chunk = ids[start : start + max_len]
            if max_tokens is not None:
                chunk = chunk[: max_tokens - total]
            if len(chunk) >= 2:
                sequences.append(chunk)
                total += len(chunk)
        if max_tokens is not None and total >= max_tokens:
            break
    if not sequences:
        raise ValueError(f"{text_file} has no text to calibrate on")
    return sequences
