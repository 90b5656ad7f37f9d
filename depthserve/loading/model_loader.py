"""Build a model from a resolved source: pick the architecture, load its weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from depthserve.architectures import module_of_spec
from depthserve.layers.linear import optimize_linears_for_cpu
from depthserve.loading.gguf_loader import load_gguf
from depthserve.loading.checkpoint import ITTSpec, SGTSpec, read_depth_spec
from depthserve.loading.hf_loader import load_hf_dir
from depthserve.loading.registry import ModelSource
from depthserve.models.llama import LlamaConfig, LlamaForCausalLM


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: dict[str, Any]
    max_model_len: int


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
               progress: bool = True, cpu_linear: bool = True) -> LoadedModel:
    if source.format == "gguf":
        hf_config, weights = load_gguf(source.path, progress)
    else:
        hf_config, weights = load_hf_dir(source.path, progress)
    spec = read_depth_spec(hf_config)  # the native format's `depth` section (absent: plain Llama)
    module = module_of_spec(spec)
    if module is not None:  # an architecture with its own module (depthserve/architectures.py)
        context = int(hf_config.get("max_position_embeddings", 4096))
        max_len = min(max_model_len or context, context)
        model = module.build_model(hf_config, spec, max_len)
        model.checkpoint_path = str(source.path)
        model.load_hf_state_dict(weights)
        model = model.to(device=device, dtype=dtype).eval()
        if hasattr(model, "finish_load"):
            model.finish_load(device)
        return LoadedModel(model=model, hf_config=hf_config, max_model_len=max_len)
    archs = hf_config.get("architectures") or ["LlamaForCausalLM"]
    if archs[0] not in ("LlamaForCausalLM", "MistralForCausalLM"):
        raise ValueError(f"architecture {archs[0]} is not supported")
    cfg = LlamaConfig.from_hf(hf_config)
    context = cfg.max_position_embeddings
    max_len = min(max_model_len or context, context)
    with torch.device("meta"):
        model = _build(cfg, spec, max_len)
    model = model.to_empty(device="cpu")
    model.rope_cos, model.rope_sin = _rope(cfg, max_len)
    model.checkpoint_path = str(source.path)
    model.load_hf_state_dict(weights)
    model = model.to(device=device, dtype=dtype).eval()
    if hasattr(model, "finish_load"):
        model.finish_load(device)
    # The rotary tables stay fp32 whatever the model dtype.
    model.rope_cos, model.rope_sin = (t.to(device=device, dtype=torch.float32) for t in _rope(cfg, max_len))
    if device.type == "cpu" and dtype == torch.float32 and cpu_linear:
        optimize_linears_for_cpu(model)
    return LoadedModel(model=model, hf_config=hf_config, max_model_len=max_len)


def _build(cfg: LlamaConfig, spec, max_len: int) -> torch.nn.Module:
    if isinstance(spec, SGTSpec):
        from depthserve.models.sgt import SGTForCausalLM

        return SGTForCausalLM(cfg, spec, max_positions=max_len)
    if isinstance(spec, ITTSpec):
        from depthserve.models.itt import ITTForCausalLM

        return ITTForCausalLM(cfg, spec, max_positions=max_len)
    return LlamaForCausalLM(cfg, max_positions=max_len)


def _rope(cfg: LlamaConfig, max_len: int):
    from depthserve.layers.rotary import rope_tables

    return rope_tables(cfg.head_dim, max_len, cfg.rope_theta)
