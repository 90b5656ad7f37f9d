"""Build a model from a resolved source: one path for every architecture.

read the checkpoint (GGUF or HF directory) -> its registered architecture and spec -> the model,
built on the meta device (no random init) -> the weights, by name (loading/weights.py) -> cast and
moved -> `finish_load` (tensors that keep their own dtype) -> on CPU in fp32, linear layers laid
out for small batches (layers/linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from depthserve.archs import BuildOptions, DepthModel, resolve_architecture
from depthserve.layers.linear import optimize_linears_for_cpu
from depthserve.loading.gguf_loader import load_gguf
from depthserve.loading.hf_loader import load_hf_dir
from depthserve.loading.registry import ModelSource
from depthserve.loading.weights import load_weights


@dataclass
class LoadedModel:
    model: DepthModel
    hf_config: dict[str, Any]
    max_model_len: int
    vocab_size: int


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
               progress: bool = True, cpu_linear: bool = True, max_loops: int | None = None) -> LoadedModel:
    if source.format == "gguf":
        hf_config, weights = load_gguf(source.path, progress)
    else:
        hf_config, weights = load_hf_dir(source.path, progress)
    architecture, spec = resolve_architecture(hf_config)
    context = int(hf_config.get("max_position_embeddings", 4096))
    max_len = min(max_model_len or context, context)
    with torch.device("meta"):
        model = architecture.build(hf_config, spec, BuildOptions(max_len=max_len, max_loops=max_loops))
    model = model.to_empty(device="cpu")
    load_weights(model, weights, str(source.path))
    model = model.to(device=device, dtype=dtype).eval()
    model.finish_load(device)
    if device.type == "cpu" and dtype == torch.float32 and cpu_linear:
        optimize_linears_for_cpu(model)
    return LoadedModel(model=model, hf_config=hf_config, max_model_len=max_len, vocab_size=int(hf_config["vocab_size"]))
