"""Which weights a model serves quantized, and the swap of its linear layers (docs/quantization.md).

`--quantization` (EngineArgs.quantization):
- `auto`: on a CPU running bf16 activations, a GGUF is served from its own codes where a CPU
  kernel reproduces its weights exactly (Q4_0 / Q4_1: int4 groups of 32; Q8_0, int8 groups of 32,
  on the native kernels, `kernels/cpu_native.py`, which also serve a tied embedding table from
  it), every other tensor dequantized (named in a warning); with fp32 activations, on CUDA, and for
  other checkpoints: nothing quantized (the weight-only kernels are slower than fp32 GEMMs with
  fp32 activations).
- `gguf`: a GGUF's own codes as `auto` chooses them, whatever the activation dtype (vLLM's name).
- `none`: every weight dequantized, as stored or as the file's dtype.
- `int4` / `int8`: every linear layer quantized at load (round-to-nearest: int4 per group of 32,
  int8 per output row; a GGUF's own codes of that width are used as they are), the relative weight
  error logged.

With `int4` / `int8`, a tied LM head and its embedding share one int8 table. Layers whose weights
an architecture derives from others at load (SGT's loop attention) stay dense and are refilled from
the quantized sources (`DepthModel.after_quantization`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from depthserve.errors import ConfigurationError
from depthserve.kernels import cpu_native
from depthserve.layers.quantized import (DequantScratch, QuantEmbedding, QuantizedWeight, QuantLinear, QuantPolicy,
                                         concat_rows, move_native_weights_to_huge_pages, quantizable, quantize_rtn,
                                         uses_native_kernel)
from depthserve.loading.weights import parameter_name

log = logging.getLogger(__name__)

QUANTIZATION_MODES = ("auto", "none", "gguf", "int8", "int4")
HEAD_BITS = 8  # the tied head / embedding table: int8 rows serve both the lookup and the head
OUTPUT_HEAD = "lm_head.weight"  # every architecture's output projection, by the checkpoint format's name


def cpu_features() -> str:
    """The instruction sets that decide the CPU dtype, for the start-up log and benchmark files."""
    cpu = torch.cpu
    flags = [("AVX2", cpu._is_avx2_supported()), ("AVX-512", cpu._is_avx512_supported()),
             ("VNNI", cpu._is_vnni_supported()), ("AVX-512 BF16", cpu._is_avx512_bf16_supported()),
             ("AMX", cpu._is_amx_tile_supported())]
    present = [name for name, supported in flags if supported]
    return ", ".join(present) if present else "no AVX-512"


# Below this many bytes of stored weights a CPU serves fp32 under `auto`: the weights stay in cache,
# so a step is bound by per-call overhead, not by bytes, and oneDNN's bf16 GEMM costs more per call
# (2-core AMD EPYC, 2 threads: a 256x128 layer at 1 row 26 us in bf16 against 5 us in fp32; the
# 1.6 MB demo-dreamer answering one request, 16 tokens, 151-154 ms in bf16 against 79-117 ms in
# fp32). The SmolLM2-sized models (92 MB GGUF, 0.5 GB fp32) are bandwidth-bound and gain from bf16.
SMALL_WEIGHTS_BYTES = 32 * 2**20


def resolve_dtype(name: str, device: torch.device, weight_bytes: int | None = None) -> torch.dtype:
    """`auto`: bf16 on CUDA, and on CPUs with native bf16 arithmetic for checkpoints whose stored
    weights (`weight_bytes`, None: unknown) are at least SMALL_WEIGHTS_BYTES; fp32 otherwise."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    small = weight_bytes is not None and weight_bytes < SMALL_WEIGHTS_BYTES
    return torch.bfloat16 if cpu_native.cpu_has_native_bf16_gemm() and not small else torch.float32


def resolve_quantization(mode: str, checkpoint_format: str, device: torch.device, dtype: torch.dtype) -> str:
    """The effective mode: "none", "gguf" (the file's own codes), "int8" or "int4"."""
    if mode not in QUANTIZATION_MODES:
        raise ConfigurationError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}")
    if mode == "auto":
        served_natively = device.type == "cpu" and dtype == torch.bfloat16 and checkpoint_format == "gguf"
        return "gguf" if served_natively else "none"
    if mode == "gguf" and checkpoint_format != "gguf":
        raise ConfigurationError("quantization gguf serves a GGUF file's own codes; this checkpoint is not a GGUF "
                                 "(use int4 or int8 to quantize it at load)")
    if mode != "none" and device.type != "cpu":
        raise ConfigurationError(f"quantization {mode} runs on CPU only (torch's weight-only CPU kernels); "
                                 "use --quantization none on CUDA")
    return mode


@dataclass
class QuantizationReport:
    mode: str
    quantized: list[str] = field(default_factory=list)  # parameter names served from codes
    dense: list[str] = field(default_factory=list)  # linear weights left dequantized, and why
    weight_error: float | None = None  # relative Frobenius error of the re-rounded weights (RTN)
    resident_bytes: int = 0  # every parameter and buffer of the served model (set by the loader after the cast)
    kernel: str = ""  # which kernels the quantized layers run, set when any is quantized

    def summary(self) -> str:
        error = "" if self.weight_error is None else f", relative weight error {self.weight_error:.4f}"
        kernel = f" ({self.kernel})" if self.kernel else ""
        return (f"quantization {self.mode}: {len(self.quantized)} linear weights quantized{kernel}, "
                f"{len(self.dense)} dense{error}; weights resident {self.resident_bytes / 2**20:.1f} MiB")


def checkpoint_codes(model: nn.Module, codes: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """A checkpoint's codes under the model's parameter names, packed projections concatenated in
    shard order as `loading.weights.load_weights` does with dense tensors."""
    shards: dict[str, dict[int, QuantizedWeight]] = {}
    by_parameter: dict[str, QuantizedWeight] = {}
    for name, weight in codes.items():
        target, shard = parameter_name(name, model.checkpoint_prefix, model.packed_modules)
        if shard is None:
            by_parameter[target] = weight
        else:
            shards.setdefault(target, {})[shard] = weight
    for target, parts in shards.items():
        by_parameter[target] = concat_rows([parts[i] for i in sorted(parts)])
    return by_parameter


def quantize_model(model: nn.Module, mode: str, codes: dict[str, QuantizedWeight], dtype: torch.dtype,
                   policy: QuantPolicy | None = None, keep_dense: set[str] = frozenset()) -> QuantizationReport:
    """Swap the model's nn.Linear layers for QuantLinear where `mode` says (module docstring); tied
    embeddings read the head's int8 table. `codes`: a checkpoint's own codes by parameter name;
    `keep_dense`: parameter names the model derives from others (copies stay dense; a tied
    parameter is the same tensor as its source and is quantized with it)."""
    report = QuantizationReport(mode)
    if mode != "none":
        aliases = _parameter_aliases(model)
        scratch, policy = DequantScratch(), policy or QuantPolicy.for_this_cpu()
        errors: list[tuple[float, float]] = []
        quantized_tables: dict[int, QuantLinear] = {}
        for parent, child_name, linear, name in _linears(model):
            copied = name in keep_dense and len(aliases.get(name, [name])) == 1  # a tie is no copy
            weight = None if copied else _weight_codes(linear, name, aliases, codes, mode, errors, uses_native_kernel(dtype))
            if weight is None:
                report.dense.append(name)
                continue
            layer = QuantLinear(weight, linear.bias, dtype, scratch, policy, refine_activations=name == OUTPUT_HEAD)
            setattr(parent, child_name, layer)
            quantized_tables[id(linear.weight)] = layer
            report.quantized.append(name)
        _share_embedding_tables(model, quantized_tables)
        move_native_weights_to_huge_pages(model)
        if report.quantized:
            report.kernel = ("native kernels, AVX-512 VNNI" if uses_native_kernel(dtype)
                             else f"torch's kernels: native ones {_why_not_native(dtype)}")
        if errors:
            report.weight_error = (sum(e for e, _ in errors) / sum(n for _, n in errors)) ** 0.5
    return report


def _why_not_native(dtype: torch.dtype) -> str:
    reason = cpu_native.unavailable_reason()
    return f"unavailable, {reason}" if reason else f"not used with {str(dtype).removeprefix('torch.')} activations"


def _linears(model: nn.Module):
    """(parent, attribute, linear, weight's parameter name) of every plain nn.Linear."""
    for module_name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                prefix = f"{module_name}." if module_name else ""
                yield module, child_name, child, f"{prefix}{child_name}.weight"


def _parameter_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter (a tied head is also its embedding's weight)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name: group for group in names.values() for name in group}


def _weight_codes(linear: nn.Linear, name: str, aliases: dict[str, list[str]], codes: dict[str, QuantizedWeight],
                  mode: str, errors: list[tuple[float, float]], native: bool) -> QuantizedWeight | None:
    """The codes a linear layer is served from, or None to keep it dense."""
    names = aliases.get(name, [name])
    stored = next((codes[alias] for alias in names if alias in codes), None)
    bits = _wanted_bits(mode, tied=len(names) > 1, stored=stored, native=native)
    if bits is None:
        return None
    if stored is not None and stored.bits == bits:
        return stored
    if not quantizable(tuple(linear.weight.shape), bits):
        log.warning("%s %s stays dense: int%d needs whole groups of input features", name, list(linear.weight.shape), bits)
        return None
    weight = linear.weight.detach().float()
    rounded = quantize_rtn(weight, bits)
    errors.append((float((rounded.dequantize() - weight).pow(2).sum()), float(weight.pow(2).sum())))
    return rounded


def _wanted_bits(mode: str, tied: bool, stored: QuantizedWeight | None, native: bool) -> int | None:
    if mode == "gguf":
        # Codes only where a kernel reproduces the file. Q8_0 (a scale per group of 32) only the
        # native kernel takes, and that also serves a tied table from it; torch's kernels leave a
        # tied table dense (its int8 kernel scales whole rows).
        if stored is None or (stored.bits == 8 and stored.grouped and not native):
            return None
        return stored.bits if native or not tied else None
    return HEAD_BITS if tied else {"int4": 4, "int8": 8}[mode]


def _share_embedding_tables(model: nn.Module, quantized_tables: dict[int, QuantLinear]) -> None:
    """An embedding whose table is a quantized head's weight reads that head's int8 rows."""
    for module_name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Embedding and id(child.weight) in quantized_tables:
                head = quantized_tables[id(child.weight)]
                if head.bits == 8:
                    setattr(module, child_name, QuantEmbedding(head))


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (a tensor shared by several names counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total
