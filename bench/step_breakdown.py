"""Where a decode step's time goes: weight matmuls, paged attention, each depth mechanism, the rest.

    python bench/step_breakdown.py --threads 2                    # ITT (the depth sweep's checkpoint)
    python bench/step_breakdown.py --threads 2 --arch dreamer     # or sgt, put
    python bench/step_breakdown.py --threads 2 --arch plain       # SmolLM2-135M-Instruct itself

The same batch as the depth sweep (`--concurrency` requests of `--input-len` random tokens, greedy,
EOS ignored, one engine per setting on the sweep's SmolLM2-shaped checkpoint, the settings' decode
steps timed in lockstep), with wall-clock timers around the parts of a step. A part's time is its
own: time spent in a part called from inside another is counted to the inner one only.
    weight matmuls    every linear layer (qkv, o, gate_up, down projections, the LM head)
    paged attention   storing the step's keys/values and attending over the paged cache
    ITT routing       router scores and threshold selection, the step update, the routed slots'
                      metadata, recording the decisions
    SGT loop metadata the loop slots' attention metadata (the loops' attention and projections
                      count as paged attention and weight matmuls)
    Dreamer experts   routers and the expert projections of self-attention and expert attention
    Dreamer depth attention  attention over each token's depth cache, with its projections
    Dreamer bookkeeping      the per-depth slots' metadata, recording the routing decisions
    PUT conv state    the depthwise convolution's taps and the per-sequence state it carries
    rest              everything else in the step: norms, rotary, residuals, row gathers,
                      sampling, scheduling, Python
Settings: the depth sweep's (SGT loops 0..max, Dreamer depth 1..D, PUT loops 1..T), and for ITT
thinking_steps=0 (the baseline) and every step at ratios 0.5 and 1.0. Every setting's parts are
given as extra time over the baseline's. For ITT, each part's extra time at the two ratios is also
fitted as fixed + per-selected-share (extra = F + V * s, s the decoded selected fraction): the fixed
part F is what does not shrink when fewer tokens are selected, and (a) of the part alone,
(extra(0.5) / s(0.5)) / (extra(1.0) / s(1.0)), is the depth sweep's figure (a) computed on that
part's time only.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import depth_sweep  # noqa: E402

ARCHS = ("plain",) + depth_sweep.ARCHS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="itt", choices=ARCHS)
    p.add_argument("--model", default=depth_sweep.LIKE, help="the plain model (--arch plain)")
    p.add_argument("--checkpoint-dir", type=Path, default=depth_sweep.DEFAULT_CHECKPOINT_DIR)
    p.add_argument("--checkpoint", default=None,
                   help="a checkpoint of --arch to use instead of the depth sweep's SmolLM2-shaped one")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=24, help="timed decode steps per setting")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="input 16, 4 timed steps")
    p.add_argument("--out", default=None, help="result name under bench/results (default: step-breakdown-<arch>-<device>)")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.input_len, ns.decode_steps = 16, 4
    # What depth_sweep's checkpoint, engine and settings helpers read: its checkpoint options, the CPU
    # path, and for ITT the ratios 0.5 and 1.0 only.
    for name, value in vars(depth_sweep.parse_args([])).items():
        if not hasattr(ns, name):
            setattr(ns, name, value)
    ns.dtype, ns.device, ns.ratios = "float32", "cpu", "0.5,1.0"
    return ns


# ---- timers -----------------------------------------------------------------------------------------
def part_targets(arch: str, kernels: list[Any]) -> dict[str, list[tuple[Any, str]]]:
    """(owner, attribute) of the callables that make up each timed part of `arch`'s step; the
    kernels are those of the engines timed (each engine binds its own, `engine.runner.kernels`)."""
    from depthserve.layers.batch import StepBatch

    def ops(*names: str) -> list[tuple[Any, str]]:
        return [(bound, name) for bound in kernels for name in names]

    from depthserve.layers.linear import CpuLinear

    targets: dict[str, list[tuple[Any, str]]] = {
        "weight matmuls": [(CpuLinear, "forward"), (torch.nn.Linear, "forward")],
        "paged attention": ops("store_kv", "paged_decode_attention", "paged_prefill_attention_varlen"),
    }
    if arch == "itt":
        from depthserve.kernels import itt
        from depthserve.layers.rows import GatheredRows

        targets["ITT routing"] = [(itt, "itt_select"), (itt, "itt_blend"), (StepBatch, "routed_meta"),
                                  (GatheredRows, "where"), (GatheredRows, "spread")]
    elif arch == "sgt":
        targets["SGT loop metadata"] = [(StepBatch, "level_meta")]
    elif arch == "dreamer":
        from depthserve.archs.dreamer import model as dreamer
        from depthserve.layers.rows import GatheredRows

        targets["Dreamer experts"] = [(dreamer.DepthRouter, "__call__"), (dreamer, "mix_experts"),
                                      (dreamer.ExpertAttention, "forward")]
        targets["Dreamer depth attention"] = [(dreamer.DepthAttention, "forward")]
        targets["Dreamer bookkeeping"] = [(StepBatch, "level_meta"), (GatheredRows, "emit")]
    elif arch == "put":
        from depthserve.archs.put.model import ConvState

        targets["PUT conv state"] = [(ConvState, "__init__"), (ConvState, "apply"), (ConvState, "write_back")]
    return targets


class PartClock:
    """Own (exclusive) wall time per part: a timed call inside another timed call is subtracted from
    the outer one, so nested parts (Dreamer's expert attention calls its router) count once."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []  # time of timed calls nested in each open call

    def wrap(self, fn: Callable, part: str) -> Callable:
        def call(*args, **kwargs):
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.totals[part] += elapsed - self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed

        return call


@contextlib.contextmanager
def timed_parts(targets: dict[str, list[tuple[Any, str]]], clock: PartClock) -> Iterator[None]:
    """Wrap every target with the clock; restore them on exit."""
    originals = [(owner, name, inspect.getattr_static(owner, name)) for owners in targets.values()
                 for owner, name in owners]
    for part, owners in targets.items():
        for owner, name in owners:
            setattr(owner, name, _wrapped(inspect.getattr_static(owner, name), part, clock))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _wrapped(attribute: Any, part: str, clock: PartClock) -> Any:
    """The clock's wrapper of a function, method or staticmethod, of the same kind."""
    if isinstance(attribute, staticmethod):
        return staticmethod(clock.wrap(attribute.__func__, part))
    return clock.wrap(attribute, part)


# ---- one run -------------------------------------------------------------------------------------------
def settings_for(arch: str, model, ns: argparse.Namespace) -> list[depth_sweep.Setting]:
    """The depth sweep's settings (for ITT: the baseline and ratios 0.5 and 1.0 only)."""
    if arch == "plain":
        return [depth_sweep.Setting("plain", {}, is_baseline=True)]
    return depth_sweep.depth_settings(arch, model, ns)


def model_path(ns: argparse.Namespace) -> str:
    if ns.checkpoint:
        return ns.checkpoint
    return ns.model if ns.arch == "plain" else str(depth_sweep.ensure_checkpoint(ns.arch, ns))


def run(ns: argparse.Namespace) -> list[dict[str, Any]]:
    path = model_path(ns)
    first = depth_sweep.engine_llm(path, ns)
    settings = settings_for(ns.arch, first.engine.model, ns)
    llms = [first] + [depth_sweep.engine_llm(path, ns) for _ in settings[1:]]
    prompts = common.random_prompts(ns.concurrency, ns.input_len, first.engine.vocab_size, ns.seed)
    runs = [depth_sweep.SettingRun(llm, setting, prompts, ns, lambda: None) for llm, setting in zip(llms, settings)]
    targets = part_targets(ns.arch, [llm.engine.runner.kernels for llm in llms])
    per_step: list[list[dict[str, float]]] = [[] for _ in runs]
    for step in range(ns.decode_steps):
        for k in range(len(runs)):
            index = (step + k) % len(runs)
            clock = PartClock()
            with timed_parts(targets, clock):
                runs[index].timed_step()
            per_step[index].append({part: 1000 * clock.totals[part] for part in targets})
    rows = []
    for setting_run, parts in zip(runs, per_step):
        row = setting_run.finish()
        row["parts_ms"] = {part: statistics.median(p[part] for p in parts) for part in targets}
        row["parts_ms"]["rest"] = statistics.median(
            1000 * total - sum(p.values()) for total, p in zip(setting_run.samples, parts))
        row["parts_ms_samples"] = parts
        rows.append(row)
    return rows


# ---- derived figures -------------------------------------------------------------------------------
def fixed_and_variable(extra_half: float, extra_full: float, s_half: float, s_full: float) -> tuple[float, float]:
    """extra = F + V * s through the two points: (F, V) in ms per step."""
    variable = (extra_full - extra_half) / (s_full - s_half)
    return extra_full - variable * s_full, variable


def part_extra(row: dict[str, Any], baseline: dict[str, Any], part: str) -> float:
    """A part's extra ms per step over the baseline ("step": the whole step's, paired by round)."""
    if part == "step":
        return depth_sweep.paired_extra_ms(row, baseline)
    return row["parts_ms"][part] - baseline["parts_ms"][part]


def extra_by_part(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """setting -> part -> extra ms per step over the baseline setting, for every other setting."""
    baseline = next(r for r in rows if r["is_baseline"])
    parts = list(baseline["parts_ms"]) + ["step"]
    return {r["setting"]: {part: part_extra(r, baseline, part) for part in parts} for r in rows if not r["is_baseline"]}


def itt_parts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per part: extra ms over the baseline at ratio 0.5 and 1.0, the fit F + V * s, and (a) of the part alone."""
    baseline = next(r for r in rows if r["is_baseline"])
    by_ratio = {r["knobs"]["selection_ratios"][0]: r for r in rows if "selection_ratios" in r["knobs"]}
    half, full = by_ratio[0.5], by_ratio[1.0]
    s_half, s_full = half["decode_selected_fraction_mean"], full["decode_selected_fraction_mean"]
    out: dict[str, Any] = {"selected_fraction": {"0.5": s_half, "1.0": s_full}, "parts": {}}
    for part in list(baseline["parts_ms"]) + ["step"]:
        e_half, e_full = part_extra(half, baseline, part), part_extra(full, baseline, part)
        fixed, variable = fixed_and_variable(e_half, e_full, s_half, s_full)
        out["parts"][part] = {
            "extra_ms": {"0.5": e_half, "1.0": e_full},
            "fixed_ms": fixed,
            "per_selected_share_ms": variable,
            "a_of_this_part": (e_half / s_half) / (e_full / s_full) if e_full > 0 and s_half > 0 else None,
        }
    return out


def format_rows(rows: list[dict[str, Any]]) -> list[str]:
    return [f"{r['setting']:<18} step {r['step_ms']:7.1f} ms: "
            + ", ".join(f"{part} {ms:.1f}" for part, ms in r["parts_ms"].items()) for r in rows]


def format_extra(extra: dict[str, dict[str, float]]) -> list[str]:
    return [f"{setting:<18} extra: " + ", ".join(f"{part} {ms:+.1f}" for part, ms in parts.items())
            for setting, parts in extra.items()]


def format_itt(derived: dict[str, Any]) -> list[str]:
    lines = []
    for part, d in derived["parts"].items():
        a = "-" if d["a_of_this_part"] is None else f"{d['a_of_this_part']:.2f}"
        lines.append(f"{part:<16} extra {d['extra_ms']['0.5']:6.1f} / {d['extra_ms']['1.0']:6.1f} ms at 0.5 / 1.0, "
                     f"fixed {d['fixed_ms']:6.1f} ms + {d['per_selected_share_ms']:6.1f} ms x selected share, (a) {a}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    rows = run(ns)
    for line in format_rows(rows):
        print(line, flush=True)
    payload: dict[str, Any] = {
        "benchmark": "step-breakdown",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
        "environment": common.environment(ns.device, ns.threads),
        "method": "wall-clock timers around the parts of each timed decode step; per part, the median over steps",
        "rows": rows,
    }
    if ns.arch != "plain":
        payload["extra_ms_by_part"] = extra_by_part(rows)
        for line in format_extra(payload["extra_ms_by_part"]):
            print(line)
    if ns.arch == "itt":
        payload["derived"] = itt_parts(rows)
        for line in format_itt(payload["derived"]):
            print(line)
    name = ns.out or f"step-breakdown-{ns.arch}-{common.device_slug(ns.device)}" + ("-quick" if ns.quick else "")
    print(f"wrote {common.write_result(name, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
