"""ITT's checkpoint section and tensors, knobs, routing plan, decision record and FLOP counting
(docs/depth-semantics.md section 2).

config.json `depth.itt`: the ITT `layers`, `steps` T, step scales `alphas`, `trained_ratios` (the
request default), `skip_rule` and the `calibration` metadata. Per ITT layer the weights hold the
routers r_1..r_T (+ bias) and step encodings phi_0..phi_T; `itt_calibration.safetensors` holds
101 router-score quantiles per (layer, step), written by `depthserve calibrate`.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from depthserve.archs.llama.format import LlamaConfig, attention_flops, dense_slots, layer_weight_flops, plain_flops
from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.depth import DepthCounter, DepthParams, DepthPlan, DepthRange, DepthReport, KnobInfo, KnobSpec
from depthserve.loading.checkpoint import (
    FORMAT_VERSION,
    CheckpointFormatError,
    MissingCalibrationError,
    float_list,
    int_list,
    write_config,
)

SKIP_RULES = ("paper", "identity")
NUM_QUANTILES = 101
CALIBRATION_FILE = "itt_calibration.safetensors"


@dataclass(frozen=True)
class ITTSpec:
    layers: tuple[int, ...]  # ITT layer indices
    steps: int  # T extra steps
    alphas: tuple[float, ...]  # alpha_1..alpha_T
    trained_ratios: tuple[float, ...]  # rho_1..rho_T (the request default)
    skip_rule: str = "paper"
    calibration: dict[str, Any] | None = None  # metadata of the table (None: no table)
    architecture: str = "itt"


def read_spec(section: dict[str, Any] | None, hf_config: dict[str, Any]) -> ITTSpec:
    body = (section or {}).get("itt")
    if not isinstance(body, dict):
        raise CheckpointFormatError("depth.architecture is 'itt' but depth.itt is missing")
    num_layers = hf_config["num_hidden_layers"]
    layers = int_list(body.get("layers"), "itt.layers")
    if not layers or len(set(layers)) != len(layers) or not all(0 <= l < num_layers for l in layers):
        raise CheckpointFormatError(f"depth.itt.layers must be distinct layer indices in 0..{num_layers - 1}")
    steps = body.get("steps")
    if not isinstance(steps, int) or steps < 1:
        raise CheckpointFormatError("depth.itt.steps must be a positive integer")
    alphas = float_list(body.get("alphas"), "itt.alphas", steps)
    ratios = float_list(body.get("trained_ratios"), "itt.trained_ratios", steps)
    if not all(0.0 <= r <= 1.0 for r in ratios):
        raise CheckpointFormatError("depth.itt.trained_ratios must lie in [0, 1]")
    skip = body.get("skip_rule", "paper")
    if skip not in SKIP_RULES:
        raise CheckpointFormatError(f"depth.itt.skip_rule must be one of {SKIP_RULES}, got {skip!r}")
    calibration = body.get("calibration")
    if calibration is not None and not isinstance(calibration, dict):
        raise CheckpointFormatError("depth.itt.calibration must be null or an object")
    return ITTSpec(tuple(sorted(layers)), steps, alphas, ratios, skip, calibration)


def to_section(spec: ITTSpec) -> dict[str, Any]:
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


# ---- tensor names and the calibration table --------------------------------------------------------
def router_weight(layer: int) -> str:
    return f"model.layers.{layer}.itt.router.weight"  # [T, d]: r_1..r_T


def router_bias(layer: int) -> str:
    return f"model.layers.{layer}.itt.router.bias"  # [T]: b_1..b_T


def step_encoding(layer: int) -> str:
    return f"model.layers.{layer}.itt.step_encoding"  # [T + 1, d]: phi_0..phi_T


def quantiles_name(layer: int) -> str:
    return f"model.layers.{layer}.itt.score_quantiles"  # [T, 101] fp32, levels 0.00, 0.01, ..., 1.00


def pop_itt_weights(spec: ITTSpec, weights: dict, source: str, require_calibration: bool = True) -> dict:
    """Take the ITT tensors out of a state dict: {layer: {"router_w", "router_b", "phi", "quantiles"}}.

    Without a calibration table, raises MissingCalibrationError naming `depthserve calibrate`
    unless `require_calibration` is False (then "quantiles" is None).
    """
    out = {}
    for layer in spec.layers:
        entry = {}
        for key, name in (("router_w", router_weight(layer)), ("router_b", router_bias(layer)),
                          ("phi", step_encoding(layer))):
            if name not in weights:
                raise CheckpointFormatError(f"{source}: ITT weight {name} is missing")
            entry[key] = weights.pop(name)
        if tuple(entry["router_w"].shape[:1]) != (spec.steps,) or tuple(entry["router_b"].shape) != (spec.steps,):
            raise CheckpointFormatError(f"{source}: layer {layer} router must have {spec.steps} rows")
        if entry["phi"].shape[0] != spec.steps + 1:
            raise CheckpointFormatError(f"{source}: layer {layer} step_encoding must have T + 1 = {spec.steps + 1} rows")
        table = weights.pop(quantiles_name(layer), None)
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


def write_calibration(path: Path, tables: dict[int, Any], metadata: dict[str, Any]) -> None:
    """Write the quantile table file and record its metadata in config.json."""
    from safetensors.torch import save_file

    save_file({quantiles_name(layer): t.float().contiguous() for layer, t in tables.items()},
              str(path / CALIBRATION_FILE))
    config = json.loads((path / "config.json").read_text())
    config["depth"]["itt"]["calibration"] = {"file": CALIBRATION_FILE, "num_quantiles": NUM_QUANTILES, **metadata}
    write_config(path, config)


# ---- knobs, routing thresholds and the plan ------------------------------------------------------------
KNOBS = (KnobInfo("selection_ratios", "fraction of tokens routed to each extra step", kind="ratio_list"),
         KnobInfo("thinking_steps", "number of extra steps enabled", elastic=True))


def knobs(spec: ITTSpec) -> dict[str, KnobSpec]:
    T = spec.steps
    return {
        "selection_ratios": KnobSpec(
            "selection_ratios",
            f"fraction of tokens routed to each of the {T} extra steps (trained: {list(spec.trained_ratios)})",
            0.0, 1.0, list(spec.trained_ratios), kind="ratio_list", length=T,
        ),
        "thinking_steps": KnobSpec(
            "thinking_steps", f"number of extra steps enabled; the checkpoint has parameters for {T}, no more", 0, T, T,
            elastic=True,
        ),
    }


def threshold(quantiles, ratio: float) -> float:
    """tau_t(rho): the (1 - rho) quantile of the calibrated score distribution (linear between levels).

    rho = 1 selects every token (-inf); rho = 0 means the step is off (+inf: nothing selected, and
    the caller must apply no update at all). Computed in float64, returned as the float32 value.
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


def routed_slot_name(layer: int, step: int) -> str:
    return f"itt{layer}.step{step}"


@dataclass(frozen=True, kw_only=True)
class ITTPlan(DepthPlan):
    ratios: tuple[float, ...]  # rho_1..rho_T as run (steps after thinking_steps are 0)
    thresholds: np.ndarray  # [ITT layers, T] float32 tau_t(rho_t)

    def step_thresholds(self, level: int | None) -> np.ndarray:
        """The thresholds a step's tokens run with: a range's level turns the steps past it off (+inf)."""
        level = self.step_level(level)
        if level >= self.thresholds.shape[1]:
            return self.thresholds
        out = self.thresholds.copy()
        out[:, level:] = np.inf
        return out


def ratios_of(spec: ITTSpec, depth: DepthParams) -> tuple[float, ...]:
    """selection_ratios (default: trained), zeroed after `thinking_steps` (a range: its maximum)."""
    ratios = list(depth.get("selection_ratios", spec.trained_ratios))
    steps = depth.get("thinking_steps")
    if steps is not None:
        steps = steps.maximum if isinstance(steps, DepthRange) else steps
        ratios = [r if t < steps else 0.0 for t, r in enumerate(ratios)]
    return tuple(ratios)


def plan(cfg: LlamaConfig, spec: ITTSpec, depth: DepthParams, quantiles: list[np.ndarray]) -> ITTPlan:
    """`quantiles`: each ITT layer's [T, 101] calibration table, in layer order."""
    ratios = ratios_of(spec, depth)
    thresholds = np.array([[threshold(table[t], ratios[t]) for t in range(spec.steps)] for table in quantiles],
                          dtype=np.float32)
    routed = tuple(SlotSpec(routed_slot_name(layer, t), SlotKind.ROUTED, cfg.num_kv_heads)
                   for layer in spec.layers for t in range(1, spec.steps + 1) if ratios[t - 1] > 0)
    base = cfg.num_layers * layer_weight_flops(cfg)
    per_step = expected_step_flops(cfg, spec, ratios)
    steps = depth.get("thinking_steps")
    # A range of thinking steps (section 6): each step's tokens run the first `level` steps of the
    # ratios; the routed slots are priced at the maximum, as every routed slot is.
    elastic = steps if isinstance(steps, DepthRange) and steps.minimum < steps.maximum else None
    level = steps.maximum if isinstance(steps, DepthRange) else spec.steps if steps is None else steps
    work = tuple((base + sum(per_step[:level])) / base for level in range(spec.steps + 1)) if elastic else ()
    default = base + sum(expected_step_flops(cfg, spec, tuple(spec.trained_ratios)))
    return ITTPlan(depth=depth, layout=CacheLayout(dense_slots(cfg), routed), flops_per_token=base + sum(per_step),
                   plain_flops_per_token=default, ratios=ratios, thresholds=thresholds, elastic=elastic, level=level,
                   level_work=work)


def expected_step_flops(cfg: LlamaConfig, spec: ITTSpec, ratios: tuple[float, ...]) -> list[float]:
    """Per token, each step's weight FLOPs: the router on every token plus f_t on the selected share
    (about rho_t: the thresholds are the calibrated scores' quantiles); 0 for a step that is off."""
    return [len(spec.layers) * (2 * cfg.hidden_size + r * layer_weight_flops(cfg)) if r > 0 else 0.0 for r in ratios]


def step_flops(cfg: LlamaConfig, selected: float, tokens: int) -> float:
    """One ITT layer's step t over `tokens` positions: f_t on the `selected` ones (the j-th selected
    attends to j keys) plus the router on every position."""
    return (selected * layer_weight_flops(cfg) + attention_flops(cfg.num_heads, cfg.head_dim, selected * (selected + 1) / 2)
            + tokens * 2 * cfg.hidden_size)


def default_flops(cfg: LlamaConfig, spec: ITTSpec, tokens: int, generated: int) -> float:
    """The same tokens at the default settings (every trained step at its trained ratio). Which tokens
    the routers select depends on the tokens, so each step is counted at its expected share: rho_t of them."""
    steps = sum(step_flops(cfg, ratio * tokens, tokens) for ratio in spec.trained_ratios if ratio > 0)
    return plain_flops(cfg, tokens, generated) + len(spec.layers) * steps


def ran_the_defaults(spec: ITTSpec, plan: ITTPlan, levels: list[int] | None) -> bool:
    """Whether every position ran every trained step at its trained ratio."""
    if tuple(plan.ratios) != tuple(spec.trained_ratios):
        return False
    return plan.elastic is None or (levels is not None and all(level == spec.steps for level in levels))


# ---- the decisions of one sequence, and the report -----------------------------------------------------
class ITTRecord:
    """Per-position routing decisions of one sequence: 1 selected, 0 skipped, -1 off / unknown."""

    def __init__(self, num_layers: int, steps: int):
        self.selected = np.full((64, num_layers, steps), -1, dtype=np.int8)
        self.scores = np.zeros((64, num_layers, steps), dtype=np.float32)

    def write(self, start: int, selected: np.ndarray, scores: np.ndarray) -> None:
        """Decisions [n, layers, steps] for positions start..start+n."""
        end = start + len(selected)
        if end > len(self.selected):
            grow = max(end, 2 * len(self.selected))
            self.selected = np.concatenate([self.selected, np.full((grow - len(self.selected),) + self.selected.shape[1:],
                                                                   -1, np.int8)])
            self.scores = np.concatenate([self.scores, np.zeros((grow - len(self.scores),) + self.scores.shape[1:],
                                                                np.float32)])
        self.selected[start:end] = selected
        self.scores[start:end] = scores


def report(cfg: LlamaConfig, spec: ITTSpec, plan: ITTPlan, record: ITTRecord, tokens: int, prompt_tokens: int,
           generated: int, levels: list[int] | None = None) -> DepthReport:
    """`levels`: with a range of thinking steps, the steps each computed position had on."""
    prompt = min(prompt_tokens, tokens)
    selected, prompt_frac, decode_frac, decisions = {}, {}, {}, {}
    samples = []
    extra = 0.0
    for position, layer in enumerate(spec.layers):
        for t in range(1, spec.steps + 1):
            if plan.ratios[t - 1] <= 0:
                continue  # step off: no routing, no update, nothing to report
            key = f"{layer}:{t}"
            flags = record.selected[:tokens, position, t - 1]
            decisions[(layer, t)] = flags.copy()
            chosen = flags == 1
            n = int(chosen.sum())
            selected[key] = n
            samples.append(DepthCounter("selected_tokens", n, (("layer", str(layer)), ("step", str(t)))))
            prompt_frac[key] = float(chosen[:prompt].mean()) if prompt else None
            decode_frac[key] = float(chosen[prompt:].mean()) if tokens > prompt else None
            extra += step_flops(cfg, n, tokens)
    base = plain_flops(cfg, tokens, generated)
    computed = list(levels[:tokens]) if levels is not None else None
    # A request that ran the defaults is its own reference (exactly 1); any other is compared with the
    # defaults' expected selections.
    default = base + extra if ran_the_defaults(spec, plan, computed) else default_flops(cfg, spec, tokens, generated)
    settings: dict = {"selection_ratios": list(plan.ratios)}
    per_token = None
    if plan.elastic is not None and levels is not None:
        per_token = list(levels[:tokens])
        settings["thinking_steps"] = plan.elastic.as_json()
        settings["mean_depth"] = round(float(np.mean(per_token)), 4) if per_token else 0.0
    return DepthReport(
        architecture="itt",
        tokens=tokens,
        flops=base + extra,
        plain_flops=default,
        settings=settings,
        per_token=per_token,  # with a range of thinking steps: the steps each position had on
        counters={"selected_tokens": selected},  # "layer:step" -> tokens selected (enabled steps only)
        counter_samples=tuple(samples),
        fractions={"prompt_selected_fraction": prompt_frac, "decode_selected_fraction": decode_frac},
        decisions=decisions,  # (layer, step) -> per-position 1 / 0 / -1 over the computed tokens
    )
