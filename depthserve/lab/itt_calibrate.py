"""`depthserve calibrate`: an ITT checkpoint's table of 101 router-score quantiles per (layer, step),
computed on real text (docs/depth-semantics.md section 2, causal routing)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from depthserve.lab.tiny.itt import calibrate_tokens
from depthserve.loading.tokenizer import text_sequences

if TYPE_CHECKING:
    import torch


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
