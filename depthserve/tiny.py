"""`depthserve make-tiny`: a small random checkpoint of any registered architecture, in the native
format, for tests and benchmarks (each architecture writes its own: `archs/<name>/tiny.py`); and
the token streams and tokenizer those checkpoints use.

    make_tiny("itt", "out/itt", seed=0, like=None, num_kv_heads=None, tokenizer=None, steps=3)

Options after the tokenizer are the architecture's own (`depthserve make-tiny --help`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from depthserve.errors import ConfigurationError

if TYPE_CHECKING:
    import torch


def make_tiny(arch: str, out: str | Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None,
              tokenizer=None, **options: Any) -> Path:
    """Write a random-weight checkpoint of a registered architecture to `out`."""
    from depthserve.archs import get_architecture

    architecture = get_architecture(arch)
    if architecture.make_tiny is None:
        raise ConfigurationError(f"the architecture {arch!r} has no tiny checkpoint")
    accepted = [p.name for p in inspect.signature(architecture.make_tiny).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigurationError(f"{arch} takes no option {unknown}: an option applies to its own architecture "
                                 f"({arch}'s options: {accepted or 'none'})")
    return architecture.make_tiny(Path(out), seed, like, num_kv_heads, tokenizer, **options)


def load_default_tokenizer():
    """The SmolLM2 tokenizer of the default model, or a byte-level one built with `tokenizers`."""
    try:
        from depthserve.loading.registry import DEFAULT_MODEL, resolve_model
        from depthserve.loading.tokenizer import load_tokenizer

        return load_tokenizer(resolve_model(DEFAULT_MODEL))
    except Exception:  # noqa: BLE001 - the default model's package is optional here
        return _byte_tokenizer()


def tokenizer_from(path: str | Path):
    """The tokenizer saved in a directory (a checkpoint's, or one written by save_pretrained), read
    as the engine reads a checkpoint's."""
    from depthserve.loading.registry import ModelSource
    from depthserve.loading.tokenizer import load_tokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ConfigurationError(f"no tokenizer in {path} (tokenizer.json or tokenizer_config.json)")
    return load_tokenizer(ModelSource(path.name, "hf", path))


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, **{ch: i + 1 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def synthetic_streams(vocab_size: int, windows: int, length: int, seed: int) -> torch.Tensor:
    """Token windows [windows, length] drawn from a Zipf-like distribution over a shuffled vocabulary."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
    probs = 1.0 / ranks**1.1
    order = torch.randperm(vocab_size, generator=gen)
    draws = torch.multinomial(probs / probs.sum(), windows * length, replacement=True, generator=gen)
    return order[draws].view(windows, length)


# ---- command line ------------------------------------------------------------------------------------
def add_subcommands(sub) -> None:
    from depthserve.archs import architecture_names
    from depthserve.archs.llama.tiny import LIKE

    p = sub.add_parser("make-tiny", help="write a small random checkpoint of any served architecture in the native format")
    p.add_argument("--arch", required=True, choices=architecture_names())
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--like", default=None, choices=sorted(LIKE), help="the real model's shapes, random weights")
    p.add_argument("--num-kv-heads", type=int, default=None, help="KV heads (default 2 of 4: GQA; 4 for MHA)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the tokenizer (and so the vocabulary) of this checkpoint or tokenizer directory "
                        "(default: the built-in SmolLM2's, or a byte-level one where its package is absent)")
    p.add_argument("--sgt-layers", type=_int_list, default=None, help="SGT looped layers, e.g. 10,15,20")
    p.add_argument("--sgt-heads", type=_head_sets, default=None,
                   help="SGT heads per looped layer: a count N (heads 0..N-1) or one set per layer, e.g. '0,1;0,4;1,8'")
    p.add_argument("--sgt-loops", type=int, default=None, help="trained loop count of every looped layer")
    p.add_argument("--itt-layers", type=_layer_selection, default=None,
                   help="ITT layers: a list (e.g. 1,3,5), 'odd' or 'even' (every other layer)")
    p.add_argument("--itt-steps", type=int, default=None, help="ITT extra steps T (default 2)")
    p.add_argument("--option", dest="arch_options", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="layout option of dreamer (depth, attn_experts, da_rope, num_experts, top_k), "
                        "put (n_prefix, n_core, n_suffix, steps, conv_kernel) or saobp (lam, variant, "
                        "self_message, layers, max_position_embeddings); VALUE is read as JSON, else as a string")
    p.set_defaults(func=_cmd_make_tiny)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def _head_sets(text: str) -> int | list[list[int]]:
    return int(text) if text.strip().isdigit() else [_int_list(part) for part in text.split(";")]


def _layer_selection(text: str) -> list[int] | str:
    return text if text in ("odd", "even") else _int_list(text)


def every_other_layer(num_layers: int, parity: str) -> list[int]:
    """Layers 1, 3, 5, ... ('odd') or 0, 2, 4, ... ('even') of a model with `num_layers` layers."""
    return list(range(1 if parity == "odd" else 0, num_layers, 2))


def num_layers_of(like: str | None) -> int:
    from depthserve.archs.llama.tiny import LIKE, TINY

    return (LIKE[like] if like else TINY)["num_hidden_layers"]


def cli_options(ns: argparse.Namespace) -> dict[str, Any]:
    """The architecture's own options from the command line (--sgt-*, --itt-*, --option)."""
    options = dict(ns.arch_options)
    flags = {"sgt": {"layers": ns.sgt_layers, "heads": ns.sgt_heads, "loops": ns.sgt_loops},
             "itt": {"layers": ns.itt_layers, "steps": ns.itt_steps}}
    for arch, values in flags.items():
        given = {k: v for k, v in values.items() if v is not None}
        if given and arch != ns.arch:
            raise ConfigurationError(f"--{arch}-* options apply to --arch {arch} only, not {ns.arch}")
        if arch == ns.arch:
            options.update(given)
    if isinstance(options.get("layers"), str) and ns.arch == "itt":
        options["layers"] = every_other_layer(num_layers_of(ns.like), options["layers"])
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
