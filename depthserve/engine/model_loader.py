"""Build a model from a resolved source: one path for every architecture.

read the checkpoint (GGUF or HF directory) -> its registered architecture and spec -> the model,
built on the meta device (no random init) -> the weights, by name (loading/weights.py) -> cast and
moved -> `finish_load` (tensors that keep their own dtype) -> on CPU, linear layers served from
quantized codes where the quantization mode says (loading/quantization.py), and in fp32 laid out for
small batches (layers/linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import logging

import torch
from torch import nn

from depthserve.archs import BuildOptions, DepthModel, resolve_architecture
from depthserve.layers.linear import optimize_linears_for_cpu
from depthserve.loading.gguf_loader import load_gguf
from depthserve.loading.hf_loader import read_config, read_weights
from depthserve.loading.quantization import (QuantizationReport, checkpoint_codes, quantize_model, resident_bytes,
                                             resolve_quantization)
from depthserve.loading.registry import ModelSource
from depthserve.loading.weights import load_weights, parameter_name

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: DepthModel
    hf_config: dict[str, Any]
    max_model_len: int
    vocab_size: int
    quantization: QuantizationReport


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
               progress: bool = True, cpu_linear: bool = True, max_loops: int | None = None,
               quantization: str = "none") -> LoadedModel:
    mode = resolve_quantization(quantization, source.format, device, dtype)
    codes, stored_types = {}, {}
    if source.format == "gguf":
        read = load_gguf(source.path, progress, keep_codes=mode != "none")
        hf_config, weights, codes, stored_types = read.config, read.dense, read.quantized, read.types
        architecture, spec = resolve_architecture(hf_config)
    else:  # a malformed depth section (docs/checkpoint-format.md) fails before any weight is read
        hf_config = read_config(source.path)
        architecture, spec = resolve_architecture(hf_config)
        weights = read_weights(source.path, progress)
    context = int(hf_config.get("max_position_embeddings", 4096))
    max_len = min(max_model_len or context, context)
    with torch.device("meta"):
        model = architecture.build(hf_config, spec, BuildOptions(max_len=max_len, max_loops=max_loops))
    model = allocate(model, torch.device("cpu"))
    derived = load_weights(model, weights, str(source.path))
    # Quantized from the checkpoint's own values, before the cast (rounding bf16 weights would
    # round twice), then the copies derived from quantized layers refilled from what they serve.
    report = quantize_model(model, mode, checkpoint_codes(model, codes), dtype, keep_dense=derived)
    if report.quantized:
        model.after_quantization()
    model = model.to(device=device, dtype=dtype).eval()
    model.finish_load(device)
    report.resident_bytes = resident_bytes(model)
    if mode == "gguf" and report.dense:
        _warn_dequantized(report, stored_types, model)
    if cpu_linear:  # the linears whose weights take LINEAR's CPU form (layers/linear.py)
        optimize_linears_for_cpu(model)
    return LoadedModel(model=model, hf_config=hf_config, max_model_len=max_len, vocab_size=int(hf_config["vocab_size"]),
                       quantization=report)


def allocate(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to_empty(device=device)` for a model built on the meta device: every parameter and
    buffer given uninitialised storage of its shape and dtype. to_empty's empty_like runs through
    torch's Python reference for meta tensors, which imports sympy and the symbolic-shapes machinery
    (~0.3 s of an engine's start-up, never needed by an eager engine: tests/test_startup_imports.py)."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def _warn_dequantized(report: QuantizationReport, stored_types: dict[str, str], model) -> None:
    """Name the GGUF types that no CPU kernel serves exactly (their linear layers run dequantized)."""
    tensor_of = {name: id(param) for name, param in model.named_parameters(remove_duplicate=False)}
    type_of_tensor = {}
    for name, kind in stored_types.items():
        target, _ = parameter_name(name, model.checkpoint_prefix, model.packed_modules)
        type_of_tensor[tensor_of.get(target)] = kind
    kinds = sorted({type_of_tensor.get(tensor_of.get(name), "?") for name in report.dense})
    log.warning("%d linear weights are served dequantized: no CPU kernel reproduces their GGUF types (%s)",
                len(report.dense), ", ".join(kinds))
