"""Where a decode step's time goes: the engine's decode (compiled on CUDA, eager on CPU, as the engine
runs by default) against the anchor's, under torch.profiler.

    python bench/profile_decode.py --model DIR --device cuda --dtype bfloat16 --batch-sizes 1,64
    python bench/profile_decode.py --threads 2 --batch-sizes 1,32   # the CPU default (no anchor there)
    python bench/profile_decode.py --quick                      # CPU smoke run

Method: the throughput benchmark's (bench/throughput.py). For each system and concurrency,
`concurrency` prompts of `--input-len` random tokens are generated greedily with EOS ignored, once as
a warm-up, then under the profiler once with 1 new token and once with `output_len + 1`; every
figure is the difference of the two runs divided by `output_len`, so prefill drops out. Per decode
step: wall time (inflated by the profiler's own cost, so read it against the other system's, not
against bench/throughput.py), device kernels run and their summed time, the host's launch calls
(kernel launches and CUDA graph launches), the share of the wall time the device spent running
kernels (the union of the kernels' intervals), and the kernels that took most of it. On CPU there
are no device kernels: the figures are the operators run per step (torch's `aten::` and the native
kernels' `depthserve_cpu::`, an operator's own time not counting the operators it calls), their
summed own time (the rest of the wall time is Python and the engine's bookkeeping), and the top ones
by their own time. Under "prefill", the same figures for the short generation as a whole: the
prompts' prefill steps (eager in every engine mode) and the one token they sample.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from throughput import AnchorRunner, EngineRunner  # noqa: E402

TOP_KERNELS = 15
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
GRAPH_LAUNCH_CALLS = ("cudaGraphLaunch", "cuGraphLaunch")
CPU_OP_NAMESPACES = ("aten::", "depthserve_cpu::")  # torch's ops and the native CPU kernels (kernels/csrc)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "int8", "int4"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-anchor", action="store_true", help="profile the engine only (always so on CPU)")
    p.add_argument("--eager", action="store_true",
                   help="the eager engine instead of the compiled one (the engine's default on CPU: eager there "
                        "unless --compiled)")
    p.add_argument("--compiled", action="store_true", help="on CPU, the compiled engine instead of the eager default")
    p.add_argument("--scheduler-steps", type=int, default=None,
                   help="the engine's num_scheduler_steps (default: the engine's, 8 with CUDA graphs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="concurrency 1, input 16, output 4")
    p.add_argument("--out", default=None, help="result name under bench/results (default: decode-profile-<device>)")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.batch_sizes, ns.input_len, ns.output_len = "1", 16, 4
    # EngineRunner's settings that this benchmark does not vary
    ns.max_num_batched_tokens = None
    return ns


def profiled(runner, prompts: list[list[int]], new_tokens: int, device: torch.device) -> tuple[float, list]:
    """One generation under the profiler: its wall seconds and the profiler's events."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with profile(activities=activities) as prof:
        sync()
        start = time.perf_counter()
        runner.generate(prompts, new_tokens)
        sync()
        wall = time.perf_counter() - start
    return wall, list(prof.events())


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals: time the device ran at least one kernel."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(wall: float, events: list, on_device: bool) -> dict:
    """Totals of one profiled generation: kernels (or CPU operators), launches, busy time, per-name times."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    intervals, launches, graph_launches = [], 0, 0
    for event in events:
        if on_device and event.device_type == DeviceType.CUDA:
            intervals.append((event.time_range.start, event.time_range.end))
            entry = per_name[event.name]
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
        elif event.name in LAUNCH_CALLS:
            launches += 1
        elif event.name in GRAPH_LAUNCH_CALLS:
            graph_launches += 1
        elif not on_device and event.device_type == DeviceType.CPU and event.name.startswith(CPU_OP_NAMESPACES):
            entry = per_name[event.name]
            entry[0] += 1
            entry[1] += event.self_cpu_time_total
    return {"wall_us": 1e6 * wall, "busy_us": busy_us(intervals), "launches": launches,
            "graph_launches": graph_launches, "per_name": dict(per_name)}


def per_step(long: dict, short: dict, steps: int, on_device: bool) -> dict:
    """The decode steps' figures: the long generation's totals less the short one's, per step."""
    def diff(key: str) -> float:
        return (long[key] - short[key]) / steps

    names = {}
    for name, (count, us) in long["per_name"].items():
        short_count, short_us = short["per_name"].get(name, (0, 0.0))
        names[name] = ((count - short_count) / steps, (us - short_us) / steps)
    top = sorted(names.items(), key=lambda item: item[1][1], reverse=True)[:TOP_KERNELS]
    unit = "kernels" if on_device else "cpu_ops"
    out = {
        "wall_ms_per_step": diff("wall_us") / 1000,
        f"{unit}_per_step": sum(count for count, _ in names.values()),
        f"{unit}_ms_per_step": sum(us for _, us in names.values()) / 1000,
        f"top_{unit}": [{"name": name[:160], "calls_per_step": count, "ms_per_step": us / 1000}
                        for name, (count, us) in top],
    }
    if on_device:
        out.update({
            "kernel_launch_calls_per_step": diff("launches"),
            "graph_launch_calls_per_step": diff("graph_launches"),
            "gpu_busy_ms_per_step": diff("busy_us") / 1000,
        })
        out["gpu_busy_fraction"] = out["gpu_busy_ms_per_step"] / out["wall_ms_per_step"] if out["wall_ms_per_step"] > 0 else None
    return out


NOTHING = {"wall_us": 0.0, "busy_us": 0.0, "launches": 0, "graph_launches": 0, "per_name": {}}


def profile_runner(runner, prompts: list[list[int]], output_len: int, device: torch.device) -> dict:
    """The decode steps' figures, and under "prefill" the short generation's own: the prompts' prefill
    (and the one token it samples), the same figures for the whole of it."""
    runner.generate(prompts, output_len + 1)  # warm-up: compilation, graph capture, allocations
    on_device = device.type == "cuda"
    short = summarize(*profiled(runner, prompts, 1, device), on_device)
    long = summarize(*profiled(runner, prompts, output_len + 1, device), on_device)
    return {**per_step(long, short, output_len, on_device), "prefill": per_step(short, NOTHING, 1, on_device)}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    batch_sizes = [int(b) for b in ns.batch_sizes.split(",")]
    on_cuda = ns.device == "cuda" or (ns.device == "auto" and torch.cuda.is_available())
    engine = EngineRunner(ns, max(batch_sizes), compiled=not ns.eager and (on_cuda or ns.compiled))
    device = engine.device
    runners = [engine]
    if device.type == "cuda" and not ns.no_anchor:
        hf_model = common.load_hf_model(ns.model, engine.dtype, str(device))
        runners.append(AnchorRunner(hf_model, ns.input_len + ns.output_len + 1))
    name = ns.out or f"decode-profile-{common.device_slug(str(device))}" + ("-quick" if ns.quick else "")
    payload = {"benchmark": "decode_profile", "settings": vars(ns),
               "engine": {"device": str(device), "dtype": str(engine.dtype).replace("torch.", "")},
               "environment": common.environment(str(device), ns.threads), "rows": []}
    for concurrency in batch_sizes:
        prompts = common.random_prompts(concurrency, ns.input_len, engine.vocab_size, ns.seed + concurrency)
        row = {"concurrency": concurrency}
        for runner in runners:
            row[runner.name] = figures = profile_runner(runner, prompts, ns.output_len, device)
            print(f"{runner.name:16s} batch {concurrency:3d}: {describe(figures)}", flush=True)
            print(f"{'':16s} prefill {concurrency} x {ns.input_len}: {describe(figures['prefill'])}", flush=True)
        payload["rows"].append(row)
        common.write_result(name, payload)  # after every row: an interrupted run keeps what it finished
    print(f"wrote {common.write_result(name, payload)}")
    return 0


def describe(figures: dict) -> str:
    if "kernels_per_step" in figures:
        top = figures["top_kernels"][0]["name"][:60] if figures["top_kernels"] else "-"
        return (f"{figures['wall_ms_per_step']:.3f} ms/step, {figures['kernels_per_step']:.0f} kernels "
                f"({figures['kernel_launch_calls_per_step']:.0f} launches, "
                f"{figures['graph_launch_calls_per_step']:.1f} graph launches), GPU busy "
                f"{figures['gpu_busy_ms_per_step']:.3f} ms ({figures['gpu_busy_fraction'] or 0:.0%}); top: {top}")
    return f"{figures['wall_ms_per_step']:.3f} ms/step, {figures['cpu_ops_per_step']:.0f} torch ops"


if __name__ == "__main__":
    sys.exit(main())
