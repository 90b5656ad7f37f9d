"""`depthserve calibrate`: an ITT checkpoint's table of 101 router-score quantiles per (layer, step),
computed on real text (depth-semantics.md section 2, causal routing)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from depthserve.archs.itt.tiny import calibrate_tokens

if TYPE_CHECKING:
    import torch


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


def calibrate(model_dir: str | Path, text_file: str | Path, max_len: int = 512,
              max_tokens: int | None = 65536) -> dict[int, torch.Tensor]:
    """`depthserve calibrate`: the table of 101 router-score quantiles per (ITT layer, step) on real text."""
    from transformers import AutoTokenizer

    model_dir, text_file = Path(model_dir), Path(text_file)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    sequences = text_sequences(tokenizer, text_file, max_len, max_tokens)
    return calibrate_tokens(model_dir, sequences, {"source": text_file.name})


def add_subcommands(sub) -> None:
    c = sub.add_parser("calibrate", help="write an ITT checkpoint's router-score calibration table")
    c.add_argument("--model", required=True, help="ITT checkpoint directory")
    c.add_argument("--text", required=True, help="calibration text (.txt, or .jsonl with a 'text' field)")
    c.add_argument("--max-len", type=int, default=512, help="documents are cut into sequences of at most this many tokens")
    c.add_argument("--max-tokens", type=int, default=65536)
    c.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(ns: argparse.Namespace) -> int:
    from depthserve.errors import DepthServeError

    try:
        tables = calibrate(ns.model, ns.text, ns.max_len, ns.max_tokens)
    except (DepthServeError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the calibration table of {len(tables)} ITT layers to {ns.model}")
    return 0
