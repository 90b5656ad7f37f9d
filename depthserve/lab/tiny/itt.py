"""Random-weight ITT checkpoints: a tiny Llama with ITT layers, spread-out router scores, and a
calibration table computed on synthetic token streams (`depthserve calibrate` replaces it with
one computed on real text)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from depthserve.archs.itt.format import ITTSpec, router_bias, router_weight, step_encoding, to_section, write_calibration
from depthserve.lab.tiny.llama import (base_config, every_other_layer, int_list, llama_weights, model_shapes,
                                         normal_sampler, num_layers_of, synthetic_streams)
from depthserve.archs.registry import TinyFlag
from depthserve.loading.checkpoint import write_checkpoint
from depthserve.loading.tokenizer import default_tokenizer

if TYPE_CHECKING:
    import torch


def tiny_spec(num_layers: int, layers: Sequence[int] | None = None, steps: int | None = None) -> ITTSpec:
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


def itt_weights(cfg: dict[str, Any], spec: ITTSpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random routers and step encodings of the ITT layers."""
    import torch

    d, T = cfg["hidden_size"], spec.steps
    normal = normal_sampler(gen)
    w = {}
    for layer in spec.layers:
        w[router_weight(layer)] = normal(T, d, std=2.0 / d**0.5)  # spread-out router scores
        w[router_bias(layer)] = normal(T, std=0.1)
        phi0 = 1 + normal(1, d, std=0.1)
        phis = 0.1 + normal(T, d, std=0.05)
        w[step_encoding(layer)] = torch.cat([phi0, phis]).contiguous()
    return w


def calibrate_tokens(model_dir: Path, sequences, metadata: dict[str, Any]) -> dict[int, torch.Tensor]:
    """Compute and write the ITT calibration table from token sequences (a [B, n] tensor or lists)."""
    from depthserve.oracles.itt import calibrate

    tables = calibrate(model_dir, sequences)
    lengths = [len(s) for s in sequences]
    write_calibration(Path(model_dir), tables, {**metadata, "num_tokens": int(sum(lengths)),
                                                "num_sequences": len(lengths), "max_len": int(max(lengths))})
    return tables


def layer_selection(text: str) -> list[int] | str:
    """--itt-layers: a list of layers, or 'odd' / 'even' (every other layer of the model)."""
    return text if text in ("odd", "even") else int_list(text)


def resolve_layers(layers: list[int] | str, like: str | None) -> list[int]:
    return every_other_layer(num_layers_of(like), layers) if isinstance(layers, str) else layers


CLI_FLAGS = (
    TinyFlag("--itt-layers", "layers", layer_selection,
             "ITT layers: a list (e.g. 1,3,5), 'odd' or 'even' (every other layer)", resolve_layers),
    TinyFlag("--itt-steps", "steps", int, "ITT extra steps T (default 2)"),
)


def make_tiny(out: Path, seed: int = 0, like: str | None = None, num_kv_heads: int | None = None, tokenizer=None,
              *, layers: Sequence[int] | None = None, steps: int | None = None, calibrate_windows: int = 16,
              calibrate_window: int = 128) -> Path:
    import torch

    tokenizer = tokenizer or default_tokenizer()
    cfg = base_config(tokenizer, model_shapes(like, num_kv_heads), tied=bool(like))
    spec = tiny_spec(cfg["num_hidden_layers"], layers, steps)
    cfg["depth"] = to_section(spec)
    gen = torch.Generator().manual_seed(seed)
    weights = {**llama_weights(cfg, gen), **itt_weights(cfg, spec, gen)}
    out = write_checkpoint(Path(out), cfg, weights, tokenizer)
    streams = synthetic_streams(cfg["vocab_size"], calibrate_windows, calibrate_window, seed)
    calibrate_tokens(out, streams, {"source": "synthetic token streams (make-tiny)", "seed": seed})
    return out
