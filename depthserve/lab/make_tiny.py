"""`depthserve make-tiny`: a small random checkpoint of any registered architecture, in the native
format, for tests and benchmarks (each architecture writes its own: `lab/tiny/<name>.py`); and
the token streams and tokenizer those checkpoints use.

    make_tiny(arch, "out/tiny", seed=0, like=None, num_kv_heads=None, tokenizer=None, **options)

Options after the tokenizer are the architecture's own (`depthserve make-tiny --help`; its flags
are declared by the architecture's tiny module, `TinyCheckpoints.CLI_FLAGS`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path
from typing import Any

from depthserve.archs import Architecture, architectures, get_architecture
from depthserve.archs.registry import TinyFlag
from depthserve.lab.tiny.llama import LIKE, every_other_layer, num_layers_of, synthetic_streams
from depthserve.errors import ConfigurationError
from depthserve.loading.tokenizer import default_tokenizer as load_default_tokenizer
from depthserve.loading.tokenizer import tokenizer_from

__all__ = ["make_tiny", "load_default_tokenizer", "tokenizer_from", "synthetic_streams", "every_other_layer",
           "num_layers_of", "cli_options", "add_subcommands"]


def make_tiny(arch: str, out: str | Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None,
              tokenizer=None, **options: Any) -> Path:
    """Write a random-weight checkpoint of a registered architecture to `out`."""
    architecture = get_architecture(arch)
    tiny = architecture.tiny_checkpoints()
    if tiny is None:
        raise ConfigurationError(f"the architecture {arch!r} has no tiny checkpoint")
    accepted = tiny_options(architecture)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigurationError(f"{arch} takes no option {unknown}: an option applies to its own architecture "
                                 f"({arch}'s options: {accepted or 'none'})")
    tokenizer = load_default_tokenizer() if tokenizer is None else tokenizer
    return tiny.make_tiny(Path(out), seed, like, num_kv_heads, tokenizer, **options)


# ---- command line ------------------------------------------------------------------------------------
def add_subcommands(sub) -> None:
    known = architectures()
    p = sub.add_parser("make-tiny", help="write a small random checkpoint of any served architecture in the native format")
    p.add_argument("--arch", required=True, choices=[architecture.name for architecture in known])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--like", default=None, choices=sorted(LIKE), help="the real model's shapes, random weights")
    p.add_argument("--num-kv-heads", type=int, default=None, help="KV heads (default 2 of 4: GQA; 4 for MHA)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the tokenizer (and so the vocabulary) of this checkpoint or tokenizer directory "
                        "(default: the built-in SmolLM2's, or a byte-level one where its package is absent)")
    for architecture in known:
        for flag in tiny_flags(architecture):
            p.add_argument(flag.flag, dest=flag.dest, type=flag.parse, default=None, help=flag.help)
    layouts = "; ".join(f"{architecture.name} ({', '.join(options)})" for architecture in known
                        if (options := [o for o in tiny_options(architecture) if o not in flag_options(architecture)]))
    p.add_argument("--option", dest="arch_options", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help=f"layout option of {layouts}; VALUE is read as JSON, else as a string")
    p.set_defaults(func=_cmd_make_tiny)


def tiny_options(architecture: Architecture) -> list[str]:
    """The keyword options of an architecture's make_tiny."""
    tiny = architecture.tiny_checkpoints()
    if tiny is None:
        return []
    return [p.name for p in inspect.signature(tiny.make_tiny).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY]


def flag_options(architecture: Architecture) -> set[str]:
    return {flag.option for flag in tiny_flags(architecture)}


def tiny_flags(architecture: Architecture) -> tuple[TinyFlag, ...]:
    tiny = architecture.tiny_checkpoints()
    return () if tiny is None else tiny.CLI_FLAGS


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def cli_options(ns: argparse.Namespace) -> dict[str, Any]:
    """The architecture's own options from the command line (its make-tiny flags, --option)."""
    options = dict(ns.arch_options)
    for architecture in architectures():
        for flag in tiny_flags(architecture):
            value = getattr(ns, flag.dest, None)
            if value is None:
                continue
            if architecture.name != ns.arch:
                raise ConfigurationError(f"{flag.flag} applies to --arch {architecture.name} only, not {ns.arch}")
            options[flag.option] = value
        if architecture.name == ns.arch:
            for flag in tiny_flags(architecture):
                if flag.resolve is not None and flag.option in options:
                    options[flag.option] = flag.resolve(options[flag.option], ns.like)
    return options


def _cmd_make_tiny(ns: argparse.Namespace) -> int:
    try:
        tokenizer = tokenizer_from(ns.tokenizer) if ns.tokenizer else None
        path = make_tiny(ns.arch, ns.out, ns.seed, ns.like, ns.num_kv_heads, tokenizer, **cli_options(ns))
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a random {ns.arch} checkpoint to {path}")
    return 0
