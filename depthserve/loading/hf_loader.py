"""Read a Hugging Face style checkpoint directory (config.json + *.safetensors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm


def load_hf_dir(path: Path, progress: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, every tensor of every *.safetensors file). A native-format checkpoint's `depth`
    section is checked here (docs/checkpoint-format.md); its extra tensors (ITT routers, step
    encodings, the calibration table file) load with the rest."""
    from depthserve.archs import resolve_architecture

    config = json.loads((path / "config.json").read_text())
    resolve_architecture(config)  # a malformed depth section fails before any weight is read
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    weights: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc=f"Loading {path.name}", disable=not progress, unit="file"):
        weights.update(load_file(str(file)))
    return config, weights
