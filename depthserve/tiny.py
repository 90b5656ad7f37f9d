"""`depthserve make-tiny` and `depthserve calibrate`: small random checkpoints in the native format.

A tiny checkpoint has random weights with *peaked* output distributions (the LM head is scaled so
that the top-2 logit gap is usually large), so greedy comparisons between the engine and the
reference mean something. `--like smollm2-135m-instruct` gives the real model's shapes (random
weights) for benchmarks. An ITT checkpoint gets a calibration table computed on synthetic token
streams; `depthserve calibrate --model DIR --text FILE` recomputes it on real text.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from depthserve.loading.checkpoint import (
    ITTSpec,
    LlamaSpec,
    SGTLayer,
    SGTSpec,
    depth_section,
    itt_router_bias,
    itt_router_weight,
    itt_step_encoding,
    write_calibration,
    write_checkpoint,
)

TINY_ARCHITECTURES = ("llama", "sgt", "itt", "dreamer", "put", "saobp")

# Shapes of a tiny model (the vocabulary is the tokenizer's).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rope_theta=10000.0)
LIKE = {
    "smollm2-135m-instruct": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                  num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                  max_position_embeddings=8192, rope_theta=100000.0),
}
EMBED_STD = 1.0  # token embeddings
QK_STD = 1.5  # attention logits of std ~QK_STD**2: focused attention without amplifying fp32 rounding
LOGIT_STD = 4.0  # std of the tiny model's logits: peaked (top-1 ~0.25 on average), top-2 gaps usually >> fp32 noise


def load_default_tokenizer():
    """The SmolLM2 tokenizer of the default model, or a byte-level one built with `tokenizers`."""
    try:
        from depthserve.loading.registry import DEFAULT_MODEL, resolve_model
        from depthserve.loading.tokenizer import load_tokenizer

        return load_tokenizer(resolve_model(DEFAULT_MODEL))
    except Exception:  # noqa: BLE001 - the default model's package is optional here
        return _byte_tokenizer()


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, **{ch: i + 1 for i, ch in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def _sgt_spec(num_layers: int, num_heads: int, layers: Sequence[int] | None = None,
              heads: int | Sequence[Sequence[int]] | None = None, loops: int | None = None) -> SGTSpec:
    """Looped layers 1..3 (or the upper layers of a deep model) with head sets that cover the cases:
    one KV group per head, two heads of one group, and heads split unevenly over groups.

    `layers`, `heads` (a head count, taken as heads 0..n-1, or one head set per looped layer) and
    `loops` (the trained count of every looped layer) override those defaults."""
    if layers is None:
        if num_layers <= 4:
            layers = [1, 2, 3][: max(num_layers - 1, 1)]
        else:
            layers = [num_layers // 3, num_layers // 2, (2 * num_layers) // 3]
    layers = list(layers)
    if not layers or len(set(layers)) != len(layers) or not all(0 <= l < num_layers for l in layers):
        raise ValueError(f"SGT layers must be distinct layer indices in 0..{num_layers - 1}, got {layers}")
    if heads is None:
        defaults = [[num_heads - 1, 0], [1, num_heads // 2, num_heads - 1], [1, 0]]
        head_sets = [defaults[i % len(defaults)] for i in range(len(layers))]
    elif isinstance(heads, int):
        if not 1 <= heads <= num_heads:
            raise ValueError(f"the SGT head count must lie in 1..{num_heads}, got {heads}")
        head_sets = [list(range(heads))] * len(layers)
    else:
        head_sets = [list(h) for h in heads]
        if len(head_sets) != len(layers):
            raise ValueError(f"give one SGT head set per looped layer ({len(layers)}), got {len(head_sets)}")
    head_sets = [sorted(set(h), key=h.index) for h in head_sets]
    if not all(h and all(0 <= x < num_heads for x in h) for h in head_sets):
        raise ValueError(f"SGT head sets must be non-empty sets of heads in 0..{num_heads - 1}, got {head_sets}")
    counts = [2, 1, 1][: len(layers)] + [1] * max(len(layers) - 3, 0) if loops is None else [loops] * len(layers)
    if min(counts) < 0:
        raise ValueError(f"the SGT loop count must be >= 0, got {loops}")
    return SGTSpec(tuple(SGTLayer(l, tuple(h), k) for l, h, k in zip(layers, head_sets, counts)),
                   max_loops=max(3, *counts))


def _itt_spec(num_layers: int, layers: Sequence[int] | None = None, steps: int | None = None) -> ITTSpec:
    """ITT on layers 1 and 3 (a quarter, half and three quarters of a deep model) with T=2 steps;
    `layers` and `steps` override those. Step t has alpha = 1/2^(t-1) and trained ratio
    max(0.5 - 0.2 (t-1), 0.1): (1.0, 0.5) and (0.5, 0.3) for T=2."""
    if layers is None:
        layers = (1, 3) if num_layers <= 4 else (num_layers // 4, num_layers // 2, (3 * num_layers) // 4)
        layers = tuple(l for l in layers if l < num_layers)
    layers = tuple(layers)
    if not layers or len(set(layers)) != len(layers) or not all(0 <= l < num_layers for l in layers):
        raise ValueError(f"ITT layers must be distinct layer indices in 0..{num_layers - 1}, got {list(layers)}")
    steps = 2 if steps is None else steps
    if steps < 1:
        raise ValueError(f"the ITT step count must be >= 1, got {steps}")
    alphas = tuple(0.5**t for t in range(steps))
    ratios = tuple(round(max(0.5 - 0.2 * t, 0.1), 6) for t in range(steps))
    return ITTSpec(layers=layers, steps=steps, alphas=alphas, trained_ratios=ratios, skip_rule="paper")


def normal_sampler(gen: torch.Generator) -> Callable[..., torch.Tensor]:
    """normal(*shape, std=1.0): contiguous Gaussian draws from `gen`."""
    import torch

    def normal(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    return normal


def llama_weights(cfg: dict[str, Any], gen: torch.Generator, layer_prefixes: Sequence[str] | None = None
                  ) -> dict[str, torch.Tensor]:
    """Random Llama weights (embeddings, final norm, untied head, and the layers under
    `layer_prefixes`, default model.layers.0..L-1), scaled so that output distributions are peaked."""
    d, ffn, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, H_kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    normal = normal_sampler(gen)

    w = {"model.embed_tokens.weight": normal(V, d, std=EMBED_STD),
         "model.norm.weight": 1 + normal(d, std=0.1)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(V, d, std=LOGIT_STD / d**0.5)  # peaked output distributions
    if layer_prefixes is None:
        layer_prefixes = [f"model.layers.{i}." for i in range(cfg["num_hidden_layers"])]
    for p in layer_prefixes:
        w[p + "self_attn.q_proj.weight"] = normal(H * hd, d, std=QK_STD / d**0.5)
        w[p + "self_attn.k_proj.weight"] = normal(H_kv * hd, d, std=QK_STD / d**0.5)
        w[p + "self_attn.v_proj.weight"] = normal(H_kv * hd, d, std=1.0 / d**0.5)
        w[p + "self_attn.o_proj.weight"] = normal(d, H * hd, std=1.0 / (H * hd) ** 0.5)
        w[p + "mlp.gate_proj.weight"] = normal(ffn, d, std=1.0 / d**0.5)
        w[p + "mlp.up_proj.weight"] = normal(ffn, d, std=1.0 / d**0.5)
        w[p + "mlp.down_proj.weight"] = normal(d, ffn, std=1.0 / ffn**0.5)
        w[p + "input_layernorm.weight"] = 1 + normal(d, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + normal(d, std=0.1)
    return w


def random_weights(cfg: dict[str, Any], spec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """llama_weights plus the ITT routers and step encodings where `spec` is ITT."""
    import torch

    d = cfg["hidden_size"]
    normal = normal_sampler(gen)

    w = llama_weights(cfg, gen)
    if isinstance(spec, ITTSpec):
        T = spec.steps
        for layer in spec.layers:
            w[itt_router_weight(layer)] = normal(T, d, std=2.0 / d**0.5)  # spread-out router scores
            w[itt_router_bias(layer)] = normal(T, std=0.1)
            phi0 = 1 + normal(1, d, std=0.1)
            phis = 0.1 + normal(T, d, std=0.05)
            w[itt_step_encoding(layer)] = torch.cat([phi0, phis]).contiguous()
    return w


def make_tiny(arch: str, out: str | Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None,
              tokenizer=None, calibrate_windows: int = 16, calibrate_window: int = 128, *,
              sgt_layers: Sequence[int] | None = None, sgt_heads: int | Sequence[Sequence[int]] | None = None,
              sgt_loops: int | None = None, itt_layers: Sequence[int] | None = None,
              itt_steps: int | None = None, arch_options: dict[str, Any] | None = None) -> Path:
    """Write a random-initialised checkpoint of `arch` (one of TINY_ARCHITECTURES) to `out`.

    The sgt_* and itt_* arguments override the depth layout of `_sgt_spec` / `_itt_spec`
    (None keeps the defaults); they are an error for another architecture. `arch_options` go to
    the make_tiny of an architecture with its own module (dreamer, put, saobp)."""
    import torch

    from depthserve.architectures import ARCHITECTURE_MODULES, architecture_module

    if arch in ARCHITECTURE_MODULES:  # an architecture with its own module writes its own tiny checkpoint
        return architecture_module(arch).make_tiny(Path(out), seed, like, num_kv_heads,
                                                   tokenizer or load_default_tokenizer(), **(arch_options or {}))
    if arch not in ("llama", "sgt", "itt"):
        raise ValueError(f"--arch must be one of {TINY_ARCHITECTURES}, got {arch!r}")
    if arch_options:
        raise ValueError(f"--option applies to {sorted(ARCHITECTURE_MODULES)} only, not {arch}")
    overrides = {"sgt": (sgt_layers, sgt_heads, sgt_loops), "itt": (itt_layers, itt_steps)}
    for other, values in overrides.items():
        if other != arch and any(v is not None for v in values):
            raise ValueError(f"{other}_* options apply to --arch {other} only, not {arch}")
    shapes = model_shapes(like, num_kv_heads)
    tokenizer = tokenizer or load_default_tokenizer()
    out = Path(out)
    gen = torch.Generator().manual_seed(seed)
    cfg = base_config(tokenizer, shapes, tied=bool(like))
    spec = {"llama": lambda: LlamaSpec(),
            "sgt": lambda: _sgt_spec(cfg["num_hidden_layers"], cfg["num_attention_heads"],
                                     sgt_layers, sgt_heads, sgt_loops),
            "itt": lambda: _itt_spec(cfg["num_hidden_layers"], itt_layers, itt_steps)}[arch]()
    cfg["depth"] = depth_section(spec)
    write_checkpoint(out, cfg, random_weights(cfg, spec, gen), tokenizer)
    if arch == "itt":
        streams = synthetic_streams(cfg["vocab_size"], calibrate_windows, calibrate_window, seed)
        calibrate_tokens(out, streams, {"source": "synthetic token streams (make-tiny)", "seed": seed})
    return out


def model_shapes(like: str | None, num_kv_heads: int | None = None) -> dict[str, Any]:
    """The Llama shape fields of a tiny model, or of a real model (`like`), with optional GQA override."""
    if like and like not in LIKE:
        raise ValueError(f"--like must be one of {sorted(LIKE)}")
    shapes = dict(LIKE[like]) if like else dict(TINY)
    if num_kv_heads is not None:
        if shapes["num_attention_heads"] % num_kv_heads:
            raise ValueError("--num-kv-heads must divide the number of attention heads")
        shapes["num_key_value_heads"] = num_kv_heads
    return shapes


def base_config(tokenizer, shapes: dict[str, Any], tied: bool) -> dict[str, Any]:
    """config.json of a random checkpoint: HF Llama fields (the `depth` section is added by the caller)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        **shapes,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "torch_dtype": "float32",
    }


def synthetic_streams(vocab_size: int, windows: int, length: int, seed: int) -> torch.Tensor:
    """Token windows [windows, length] drawn from a Zipf-like distribution over a shuffled vocabulary."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
    probs = 1.0 / ranks**1.1
    order = torch.randperm(vocab_size, generator=gen)
    draws = torch.multinomial(probs / probs.sum(), windows * length, replacement=True, generator=gen)
    return order[draws].view(windows, length)


def calibrate_tokens(model_dir: Path, sequences, metadata: dict[str, Any]) -> dict[int, torch.Tensor]:
    """Compute and write the ITT calibration table from token sequences (a [B, n] tensor or lists)."""
    from depthserve import reference

    tables = reference.calibrate(model_dir, sequences)
    lengths = [len(s) for s in sequences]
    write_calibration(Path(model_dir), tables, {**metadata, "num_tokens": int(sum(lengths)),
                                                "num_sequences": len(lengths), "max_len": int(max(lengths))})
    return tables


def text_sequences(tokenizer, text_file: Path, max_len: int, max_tokens: int | None) -> list[list[int]]:
    """Tokenize a text file (.jsonl: each line's "text" is a document; else the whole file is one):
    each document is a sequence from position 0, as a prompt would be, cut every `max_len` tokens."""
    if text_file.suffix == ".jsonl":
        docs = [json.loads(line).get("text", "") for line in text_file.read_text().splitlines() if line.strip()]
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


# ---- command line ------------------------------------------------------------------------------------
def add_subcommands(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a small random checkpoint of any served architecture in the native format")
    p.add_argument("--arch", required=True, choices=TINY_ARCHITECTURES)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--like", default=None, choices=sorted(LIKE), help="the real model's shapes, random weights")
    p.add_argument("--num-kv-heads", type=int, default=None, help="KV heads (default 2 of 4: GQA; 4 for MHA)")
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

    c = sub.add_parser("calibrate", help="write an ITT checkpoint's router-score calibration table")
    c.add_argument("--model", required=True, help="ITT checkpoint directory")
    c.add_argument("--text", required=True, help="calibration text (.txt, or .jsonl with a 'text' field)")
    c.add_argument("--max-len", type=int, default=512, help="documents are cut into sequences of at most this many tokens")
    c.add_argument("--max-tokens", type=int, default=65536)
    c.set_defaults(func=_cmd_calibrate)


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
    return (LIKE[like] if like else TINY)["num_hidden_layers"]


def _cmd_make_tiny(ns: argparse.Namespace) -> int:
    itt_layers = ns.itt_layers
    if isinstance(itt_layers, str):
        itt_layers = every_other_layer(num_layers_of(ns.like), itt_layers)
    try:
        path = make_tiny(ns.arch, ns.out, ns.seed, ns.like, ns.num_kv_heads, sgt_layers=ns.sgt_layers,
                         sgt_heads=ns.sgt_heads, sgt_loops=ns.sgt_loops, itt_layers=itt_layers,
                         itt_steps=ns.itt_steps, arch_options=dict(ns.arch_options))
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a random {ns.arch} checkpoint to {path}")
    return 0


def _cmd_calibrate(ns: argparse.Namespace) -> int:
    from depthserve.errors import DepthServeError

    try:
        tables = calibrate(ns.model, ns.text, ns.max_len, ns.max_tokens)
    except (DepthServeError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the calibration table of {len(tables)} ITT layers to {ns.model}")
    return 0
