"""The server's resident memory under hostile structured-output traffic (docs/server.md, "Structured
outputs and tools"): distinct constraints that fail to compile, distinct huge choice lists, and
distinct large choice lists that compile (each kept by the compile cache until its byte budget
evicts it).

    python bench/constraint_memory.py --out constraint-memory-cpu-xeon-2core
    python bench/constraint_memory.py --regexes 10 --choice-lists 10 --cacheable 10 --out constraint-memory-quick

Method. `depthserve serve` is launched on a loopback port (bench/serving.py's launcher); one small
constrained request builds its grammar backend; then its resident set size (psutil, the server
process) is the baseline. Three phases, each request distinct from every other (so no cache hit),
sent by `--concurrency` clients to /v1/completions with `max_tokens` 1:
1. `--regexes` regexes `a{1000}{N}` (N = 1001, 1002, ...): each builds a lexer of hundreds of MB
   before it fails; expected 400;
2. `--choice-lists` lists of `--choices` strings (over the choice limit); expected 400;
3. `--cacheable` lists of `--cacheable-choices` strings, within the limits; expected 200.
The server's RSS is sampled every 0.25 s by a thread (the peak) and after each phase (the level).
The run stops sending once `--max-seconds` have passed (the counts sent are reported).
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import serving  # noqa: E402

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--server-args", default="", help="more `depthserve serve` options")
    p.add_argument("--regexes", type=int, default=200)
    p.add_argument("--choice-lists", type=int, default=200)
    p.add_argument("--choices", type=int, default=50_000)
    p.add_argument("--cacheable", type=int, default=60)
    p.add_argument("--cacheable-choices", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-seconds", type=float, default=1800.0, help="stop sending after this long")
    p.add_argument("--server-start-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None, help="result name under bench/results")
    return p.parse_args(argv)


class RssSampler:
    """The peak resident set size of a process, sampled on a thread."""

    def __init__(self, process: psutil.Process, period_s: float = 0.25):
        self.process = process
        self.period_s = period_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        rss = self.process.memory_info().rss
        self.peak = max(self.peak, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.now()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def server_process(port_hint: str) -> psutil.Process:
    """The launched `depthserve serve` child of this process (its command line names the port)."""
    for child in psutil.Process().children(recursive=True):
        if port_hint in " ".join(child.cmdline()) and "serve" in child.cmdline():
            return child
    raise SystemExit("the launched server process was not found")


def regex_fields(count: int) -> Iterator[dict]:
    for i in range(count):
        yield {"structured_outputs": {"regex": "a{1000}{%d}" % (1001 + i)}}


def choice_fields(count: int, choices: int, tag: str) -> Iterator[dict]:
    for i in range(count):
        yield {"structured_outputs": {"choice": [f"{tag} {i} option {j}" for j in range(choices)]}}


def run_phase(base: str, fields: Iterator[dict], concurrency: int, deadline: float,
              sampler: RssSampler, baseline: int) -> dict:
    statuses: collections.Counter[int] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    seconds: list[float] = []
    lock = threading.Lock()
    fields_lock = threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=300) as http:
            while time.monotonic() < deadline:
                with fields_lock:
                    extra = next(fields, None)
                if extra is None:
                    return
                start = time.perf_counter()
                response = http.post(f"{base}/v1/completions",
                                     json={"model": "default", "prompt": "Go:", "max_tokens": 1, **extra})
                with lock:
                    seconds.append(time.perf_counter() - start)
                    statuses[response.status_code] += 1
                    if response.status_code != 200:
                        errors[response.json()["error"]["message"].split(":")[-1].strip()[:80]] += 1

    sampler.peak = sampler.now()
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    wall = time.perf_counter() - started
    time.sleep(1.0)  # trims and evictions that follow the last answer
    level = sampler.now()
    return {"requests": sum(statuses.values()), "statuses": dict(statuses), "error_reasons": dict(errors),
            "wall_s": round(wall, 1), "seconds_per_request": common.summarize(seconds),
            "rss_after_mib": round(level / MIB), "rss_peak_mib": round(sampler.peak / MIB),
            "rss_after_minus_baseline_mib": round((level - baseline) / MIB)}


def model_id(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    port = common.free_port()
    command = serving.depthserve_command(args.model, args.server_args, port)
    with serving.launched(command, port, args.server_start_timeout, serving.DEPTHSERVE) as base:
        process = server_process(str(port))
        started_rss = process.memory_info().rss
        model = model_id(base)
        warm = httpx.post(f"{base}/v1/completions", timeout=300, json={
            "model": model, "prompt": "Go:", "max_tokens": 1, "structured_outputs": {"choice": ["yes", "no"]}})
        assert warm.status_code == 200, warm.text
        baseline = process.memory_info().rss
        deadline = time.monotonic() + args.max_seconds
        phases: dict[str, Callable[[], Iterator[dict]]] = {
            "failing_regexes": lambda: regex_fields(args.regexes),
            "huge_choice_lists": lambda: choice_fields(args.choice_lists, args.choices, "huge"),
            "cacheable_choice_lists": lambda: choice_fields(args.cacheable, args.cacheable_choices, "kept"),
        }
        results = {}
        with RssSampler(process) as sampler:
            for name, fields in phases.items():
                results[name] = run_phase(base, _with_model(fields(), model), args.concurrency, deadline, sampler,
                                          baseline)
                print(name, results[name], flush=True)
        final = process.memory_info().rss
    payload = {
        "benchmark": "constraint_memory",
        "environment": common.environment("cpu", None),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "rss_at_start_mib": round(started_rss / MIB),
        "rss_baseline_mib": round(baseline / MIB),
        "rss_final_mib": round(final / MIB),
        "rss_final_minus_baseline_mib": round((final - baseline) / MIB),
        "rss_peak_mib": round(max(r["rss_peak_mib"] for r in results.values())),
        "phases": results,
    }
    print(f"RSS: baseline {payload['rss_baseline_mib']} MiB, final {payload['rss_final_mib']} MiB, "
          f"peak {payload['rss_peak_mib']} MiB")
    if args.out:
        print(f"wrote {common.write_result(args.out, payload)}")


def _with_model(fields: Iterator[dict], model: str) -> Iterator[dict]:
    for extra in fields:
        yield {"model": model, **extra}


if __name__ == "__main__":
    main()
