"""Depth sweep: decode step time of SGT, ITT, Dreamer and PUT checkpoints against their depth
knobs, next to the compute those settings predict.

    python bench/depth_sweep.py --quick                 # a fast smoke version (make bench)
    python bench/depth_sweep.py --threads 2             # the full sweep on CPU
    python bench/depth_sweep.py --device cuda --concurrency 32 --decode-steps 64
    python bench/depth_sweep.py --threads 2 --compiled --archs itt   # eager and compiled in one run

Checkpoints: random weights with SmolLM2-135M's shapes (`depthserve.lab.make_tiny.make_tiny(arch, dir,
like="smollm2-135m-instruct")`), built once into --checkpoint-dir and reused:
    SGT  trained loops=1 on heads 0,1 (one KV group) of 3 layers (10, 15, 20), loops knob 0..max_loops
    ITT  every other layer (1, 3, ..., 29) with T=3 extra steps, calibrated on synthetic streams
    Dreamer  one shared block, trained depth D=4 (32 experts, top-2; depth attention d=64), depth knob 1..D
    PUT  3 prefix, 8 core, 3 suffix layers, T=3 core passes, conv kernel 2, loops knob 1..T

Method: each depth setting gets its own engine on the same checkpoint, and `--concurrency`
requests of `--input-len` random tokens (greedy, EOS ignored, prefix caching off) that are stepped
until every request has its first token (prefill done), then `--warmup-steps` more steps. Then
the settings are timed in lockstep: `--decode-steps` times, one decode step of every engine in
turn (the order rotating), each step timed on its own, so a slow spell of a shared machine hits
every setting alike. Every request decodes one token per step, so a step's time is also each
request's per-token latency at this concurrency; a setting's step time is the median of its
timed steps. With --compiled every setting also runs on an engine whose decode steps are compiled
at static shapes (depthserve/engine/static_decode.py), in the same lockstep, and the derived
figures are given for each mode.
Predicted compute: the mean `relative_compute` of the requests' depth reports (FLOPs of the
setting / FLOPs of the plain model over the same tokens; depthserve/archs/llama/format.py).

Derived figures (extra-step time = the median over the lockstep rounds of a setting's step time
minus the same round's step time with the extra depth off, i.e. thinking_steps=0 for ITT, loops=0
for SGT, depth=1 for Dreamer, loops=1 for PUT, so a drift of the machine's speed during the run
cancels; predicted extra share = relative compute of the setting / that of the baseline - 1):
    ITT (a) extra time per selected token-step at ratio 0.5 / the same at ratio 1.0     goal <= 1.3
    ITT (b) extra time at ratio 1.0 / the time of as many plain layer passes          goal <= 1.3
            (a plain layer pass: the thinking_steps=0 step time / number of layers; also given with
            the LM head's FLOP share taken out first, which makes a layer pass cheaper and (b) larger)
    ITT (a) of the linear layers alone: the ITT layers' four weight matmuls timed on their own at the
            row counts ratio 0.5 and 1.0 select (a floor that the kernels set for (a))
    SGT, Dreamer, PUT  extra time as a share of the baseline step, next to the predicted extra share
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

LIKE = "smollm2-135m-instruct"
ARCHS = ("sgt", "itt", "dreamer", "put")
STEP_TOKEN_BUDGET = 1024  # max_num_batched_tokens
DEFAULT_CHECKPOINT_DIR = Path.home() / ".cache" / "depthserve" / "bench-checkpoints"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default=",".join(ARCHS), help="which checkpoints to sweep (of sgt, itt, dreamer, put)")
    p.add_argument("--checkpoint-dir", type=Path, default=DEFAULT_CHECKPOINT_DIR, help="where the checkpoints are built and kept")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=64, help="timed decode steps per setting")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps before them")
    p.add_argument("--loops", default=None, help="SGT loop counts (default 0..max_loops)")
    p.add_argument("--ratios", default="0,0.25,0.5,0.75,1.0", help="ITT selection ratios (every step the same)")
    p.add_argument("--sgt-layers", default="10,15,20")
    p.add_argument("--sgt-heads", type=int, default=2, help="heads 0..N-1 loop in every looped layer")
    p.add_argument("--sgt-loops", type=int, default=1, help="trained loop count")
    p.add_argument("--itt-steps", type=int, default=3)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="the engine's weight format (int4 with --dtype bfloat16: the CPU default's format)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="per engine (one engine per setting)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the checkpoints' tokenizer (default: the built-in SmolLM2's; a GPU host without its "
                        "package passes a saved copy, docs/gpu.md)")
    p.add_argument("--quick", action="store_true", help="input 16, 8 timed steps after 2 warm-up steps, ratios 0, 0.5, 1")
    p.add_argument("--out", default=None, help="result name under bench/results (default: depth-sweep-<device>)")
    p.add_argument("--compiled", action="store_true",
                   help="also run every setting with compiled static-shape decode steps, in the same lockstep")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.input_len, ns.decode_steps, ns.warmup_steps, ns.ratios = 16, 8, 2, "0,0.5,1.0"
    return ns


# ---- checkpoints ----------------------------------------------------------------------------------
def checkpoint_options(arch: str, ns: argparse.Namespace, num_layers: int) -> dict[str, Any]:
    """make_tiny keyword arguments of the benchmark's checkpoint (Dreamer and PUT: the --like layout)."""
    from depthserve.lab.make_tiny import every_other_layer

    if arch == "sgt":
        return {"layers": [int(x) for x in ns.sgt_layers.split(",")], "heads": ns.sgt_heads, "loops": ns.sgt_loops}
    if arch == "itt":
        return {"layers": every_other_layer(num_layers, "odd"), "steps": ns.itt_steps}
    return {}


def ensure_checkpoint(arch: str, ns: argparse.Namespace) -> Path:
    """The checkpoint directory, built with make_tiny unless one with the same options is there."""
    from depthserve.lab.make_tiny import make_tiny, num_layers_of, tokenizer_from

    options = checkpoint_options(arch, ns, num_layers_of(LIKE))
    identity = {"arch": arch, "like": LIKE, "seed": ns.seed, **options,
                **({"tokenizer": str(ns.tokenizer)} if ns.tokenizer else {})}
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]
    path = ns.checkpoint_dir / f"{arch}-like-{LIKE}-{digest}"
    marker = path / "bench-options.json"  # written last: a half-built checkpoint has none
    if marker.exists() and json.loads(marker.read_text()) == identity:
        return path
    print(f"building the {arch} checkpoint {identity} in {path} ...", flush=True)
    start = time.perf_counter()
    make_tiny(arch, path, seed=ns.seed, like=LIKE, tokenizer=tokenizer_from(ns.tokenizer) if ns.tokenizer else None,
              **options)
    marker.write_text(json.dumps(identity) + "\n")
    print(f"  built in {time.perf_counter() - start:.0f}s", flush=True)
    return path


# ---- one depth setting --------------------------------------------------------------------------
@dataclass
class Setting:
    name: str
    knobs: dict[str, Any]  # DepthParams fields
    is_baseline: bool = False  # the extra depth off


def sgt_settings(max_loops: int, loops: str | None) -> list[Setting]:
    counts = list(range(max_loops + 1)) if loops is None else [int(x) for x in loops.split(",")]
    counts = [0] + [k for k in counts if k != 0]  # loops=0, the baseline, first
    return [Setting(f"loops={k}", {"loops": k}, is_baseline=(k == 0)) for k in counts]


def range_settings(knob: str, minimum: int, maximum: int) -> list[Setting]:
    """Every value of an integer knob, its minimum (the baseline) first: Dreamer depth, PUT loops."""
    return [Setting(f"{knob}={k}", {knob: k}, is_baseline=(k == minimum)) for k in range(minimum, maximum + 1)]


def itt_settings(steps: int, ratios: str) -> list[Setting]:
    settings = [Setting("thinking_steps=0", {"thinking_steps": 0}, is_baseline=True)]
    for r in common.parse_number_list(ratios):
        settings.append(Setting(f"ratios={r:g}", {"selection_ratios": [r] * steps}))
    return settings


def max_new_tokens(ns: argparse.Namespace) -> int:
    """Tokens a request may generate: its first token comes up to one prefill phase after the first
    request's (chunked prefill under the step budget, the early requests decoding meanwhile), and
    every request must still be decoding through the warm-up and timed steps."""
    prefill_steps = -(-ns.concurrency * ns.input_len // (STEP_TOKEN_BUDGET - ns.concurrency)) + 1
    return prefill_steps + ns.warmup_steps + ns.decode_steps + 2


class SettingRun:
    """One depth setting's batch on its own engine: prefill, then decode steps timed one by one."""

    def __init__(self, llm, setting: Setting, prompts: list[list[int]], ns: argparse.Namespace, sync):
        from depthserve import DepthParams, SamplingParams

        self.engine, self.setting, self.sync = llm.engine, setting, sync
        self.ids = [f"{setting.name}-{i}" for i in range(len(prompts))]
        self.latest: dict[str, Any] = {}
        self.samples: list[float] = []
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens(ns), ignore_eos=True)
        for request_id, prompt in zip(self.ids, prompts):
            self.engine.add_request(request_id, prompt, params, DepthParams(**setting.knobs))
        self.preemptions_before = self.engine.stats()["num_preemptions"]
        start = time.perf_counter()
        while min(self._tokens()) < 1:
            self._step()
        self.prefill_s = time.perf_counter() - start
        for _ in range(ns.warmup_steps):
            self._step()

    def _step(self) -> None:
        for out in self.engine.step():
            self.latest[out.request_id] = out

    def _tokens(self) -> list[int]:
        return [len(self.latest[r].token_ids) if r in self.latest else 0 for r in self.ids]

    def timed_step(self) -> None:
        before = self._tokens()
        self.samples.append(common.timed(self._step, self.sync))
        if [b + 1 for b in before] != self._tokens():
            raise RuntimeError(f"{self.setting.name}: a timed step did not decode one token for every request")

    def finish(self) -> dict[str, Any]:
        """Abort the batch (the abort's output carries each request's depth report); the setting's row."""
        for request_id in self.ids:
            aborted = self.engine.abort_request(request_id)
            if aborted is not None:
                self.latest[request_id] = aborted
        reports = [self.latest[r].depth.to_dict() if self.latest[r].depth else {} for r in self.ids]
        step_ms = 1000 * statistics.median(self.samples)
        row = {
            "setting": self.setting.name,
            "knobs": self.setting.knobs,
            "is_baseline": self.setting.is_baseline,
            "concurrency": len(self.ids),
            "step_ms": step_ms,
            "per_token_latency_ms": step_ms,
            "decode_tok_s": len(self.ids) / (step_ms / 1000),
            "step_ms_samples": [1000 * x for x in self.samples],
            "prefill_s": self.prefill_s,
            "preemptions": self.engine.stats()["num_preemptions"] - self.preemptions_before,
            "relative_compute": statistics.fmean(r.get("relative_compute", 1.0) for r in reports),
        }
        if reports and reports[0].get("architecture") == "itt":
            row.update(itt_selection(reports))
        return row


def itt_selection(reports: list[dict]) -> dict[str, Any]:
    """Decode-time routing of the batch: the mean selected fraction per (layer, step) and the
    selected token-steps per decode step (summed over requests, layers and steps)."""
    keys = sorted({k for r in reports for k in (r.get("decode_selected_fraction") or {})})
    per_key = {}
    for key in keys:
        values = [r["decode_selected_fraction"][key] for r in reports
                  if r["decode_selected_fraction"].get(key) is not None]
        per_key[key] = statistics.fmean(values) if values else 0.0
    return {
        "decode_selected_fraction_mean": statistics.fmean(per_key.values()) if per_key else 0.0,
        "selected_token_steps_per_decode_step": len(reports) * sum(per_key.values()),
        "decode_selected_fraction": per_key,
    }


# ---- one checkpoint -----------------------------------------------------------------------------
def engine_llm(path: Path | str, ns: argparse.Namespace, enforce_eager: bool | None = True):
    """An engine for one setting's batch: prefix caching off, the sweep's step budget, room for every
    request's tokens; eager unless `enforce_eager` is False (compiled static-shape decode steps)."""
    from depthserve import LLM

    return LLM(str(path), dtype=ns.dtype, device=ns.device, num_threads=ns.threads, max_num_seqs=ns.concurrency,
               enable_prefix_caching=False, kv_cache_memory_gib=ns.kv_cache_memory_gib,
               max_num_batched_tokens=STEP_TOKEN_BUDGET, max_model_len=ns.input_len + max_new_tokens(ns) + 16,
               load_progress=False, enforce_eager=enforce_eager, quantization=ns.quantization)


def depth_settings(arch: str, model, ns: argparse.Namespace) -> list[Setting]:
    """The settings swept for `arch`, the baseline first: SGT `--loops`, ITT `--ratios`, and every
    value of Dreamer's and PUT's integer knob."""
    if arch == "sgt":
        return sgt_settings(int(model.depth_knobs()["loops"].maximum), ns.loops)
    if arch == "itt":
        return itt_settings(model.spec.steps, ns.ratios)
    (name, knob), = model.depth_knobs().items()
    return range_settings(name, int(knob.minimum), int(knob.maximum))


def sweep_checkpoint(arch: str, ns: argparse.Namespace) -> dict[str, Any]:
    path = ensure_checkpoint(arch, ns)
    first = engine_llm(path, ns)
    engine, model = first.engine, first.engine.model
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    settings = depth_settings(arch, model, ns)
    prompts = common.random_prompts(ns.concurrency, ns.input_len, engine.vocab_size, ns.seed)
    warm = SettingRun(first, settings[0], prompts, ns, sync)  # warm-up (allocations, kernel choice)
    warm.timed_step()
    warm.finish()
    # Lockstep: one engine per setting (and mode), all prefilled, then their timed decode steps taken
    # in turn (the order rotating every step), so a slow spell of the machine hits every setting alike.
    modes = ("eager", "compiled") if ns.compiled else ("eager",)
    runs = {mode: [SettingRun(first if (i, mode) == (0, "eager") else engine_llm(path, ns, mode == "eager"),
                              setting, prompts, ns, sync) for i, setting in enumerate(settings)]
            for mode in modes}
    every = [run for mode in modes for run in runs[mode]]
    for step in range(ns.decode_steps):
        for k in range(len(every)):
            every[(step + k) % len(every)].timed_step()
    rows = {mode: [run.finish() for run in runs[mode]] for mode in modes}
    cfg = model.config
    derived = {}
    for mode in modes:
        for row in rows[mode]:
            print(f"{mode:>8} " + format_row(arch, row), flush=True)
        derived[mode] = derive(arch, rows[mode], cfg, model, ns.concurrency)
    if arch == "itt":
        derived["eager"]["linear_layers_only"] = itt_linear_floor(model, rows["eager"], ns, sync)
    compiled = {"rows_compiled": rows["compiled"], "derived_compiled": derived["compiled"]} if ns.compiled else {}
    return {
        "arch": arch,
        "checkpoint": str(path),
        "depth_spec": json.loads((path / "config.json").read_text())["depth"],
        "num_layers": getattr(cfg, "num_layers", None),
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "quantization": engine.quantization.summary(),
        "method": "lockstep: one engine per setting, timed decode steps of all settings taken in turn",
        "rows": rows["eager"],
        "derived": derived["eager"],
        **compiled,
    }


def format_row(arch: str, row: dict) -> str:
    text = (f"{arch} {row['setting']:<18} step {row['step_ms']:8.1f} ms  ({row['decode_tok_s']:7.1f} tok/s)  "
            f"predicted compute x{row['relative_compute']:.3f}")
    if "decode_selected_fraction_mean" in row:
        text += f"  selected {row['decode_selected_fraction_mean']:.2f}"
    return text


# ---- derived figures ----------------------------------------------------------------------------
def layer_flop_share(cfg) -> float:
    """Share of a plain decode token's weight FLOPs spent in the decoder layers (the rest: LM head)."""
    from depthserve.archs.llama.format import layer_weight_flops

    layers = cfg.num_layers * layer_weight_flops(cfg)
    return layers / (layers + 2 * cfg.hidden_size * cfg.vocab_size)


def paired_extra_ms(row: dict, baseline: dict) -> float:
    """Median over the lockstep rounds of (this setting's step - the baseline's step in the same
    round): a drift of the machine's speed during the run moves both steps of a round alike and
    cancels, where the difference of two medians taken over the whole run keeps it. Falls back to
    the difference of the medians for rows without per-step samples."""
    ours, theirs = row.get("step_ms_samples"), baseline.get("step_ms_samples")
    if not ours or not theirs or len(ours) != len(theirs):
        return row["step_ms"] - baseline["step_ms"]
    return statistics.median(a - b for a, b in zip(ours, theirs))


def derive(arch: str, rows: list[dict], cfg, model, concurrency: int) -> dict[str, Any]:
    baseline = next(r for r in rows if r["is_baseline"])
    for row in rows:
        row["extra_step_ms"] = paired_extra_ms(row, baseline)
        row["measured_extra_share"] = row["extra_step_ms"] / baseline["step_ms"]
        row["predicted_extra_share"] = row["relative_compute"] / baseline["relative_compute"] - 1.0
    if arch != "itt":
        return {
            "baseline": baseline["setting"],
            "extra_share_measured_vs_predicted": {
                r["setting"]: {"measured": r["measured_extra_share"], "predicted": r["predicted_extra_share"]}
                for r in rows if not r["is_baseline"]},
        }
    return derive_itt(rows, baseline, cfg, len(model.spec.layers) * model.spec.steps, concurrency)


def derive_itt(rows: list[dict], baseline: dict, cfg, layer_steps: int, concurrency: int) -> dict[str, Any]:
    by_ratio = {r["knobs"]["selection_ratios"][0]: r for r in rows if "selection_ratios" in r["knobs"]}
    for row in by_ratio.values():
        selected = row["selected_token_steps_per_decode_step"]
        row["extra_ms_per_selected_token_step"] = row["extra_step_ms"] / selected if selected else None
    out: dict[str, Any] = {
        "baseline": baseline["setting"],
        "method": ("extra-step time = median over the lockstep rounds of (step time - the thinking_steps=0 "
                   "step time of the same round). (a): extra ms per selected "
                   "(token, layer, step) at ratio 0.5 over the same at ratio 1.0. (b): extra ms at ratio 1.0 over "
                   "(selected token-steps per decode step / concurrency) plain layer passes, a plain layer pass "
                   "being the thinking_steps=0 step time / num_layers (the issue's method; it spreads the LM head "
                   "and sampling over the layers) or, in the *_flop_adjusted figure, that step time times the "
                   "layers' share of the plain FLOPs / num_layers."),
        "goal": "<= 1.3 for (a) and (b)",
        "itt_layer_steps": layer_steps,
    }
    half, full = by_ratio.get(0.5), by_ratio.get(1.0)
    if half and full and half["extra_ms_per_selected_token_step"] and full["extra_ms_per_selected_token_step"]:
        out["a_per_selected_ratio_0.5_vs_1.0"] = (half["extra_ms_per_selected_token_step"]
                                                  / full["extra_ms_per_selected_token_step"])
    if full:
        layer_pass_ms = baseline["step_ms"] / cfg.num_layers
        layer_pass_ms_adjusted = layer_pass_ms * layer_flop_share(cfg)
        passes = full["selected_token_steps_per_decode_step"] / concurrency  # layer passes over the whole batch
        out.update({
            "plain_layer_pass_ms": layer_pass_ms,
            "plain_layer_pass_ms_flop_adjusted": layer_pass_ms_adjusted,
            "layer_flop_share": layer_flop_share(cfg),
            "plain_layer_passes_at_ratio_1.0": passes,
            "b_extra_at_1.0_vs_plain_layer_passes": full["extra_step_ms"] / (passes * layer_pass_ms),
            "b_extra_at_1.0_vs_plain_layer_passes_flop_adjusted": full["extra_step_ms"] / (passes * layer_pass_ms_adjusted),
        })
    return out


def itt_linear_floor(model, rows: list[dict], ns: argparse.Namespace, sync,
                     matmuls_ms: Callable[[Any, int, Callable[[], None]], float] | None = None) -> dict[str, Any]:
    """(a) of the ITT layers' weight matmuls alone: their time on the rows that ratio 0.5 and
    ratio 1.0 select per pass, timed in turn like the sweep's steps. Every thinking pass runs
    a layer's qkv, o, gate_up and down projections on its selected rows; if these alone cost more
    than 1.3x per row at 0.5 than at 1.0, no bookkeeping change can meet (a) with these kernels."""
    by_ratio = {r["knobs"]["selection_ratios"][0]: r for r in rows if "selection_ratios" in r["knobs"]}
    if 0.5 not in by_ratio or 1.0 not in by_ratio:
        return {}
    counts = {ratio: max(1, round(ns.concurrency * by_ratio[ratio]["decode_selected_fraction_mean"]))
              for ratio in (0.5, 1.0)}
    samples: dict[float, list[float]] = {ratio: [] for ratio in counts}
    for round_ in range(ns.decode_steps):
        for ratio in (list(counts) if round_ % 2 == 0 else list(counts)[::-1]):
            samples[ratio].append((matmuls_ms or thinking_matmuls_ms)(model, counts[ratio], sync))
    ms = {ratio: statistics.median(values) for ratio, values in samples.items()}
    return {
        "method": ("the ITT layers' qkv, o, gate_up and down projections run model.spec.steps times each on "
                   "random rows, as many as the sweep's mean selection at ratio 0.5 and 1.0; median of "
                   "--decode-steps rounds, the two row counts timed in turn"),
        "rows": {str(r): n for r, n in counts.items()},
        "ms": {str(r): t for r, t in ms.items()},
        "a_linear_layers_only": (ms[0.5] / counts[0.5]) / (ms[1.0] / counts[1.0]),
    }


def thinking_matmuls_ms(model, num_rows: int, sync) -> float:
    """The ITT layers' weight matmuls of every thinking pass on `num_rows` rows."""
    return common.layer_matmuls_ms(model, model.itt_layers(), num_rows, model.spec.steps, sync)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    archs = [a.strip() for a in ns.archs.split(",") if a.strip()]
    if not archs or not set(archs) <= set(ARCHS):
        raise SystemExit(f"--archs takes some of {', '.join(ARCHS)}, got {ns.archs!r}")
    sweeps = [sweep_checkpoint(arch, ns) for arch in archs]
    device = sweeps[0]["device"]
    payload = {
        "benchmark": "depth-sweep",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
        "environment": common.environment(device, ns.threads),
        "sweeps": sweeps,
    }
    name = ns.out or f"depth-sweep-{common.device_slug(device)}" + ("-quick" if ns.quick else "")
    print(f"wrote {common.write_result(name, payload)}")
    for sweep in sweeps:
        print(format_derived(sweep))
        if "derived_compiled" in sweep:
            print("compiled: " + format_derived(sweep, sweep["derived_compiled"]))
    return 0


def format_derived(sweep: dict[str, Any], derived: dict[str, Any] | None = None) -> str:
    derived = sweep["derived"] if derived is None else derived
    if sweep["arch"] != "itt":
        parts = [f"{name}: measured {v['measured']:+.3f} vs predicted {v['predicted']:+.3f}"
                 for name, v in derived["extra_share_measured_vs_predicted"].items()]
        return f"{sweep['arch']} extra time / {derived['baseline']} step: " + "; ".join(parts)
    figures = {key: derived[key] for key in ("a_per_selected_ratio_0.5_vs_1.0", "b_extra_at_1.0_vs_plain_layer_passes",
                                             "b_extra_at_1.0_vs_plain_layer_passes_flop_adjusted") if key in derived}
    floor = derived.get("linear_layers_only", {}).get("a_linear_layers_only")
    if floor is not None:
        figures["a_linear_layers_only"] = floor
    return "itt (goal <= 1.3): " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())


if __name__ == "__main__":
    sys.exit(main())
