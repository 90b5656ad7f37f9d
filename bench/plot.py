"""Charts of the benchmark results: every bench/results/*.json to a PNG in bench/results/plots/.

    python bench/plot.py                      # all result kinds found
    python bench/plot.py --quick              # the smoke runs of `make bench`: bench/results/quick/plots/
    python bench/plot.py --results-dir DIR --out-dir DIR

    throughput-*.json   decode and prefill tokens/s against concurrency, engine vs transformers,
                        and the decode tokens/s that the engine's weight matmuls alone would allow
    kernels-*.json      the paged decode attention's bandwidth (each variant, the torch fallback, SDPA)
                        as a share of the device's copy rate, per head shape
    serving-*.json      TTFT and TPOT percentiles and token throughput against request rate
    depth-sweep-*.json  decode step time against the depth setting, with the step time the
                        setting's predicted compute implies and that compute itself on one chart
    step-breakdown-*.json  a decode step's time by part (weight matmuls, paged attention, the
                        architecture's depth mechanism, the rest) for each setting, as stacked bars
    depth-quality-*.json   the demo models' held-out accuracy against the compute of each depth
                        setting, one line per model and knob
    depth-elastic-*.json   p99 TPOT, goodput and mean depth against load, the fixed and the slo
                        depth policy
A result kind with no files is skipped with a note.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=None,
                   help=f"default: {common.RESULTS_DIR} (with --quick: {common.QUICK_RESULTS_DIR})")
    p.add_argument("--out-dir", type=Path, default=None, help="default: <results-dir>/plots")
    p.add_argument("--quick", action="store_true", help="chart the smoke runs (make bench) instead of the committed results")
    ns = p.parse_args(argv)
    if ns.results_dir is None:
        ns.results_dir = common.QUICK_RESULTS_DIR if ns.quick else common.RESULTS_DIR
    return ns


def machine_line(payload: dict[str, Any]) -> str:
    env = payload.get("environment", {})
    versions = env.get("versions", {})
    return f"{env.get('machine', '?')}, torch {versions.get('torch', '?')}, {env.get('torch_threads', '?')} threads"


def figures(rows: list[dict[str, Any]], key: str) -> list[float]:
    """One figure per row; a missing (None) figure becomes NaN, a gap in the line."""
    return [float("nan") if row.get(key) is None else row[key] for row in rows]


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- throughput ---------------------------------------------------------------------------------
def plot_throughput(payload: dict[str, Any], out: Path) -> list[Path]:
    rows = payload["rows"]
    settings = payload["settings"]
    x = [row["concurrency"] for row in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, phase in zip(axes, ("decode", "prefill")):
        if any(row.get(f"engine_{phase}_tok_s") is not None for row in rows):  # not timed with --no-eager
            ax.plot(x, figures(rows, f"engine_{phase}_tok_s"), "o-", label="depthserve engine (eager)")
        others = (("compiled", "o-", "depthserve engine (compiled decode)"),
                  ("compiled_1step", "o:", "depthserve engine (compiled, one decode step per engine step)"),
                  ("hf", "s--", "transformers"),
                  ("hf_compiled", "s:", "transformers, static cache compiled"),
                  ("anchor", "^--", "plain static-cache decoder, compiled (anchor)"))
        for key, style, label in others:
            if all(f"{key}_{phase}_tok_s" in row for row in rows):
                ax.plot(x, figures(rows, f"{key}_{phase}_tok_s"), style, label=label)
        if phase == "decode" and all("engine_decode_matmul_ms_per_step" in row for row in rows):
            ceiling = [1000 * row["concurrency"] / row["engine_decode_matmul_ms_per_step"] for row in rows]
            ax.plot(x, ceiling, ":", color="gray", label="engine's weight matmuls alone")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.set_xlabel("concurrency (sequences per batch)")
        ax.set_ylabel(f"{phase} throughput (tokens/s)")
        ax.set_title(f"{phase.capitalize()} throughput vs concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{settings['model']}, input {settings['input_len']} / output {settings['output_len']} tokens, "
                 f"{payload['engine']['device']} {payload['engine']['dtype']}\n{machine_line(payload)}", fontsize=9)
    return [save(fig, out)]


# ---- kernels -------------------------------------------------------------------------------------
def plot_kernels(payload: dict[str, Any], out: Path) -> list[Path]:
    """Each decode-attention implementation's bandwidth as a share of the device's copy rate, per shape."""
    shapes = payload["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 6), sharey=True, squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [row for row in shape["rows"] if row.get("share_of_copy_rate") is not None]
        names = [row["name"].replace("triton ", "") for row in rows]
        colors = ["tab:orange" if row["name"] == "triton (default)" else "tab:gray" if "triton" not in row["name"]
                  else "tab:blue" for row in rows]
        ax.barh(range(len(rows)), [100 * row["share_of_copy_rate"] for row in rows], color=colors)
        ax.set_yticks(range(len(rows)), names, fontsize=7)
        ax.axvline(70, color="red", linestyle=":", label="target 70%")
        ax.set_xlabel("% of the device copy rate")
        ax.set_title(f"q/kv heads, head dim {shape['shape']}", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    settings = payload["settings"]
    fig.suptitle(f"Paged decode attention, batch {settings['batch']}, context {settings['context']}, "
                 f"{settings['dtype']}\n{machine_line(payload)}", fontsize=9)
    return [save(fig, out)]


# ---- serving ------------------------------------------------------------------------------------
def rate_positions(rates: list[Any]) -> tuple[list[float], list[str]]:
    """x positions and tick labels of request rates, 'inf' placed one step past the largest rate."""
    finite = [float(r) for r in rates if r != "inf"]
    beyond = max(finite) * 2 if finite else 1.0
    positions = [beyond if r == "inf" else float(r) for r in rates]
    labels = ["inf" if r == "inf" else f"{float(r):g}" for r in rates]
    return positions, labels


def plot_serving(payload: dict[str, Any], out: Path) -> list[Path]:
    runs = sorted(payload["runs"], key=lambda run: float(run["request_rate"]))
    x, labels = rate_positions([run["request_rate"] for run in runs])
    settings = payload["settings"]
    percentiles = ["median"] + [f"p{p}" for p in settings.get("percentiles", "90,99").split(",") if p.strip() not in ("50",)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for stat in percentiles:
            ax.plot(x, figures([run["summary"][metric] for run in runs], stat), "o-", label=stat)
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} percentiles vs request rate")
    ax = axes[2]
    ax.plot(x, [run["summary"]["output_token_throughput"] for run in runs], "o-", label="output tokens/s")
    ax.plot(x, [run["summary"]["total_token_throughput"] for run in runs], "s--", label="input + output tokens/s")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title("Token throughput vs request rate")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, labels)
        ax.minorticks_off()
        ax.set_xlabel("request rate (requests/s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    depth = f", depth {settings['depth']}" if settings.get("depth") else ""
    concurrency = f", max concurrency {settings['max_concurrency']}" if settings.get("max_concurrency") else ""
    fig.suptitle(f"Serving {payload['server']['model_id']}: {settings['num_prompts']} requests per rate, input "
                 f"{settings['input_len']} / output {settings['output_len']} tokens, {settings['arrival']} arrivals"
                 f"{concurrency}{depth}\n{machine_line(payload)}", fontsize=9)
    return [save(fig, out)]


# ---- depth sweep --------------------------------------------------------------------------------
_LAYOUT_LINES = {
    "sgt": lambda b: (f"SGT loops on layers {b['looped_layers']}, heads {b['head_sets']}, "
                      f"trained loops {b['loop_counts']}"),
    "itt": lambda b: f"ITT on {len(b['layers'])} layers, T={b['steps']} steps, trained ratios {b['trained_ratios']}",
    "dreamer": lambda b: (f"Dreamer, trained depth {b['depth']}, {b['num_experts']} experts top-{b['top_k']}, "
                          f"depth attention d={b['da_dim']}"),
    "put": lambda b: (f"PUT, {b['n_prefix']} prefix + {b['n_core']} core x T={b['T']} + {b['n_suffix']} "
                      f"suffix layers, conv kernel {b['conv_kernel']}"),
}


def depth_layout(spec: dict[str, Any]) -> str:
    """A one-line description of a checkpoint's depth section."""
    arch = spec.get("architecture", "?")
    return _LAYOUT_LINES[arch](spec[arch]) if arch in _LAYOUT_LINES else arch


def plot_depth_sweep(payload: dict[str, Any], out: Path) -> list[Path]:
    written = []
    for sweep in payload["sweeps"]:
        fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
        plot_step_times(left, sweep["rows"])
        plot_extra_shares(right, sweep["rows"])
        fig.suptitle(f"{sweep['arch'].upper()} decode cost vs depth setting ({sweep['device']} {sweep['dtype']}): "
                     f"{depth_layout(sweep.get('depth_spec', {}))}\n{machine_line(payload)}", fontsize=9)
        written.append(save(fig, out.with_name(f"{out.stem}-{sweep['arch']}.png")))
    return written


def plot_step_times(ax, rows: list[dict[str, Any]]) -> None:
    """Measured step time and the baseline step time scaled by predicted compute, on one axis."""
    baseline = next(row for row in rows if row["is_baseline"])
    base_ms = baseline["step_ms"]
    x = list(range(len(rows)))
    measured = [row["step_ms"] for row in rows]
    predicted = [base_ms * row["relative_compute"] / baseline["relative_compute"] for row in rows]
    ax.plot(x, measured, "o-", label="measured decode step time")
    ax.plot(x, predicted, "s--", label=f"predicted: {baseline['setting']} step time x relative compute")
    ax.set_xticks(x, [row["setting"] for row in rows], rotation=20)
    ax.set_xlabel("depth setting")
    ax.set_ylabel(f"decode step time, {baseline.get('concurrency', '?')} concurrent requests (ms)")
    ax.set_ylim(0, 1.3 * max(measured + predicted))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    # The right axis reads a point as a multiple of the baseline step (compute, for the predicted line).
    scale = ax.secondary_yaxis("right", functions=(lambda ms: ms / base_ms, lambda rel: rel * base_ms))
    scale.set_ylabel(f"x {baseline['setting']} step (relative compute)")
    ax.set_title("Decode step time vs depth setting")


def plot_extra_shares(ax, rows: list[dict[str, Any]]) -> None:
    """Extra step time as a % of the baseline step, next to the predicted extra compute %."""
    extra = [row for row in rows if not row["is_baseline"]]
    baseline = next(row for row in rows if row["is_baseline"])
    x = list(range(len(extra)))
    width = 0.38
    measured = [100 * (row["step_ms"] / baseline["step_ms"] - 1) for row in extra]
    predicted = [100 * (row["relative_compute"] / baseline["relative_compute"] - 1) for row in extra]
    ax.bar([i - width / 2 for i in x], measured, width, label="measured extra step time")
    ax.bar([i + width / 2 for i in x], predicted, width, label="predicted extra compute (relative compute / baseline's - 1)")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(x, [row["setting"] for row in extra], rotation=20)
    ax.set_xlabel("depth setting")
    ax.set_ylabel(f"extra over {baseline['setting']} (% of its step)")
    ax.set_title("Extra decode time vs predicted extra compute")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)


# ---- step breakdown -----------------------------------------------------------------------------
def plot_step_breakdown(payload: dict[str, Any], out: Path) -> list[Path]:
    rows = payload["rows"]
    parts = list(rows[0]["parts_ms"])
    fig, ax = plt.subplots(figsize=(8, 5))
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for part in parts:
        heights = [row["parts_ms"][part] for row in rows]
        ax.bar(x, heights, 0.6, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(x, [row["setting"] for row in rows])
    ax.set_xlabel("depth setting")
    ax.set_ylabel(f"decode step time, {rows[0].get('concurrency', '?')} concurrent requests (ms, median per part)")
    ax.set_title(f"Where a decode step's time goes ({payload['settings'].get('arch', '?')})\n{machine_line(payload)}",
                 fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return [save(fig, out)]


def plot_depth_quality(payload: dict[str, Any], out: Path) -> list[Path]:
    """Accuracy against compute, relative to each model's largest setting (the engine's depth
    reports measure each architecture against its own baseline, so raw figures do not share an
    axis). A model whose settings mix two knobs (ITT: thinking steps, then selection ratios at
    every step) gets a line per knob, both ending at the largest setting."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for model in payload["models"]:
        largest = model["rows"][-1]["relative_compute"]
        series: dict[str, list[dict[str, Any]]] = {}
        for row in model["rows"]:
            knob = next(iter(row["setting"]))
            series.setdefault(knob, []).append(row)
        for knob, rows in series.items():
            if rows[-1] is not model["rows"][-1]:
                rows = rows + [model["rows"][-1]]
            rows = sorted(rows, key=lambda row: row["relative_compute"])
            ax.plot([row["relative_compute"] / largest for row in rows], [100 * row["accuracy"] for row in rows],
                    marker="o", label=f"{model['model']} ({knob})")
    chance = [model["chance"] for model in payload["models"]]
    ax.axhline(100 * sum(chance) / len(chance), color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("compute per token, relative to the model's largest setting (engine's depth report)")
    ax.set_ylabel(f"held-out accuracy, {payload['settings']['problems']} problems (%)")
    ax.set_ylim(0, 100)
    ax.set_xlim(0, 1.05)
    ax.set_title(f"Demo depth models: held-out accuracy against compute (dotted: a guess among the prompt's "
                 f"digits)\n{machine_line(payload)}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return [save(fig, out)]


def plot_depth_elastic(payload: dict[str, Any], out: Path) -> list[Path]:
    """p99 TPOT, goodput and the depth run against the request rate, per depth policy of the run."""
    runs = sorted(payload["runs"], key=lambda row: float(row["request_rate"]))
    rates = [float(row["request_rate"]) for row in runs]
    target = payload["settings"]["tpot_slo_ms"]
    graded = "accuracy" in runs[0]["fixed"]["summary"]  # the demo task: answers checked
    fig, axes = plt.subplots(1, 4 if graded else 3, figsize=(20 if graded else 15, 4.5))
    policies = [key for key in runs[0] if key != "request_rate"]
    styles = ("s--", "o-", "^-", "D-", "v-")
    for policy, style in zip(policies, styles):
        summaries = [row[policy]["summary"] for row in runs]
        axes[0].plot(rates, [s["tpot_ms"]["p99"] for s in summaries], style, label=policy)
        axes[1].plot(rates, [s["goodput"] for s in summaries], style, label=policy)
        axes[2].plot(rates, [s.get("mean_output_depth") for s in summaries], style, label=f"{policy}, output tokens")
        axes[2].plot(rates, [s.get("mean_depth") for s in summaries], style, alpha=0.4, label=f"{policy}, all tokens")
        if graded:
            axes[3].plot(rates, [100 * s["accuracy"] for s in summaries], style, label=policy)
    axes[0].axhline(target, color="grey", linestyle=":", linewidth=1)
    axes[1].plot(rates, rates, ":", color="grey", linewidth=1, label="offered")
    sustained = (payload.get("comparison") or {}).get("fixed_sustained_rate")
    if sustained:  # the rate fixed sustains (90% of requests within the target) and twice it
        for rate, label in ((sustained, "fixed sustains"), (2 * sustained, "twice that")):
            axes[1].axvline(rate, color="tab:blue", linestyle=":", linewidth=1, alpha=0.6)
            axes[1].annotate(label, (rate, 0), textcoords="offset points", xytext=(3, 3), fontsize=7, rotation=90)
    panels = [(axes[0], f"p99 TPOT (dotted: the {target:g} ms target)", "ms"),
              (axes[1], f"goodput (requests/s with TPOT <= {target:g} ms)", "requests/s"),
              (axes[2], "mean depth run", "depth")]
    if graded:
        panels.append((axes[3], "held-out accuracy of the answers served", "%"))
    for ax, title, ylabel in panels:
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("offered load (requests/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    settings = payload["settings"]
    workload = ("held-out demo problems" if graded else f"input {settings['input_len']} tokens")
    fig.suptitle(f"Depth-elastic serving of {Path(payload['model_id']).name}: every request asks for depth "
                 f"{settings['depth']}, {settings['num_prompts']} requests per rate and policy, {workload} / "
                 f"output {settings['output_len']} tokens\n{machine_line(payload)}", fontsize=9)
    return [save(fig, out)]


def plot_depth_confidence(payload: dict[str, Any], out: Path) -> list[Path]:
    """Accuracy against relative compute per confidence threshold, and the depth of the answers."""
    rows, full = payload["rows"], payload["full_depth"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    compute = [r["relative_compute"] for r in rows]
    axes[0].plot(compute, [100 * r["accuracy"] for r in rows], "o-", label="confidence exit")
    for r in rows:
        axes[0].annotate(f"p={r['threshold']:g}", (r["relative_compute"], 100 * r["accuracy"]), fontsize=7,
                         textcoords="offset points", xytext=(4, -10))
    axes[0].plot([full["relative_compute"]], [100 * full["accuracy"]], "s", color="black", label="full depth")
    axes[0].set_xlabel("relative compute (engine report, readouts included)")
    axes[0].set_ylabel("held-out accuracy (%)")
    axes[0].set_title("accuracy against compute")
    thresholds = [str(r["threshold"]) for r in rows]
    axes[1].bar(thresholds, [r["mean_answer_depth"] for r in rows], label="the answer's position")
    axes[1].plot(thresholds, [r["mean_token_depth"] for r in rows], "o-", color="black", label="every token")
    axes[1].set_xlabel("confidence threshold (top-1 probability)")
    axes[1].set_ylabel("mean depth run")
    axes[1].set_title("depth run")
    for r in rows[:: max(1, len(rows) // 3)]:
        hops = sorted(r["answer_depth_by_hops"], key=int)
        axes[2].plot([int(h) for h in hops], [r["answer_depth_by_hops"][h] for h in hops], "o-",
                     label=f"p={r['threshold']:g}")
    axes[2].set_xlabel("hops the question needs")
    axes[2].set_ylabel("mean depth of the answer's position")
    axes[2].set_title("how long the model thinks, by question")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    settings = payload["settings"]
    knob = next(name for name in ("depth", "loops") if name in settings)
    fig.suptitle(f"Confidence exit on {settings['model']}: {settings['problems']} held-out problems, {knob} "
                 f"{settings[knob]}\n{machine_line(payload)}", fontsize=9)
    return [save(fig, out)]


# ---- looped models at their real widths (bench/{hrm_text,inkling2}_throughput.py) -------------------
def looped_setting(row: dict[str, Any]) -> str:
    """A row's loop setting as its x label: `loops`, or HRM-Text's h_cycles x l_cycles."""
    return str(row["loops"]) if "loops" in row else f"{row['h_cycles']}x{row['l_cycles']}"


def plot_looped_decode(payload: dict[str, Any], path: Path, model: str, setting_label: str) -> Path:
    """Decode tok/s per loop setting, one panel per batch size, each engine format against transformers."""
    results = {**{f"engine {k}": v for k, v in payload["results"]["engine"].items()},
               "transformers bf16": payload["results"]["transformers"]}
    batches = payload["setup"]["batches"]
    settings = list(dict.fromkeys(looped_setting(r) for r in payload["results"]["transformers"]["rows"]))
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for label, result in results.items():
            rows = {looped_setting(r): r for r in result["rows"] if r["batch"] == batch}
            ax.plot(settings, [rows[s]["tokens_per_second"] for s in settings], marker="o", label=label)
        ax.set_xlabel(setting_label)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{batch} sequence{'s' if batch > 1 else ''}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{model}, {payload['setup']['checkpoint']}\n{machine_line(payload)}", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save(fig, path)


PLOTTERS: dict[str, Callable[[dict[str, Any], Path], list[Path]]] = {
    "throughput": plot_throughput,
    "kernels": plot_kernels,
    "serving": plot_serving,
    "depth-sweep": plot_depth_sweep,
    "step-breakdown": plot_step_breakdown,
    "depth-quality": plot_depth_quality,
    "depth-elastic": plot_depth_elastic,
    "depth-confidence": plot_depth_confidence,
}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    out_dir = ns.out_dir or ns.results_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    for kind, plotter in PLOTTERS.items():
        results = common.load_results(kind, ns.results_dir)
        if not results:
            print(f"no {kind} results in {ns.results_dir}: skipped")
            continue
        for path, payload in results:
            try:
                for written in plotter(payload, out_dir / f"{path.stem}.png"):
                    print(f"wrote {written}")
            except (KeyError, ValueError, TypeError, StopIteration) as exc:
                print(f"{path.name}: not plotted ({type(exc).__name__}: {exc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
