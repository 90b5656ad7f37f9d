"""Read a Hugging Face style checkpoint directory (config.json + *.safetensors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm


def load_hf_dir(path: Path, progress: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, every tensor of every *.safetensors file). A native-format checkpoint's extra
    tensors (routers, step encodings, a calibration table file) load with the rest."""
    return read_config(path), read_weights(path, progress)


def read_config(path: Path) -> dict[str, Any]:
    """The checkpoint's config.json."""
    return json.loads((path / "config.json").read_text())


def read_weights(path: Path, progress: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file of the checkpoint directory."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    weights: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc=f"Loading {path.name}", disable=not progress, unit="file"):
        weights.update(load_file(str(file)))
    return weights
