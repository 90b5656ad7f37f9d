"""The native checkpoint format: a Hugging Face style directory with a `depth` section.

`config.json` holds the usual Llama fields plus a `depth` object naming the architecture and
its settings; the extra weights (ITT routers, step encodings) live in `*.safetensors` under
HF-style names, and an ITT calibration table lives in its own `itt_calibration.safetensors` so
that `depthserve calibrate` can rewrite it alone. docs/checkpoint-format.md is the reference.

This module only reads and writes the format (no model code): the engine and the reference
implementation both use it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from depthserve.errors import DepthServeError

FORMAT_VERSION = 1
ARCHITECTURES = ("llama", "sgt", "itt", "dreamer", "put", "saobp")
SKIP_RULES = ("paper", "identity")
NUM_QUANTILES = 101
CALIBRATION_FILE = "itt_calibration.safetensors"


class CheckpointFormatError(DepthServeError, ValueError):
    """The checkpoint's `depth` section or its extra weights are malformed or incomplete."""


class MissingCalibrationError(CheckpointFormatError):
    """An ITT checkpoint has no router-score calibration table."""


# ---- the depth section as types ---------------------------------------------------------------
@dataclass(frozen=True)
class SGTLayer:
    layer: int
    heads: tuple[int, ...]  # ordered query-head set S_l
    loops: int  # trained loop count K_l
    head_scales: tuple[float, ...] | None = None  # per-head output scale (fractional head_decay)


@dataclass(frozen=True)
class SGTSpec:
    layers: tuple[SGTLayer, ...]
    max_loops: int  # default ceiling of the `loops` knob (the engine may override it)
    architecture: str = "sgt"

    def layer(self, index: int) -> SGTLayer:
        for spec in self.layers:
            if spec.layer == index:
                return spec
        raise KeyError(index)

    @property
    def looped_layers(self) -> tuple[int, ...]:
        return tuple(spec.layer for spec in self.layers)


@dataclass(frozen=True)
class ITTSpec:
    layers: tuple[int, ...]  # ITT layer indices
    steps: int  # T extra steps
    alphas: tuple[float, ...]  # alpha_1..alpha_T
    trained_ratios: tuple[float, ...]  # rho_1..rho_T (the request default)
    skip_rule: str = "paper"
    calibration: dict[str, Any] | None = None  # metadata of the table (None: no table)
    architecture: str = "itt"


@dataclass(frozen=True)
class LlamaSpec:
    architecture: str = "llama"


DepthSpec = LlamaSpec | SGTSpec | ITTSpec


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise CheckpointFormatError(f"depth.{what} must be a list of integers, got {value!r}")
    return tuple(value)


def _float_list(value: Any, what: str, length: int) -> tuple[float, ...]:
    if not isinstance(value, list) or len(value) != length or not all(isinstance(v, (int, float)) for v in value):
        raise CheckpointFormatError(f"depth.{what} must be a list of {length} numbers, got {value!r}")
    return tuple(float(v) for v in value)


def read_depth_spec(hf_config: dict[str, Any]) -> DepthSpec:
    """Parse and check the `depth` section (absent: a plain Llama checkpoint)."""
    section = hf_config.get("depth")
    if section is None:
        return LlamaSpec()
    if not isinstance(section, dict):
        raise CheckpointFormatError("config.json: `depth` must be an object")
    version = section.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(f"depth.format_version {version} is not supported (expected {FORMAT_VERSION})")
    arch = section.get("architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointFormatError(f"depth.architecture must be one of {ARCHITECTURES}, got {arch!r}")
    if arch == "llama":
        return LlamaSpec()
    from depthserve.architectures import ARCHITECTURE_MODULES, architecture_module

    if arch in ARCHITECTURE_MODULES:
        return architecture_module(arch).read_spec(section, hf_config)
    num_layers = hf_config["num_hidden_layers"]
    num_heads = hf_config["num_attention_heads"]
    if arch == "sgt":
        body = section.get("sgt")
        if not isinstance(body, dict):
            raise CheckpointFormatError("depth.architecture is 'sgt' but depth.sgt is missing")
        layers = _int_list(body.get("looped_layers"), "sgt.looped_layers")
        head_sets = body.get("head_sets")
        counts = _int_list(body.get("loop_counts"), "sgt.loop_counts")
        scales = body.get("head_scales")
        if not isinstance(head_sets, list) or len(head_sets) != len(layers) or len(counts) != len(layers):
            raise CheckpointFormatError("depth.sgt: looped_layers, head_sets and loop_counts must have equal lengths")
        if scales is not None and (not isinstance(scales, list) or len(scales) != len(layers)):
            raise CheckpointFormatError("depth.sgt.head_scales must be null or one list per looped layer")
        if len(set(layers)) != len(layers):
            raise CheckpointFormatError("depth.sgt.looped_layers has duplicates")
        specs = []
        for i, layer in enumerate(layers):
            if not 0 <= layer < num_layers:
                raise CheckpointFormatError(f"depth.sgt: looped layer {layer} is outside 0..{num_layers - 1}")
            heads = _int_list(head_sets[i], f"sgt.head_sets[{i}]")
            if not heads or len(set(heads)) != len(heads) or not all(0 <= h < num_heads for h in heads):
                raise CheckpointFormatError(
                    f"depth.sgt.head_sets[{i}] must be distinct query-head indices in 0..{num_heads - 1}")
            if counts[i] < 0:
                raise CheckpointFormatError("depth.sgt.loop_counts must be >= 0")
            head_scales = None
            if scales is not None and scales[i] is not None:
                head_scales = _float_list(scales[i], f"sgt.head_scales[{i}]", len(heads))
            specs.append(SGTLayer(layer, heads, counts[i], head_scales))
        max_loops = body.get("max_loops", max([2 * c for c in counts] + [1]))
        if not isinstance(max_loops, int) or max_loops < max(counts, default=0):
            raise CheckpointFormatError("depth.sgt.max_loops must be an integer >= every trained loop count")
        return SGTSpec(tuple(sorted(specs, key=lambda s: s.layer)), max_loops)
    body = section.get("itt")
    if not isinstance(body, dict):
        raise CheckpointFormatError("depth.architecture is 'itt' but depth.itt is missing")
    layers = _int_list(body.get("layers"), "itt.layers")
    if not layers or len(set(layers)) != len(layers) or not all(0 <= l < num_layers for l in layers):
        raise CheckpointFormatError(f"depth.itt.layers must be distinct layer indices in 0..{num_layers - 1}")
    steps = body.get("steps")
    if not isinstance(steps, int) or steps < 1:
        raise CheckpointFormatError("depth.itt.steps must be a positive integer")
    alphas = _float_list(body.get("alphas"), "itt.alphas", steps)
    ratios = _float_list(body.get("trained_ratios"), "itt.trained_ratios", steps)
    if not all(0.0 <= r <= 1.0 for r in ratios):
        raise CheckpointFormatError("depth.itt.trained_ratios must lie in [0, 1]")
    skip = body.get("skip_rule", "paper")
    if skip not in SKIP_RULES:
        raise CheckpointFormatError(f"depth.itt.skip_rule must be one of {SKIP_RULES}, got {skip!r}")
    calibration = body.get("calibration")
    if calibration is not None and not isinstance(calibration, dict):
        raise CheckpointFormatError("depth.itt.calibration must be null or an object")
    return ITTSpec(tuple(sorted(layers)), steps, alphas, ratios, skip, calibration)


def depth_section(spec: DepthSpec) -> dict[str, Any]:
    """The `depth` object of config.json for a spec (the inverse of read_depth_spec)."""
    if isinstance(spec, LlamaSpec):
        return {"format_version": FORMAT_VERSION, "architecture": "llama"}
    if hasattr(spec, "to_section"):  # an architecture of depthserve/architectures.py
        return spec.to_section()
    if isinstance(spec, SGTSpec):
        scales = [list(s.head_scales) if s.head_scales is not None else None for s in spec.layers]
        return {
            "format_version": FORMAT_VERSION,
            "architecture": "sgt",
            "sgt": {
                "looped_layers": [s.layer for s in spec.layers],
                "head_sets": [list(s.heads) for s in spec.layers],
                "loop_counts": [s.loops for s in spec.layers],
                "head_scales": scales if any(x is not None for x in scales) else None,
                "max_loops": spec.max_loops,
            },
        }
    return {
        "format_version": FORMAT_VERSION,
        "architecture": "itt",
        "itt": {
            "layers": list(spec.layers),
            "steps": spec.steps,
            "alphas": list(spec.alphas),
            "trained_ratios": list(spec.trained_ratios),
            "skip_rule": spec.skip_rule,
            "calibration": spec.calibration,
        },
    }


# ---- ITT tensor names and the calibration table -----------------------------------------------
def itt_router_weight(layer: int) -> str:
    return f"model.layers.{layer}.itt.router.weight"  # [T, d]: r_1..r_T


def itt_router_bias(layer: int) -> str:
    return f"model.layers.{layer}.itt.router.bias"  # [T]: b_1..b_T


def itt_step_encoding(layer: int) -> str:
    return f"model.layers.{layer}.itt.step_encoding"  # [T + 1, d]: phi_0..phi_T


def itt_quantiles(layer: int) -> str:
    return f"model.layers.{layer}.itt.score_quantiles"  # [T, 101] fp32, levels 0.00, 0.01, ..., 1.00


def pop_itt_weights(spec: ITTSpec, weights: dict, source: str, require_calibration: bool = True) -> dict:
    """Take the ITT tensors out of a state dict: {layer: {"router_w", "router_b", "phi", "quantiles"}}.

    Without a calibration table, raises MissingCalibrationError naming `depthserve calibrate`
    unless `require_calibration` is False (then "quantiles" is None).
    """
    out = {}
    for layer in spec.layers:
        entry = {}
        for key, name, shape_last in (("router_w", itt_router_weight(layer), None),
                                      ("router_b", itt_router_bias(layer), None),
                                      ("phi", itt_step_encoding(layer), None)):
            if name not in weights:
                raise CheckpointFormatError(f"{source}: ITT weight {name} is missing")
            entry[key] = weights.pop(name)
        if tuple(entry["router_w"].shape[:1]) != (spec.steps,) or tuple(entry["router_b"].shape) != (spec.steps,):
            raise CheckpointFormatError(f"{source}: layer {layer} router must have {spec.steps} rows")
        if entry["phi"].shape[0] != spec.steps + 1:
            raise CheckpointFormatError(f"{source}: layer {layer} step_encoding must have T + 1 = {spec.steps + 1} rows")
        table = weights.pop(itt_quantiles(layer), None)
        if table is not None and tuple(table.shape) != (spec.steps, NUM_QUANTILES):
            raise CheckpointFormatError(f"{source}: layer {layer} score_quantiles must be [{spec.steps}, {NUM_QUANTILES}]")
        entry["quantiles"] = table
        out[layer] = entry
    missing = [layer for layer, entry in out.items() if entry["quantiles"] is None]
    if require_calibration and (missing or spec.calibration is None):
        raise MissingCalibrationError(
            f"the ITT checkpoint {source} has no router-score calibration table (layers {missing or list(spec.layers)}); "
            f"write one with `depthserve calibrate --model {source} --text FILE`"
        )
    return out


def threshold(quantiles, ratio: float) -> float:
    """tau_t(rho): the (1 - rho) quantile of the calibrated score distribution (linear between levels).

    rho = 1 selects every token (-inf); rho = 0 means the step is off (+inf: nothing selected,
    and the caller must apply no update at all). Computed in float64, returned as the float32 value.
    """
    if ratio >= 1.0:
        return -math.inf
    if ratio <= 0.0:
        return math.inf
    q = [float(v) for v in quantiles]
    level = (1.0 - ratio) * (len(q) - 1)
    i = min(int(math.floor(level)), len(q) - 2)
    frac = level - i
    value = q[i] + (q[i + 1] - q[i]) * frac
    return struct.unpack("f", struct.pack("f", value))[0]


# ---- writing ------------------------------------------------------------------------------------
def write_config(path: Path, hf_config: dict[str, Any]) -> None:
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


def write_checkpoint(out: Path, cfg: dict[str, Any], weights: dict, tokenizer) -> Path:
    """Write a checkpoint directory: config.json, model.safetensors (every older *.safetensors
    removed first, since a checkpoint's weight files are all read) and the tokenizer files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    save_file({name: t.contiguous() for name, t in weights.items()}, str(out / "model.safetensors"))
    write_config(out, cfg)
    tokenizer.save_pretrained(str(out))
    return out


def write_calibration(path: Path, tables: dict[int, Any], metadata: dict[str, Any]) -> None:
    """Write the quantile table file and record its metadata in config.json."""
    from safetensors.torch import save_file

    save_file({itt_quantiles(layer): t.float().contiguous() for layer, t in tables.items()},
              str(path / CALIBRATION_FILE))
    config = json.loads((path / "config.json").read_text())
    config["depth"]["itt"]["calibration"] = {"file": CALIBRATION_FILE, "num_quantiles": NUM_QUANTILES, **metadata}
    write_config(path, config)
