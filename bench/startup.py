"""How long an engine takes to start on a GGUF model, with and without the GGUF index
(depthserve/loading/gguf_loader.py: the first read of a file saves what later starts need from gguf's
parse of it).

    python bench/startup.py --threads 1 --repeats 3

Each start is a fresh Python process that imports the engine and builds it (`LLMEngine`, fp32, as a
Ray replica or `depthserve serve` would): the time to import, and to build. The two cases alternate
within every repeat: "parse" with the file's index removed first (what a first start pays), "index"
with it in place. The tokenizer's own cache (converted once from the GGUF) is kept in both.
Writes bench/results/startup-<tag>.json.

    python bench/startup.py --threads 1 --repeats 5 --revisions 1bfb555 HEAD --kv-cache-gib 1

compares two commits instead (both with the index in place), alternating their starts within every
repeat; each commit runs from its own git worktree laid out as the installed package (bench/ab.py's
`checkout`), with its own native-kernel build. Writes bench/results/startup-<tag>-<A>-<B>.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from depthserve.loading.derived_cache import derived_dir  # noqa: E402
from depthserve.loading.registry import resolve_model  # noqa: E402

CHILD = """
import json, sys, time
started = time.perf_counter()
from depthserve.config import EngineArgs
from depthserve.engine.llm_engine import LLMEngine
imported = time.perf_counter()
LLMEngine(EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=1024, kv_cache_memory_gib=float(sys.argv[3]),
                     load_progress=False, num_threads=int(sys.argv[2])))
print(json.dumps({"import_s": imported - started, "build_s": time.perf_counter() - imported,
                  "imported_dynamo": "torch._dynamo" in sys.modules}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tag", default=None, help="machine tag in the result file name (default: cpu-<cpu kind>-2core)")
    p.add_argument("--kv-cache-gib", type=float, default=0.1, help="the engine's KV pool (committed at start-up)")
    p.add_argument("--revisions", nargs=2, metavar=("A", "B"), default=None,
                   help="compare two commits' start-ups (module docstring) instead of parse against index")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/depthserve-ab"), help="worktrees and kernel builds")
    return p.parse_args(argv)


def start_once(model: str, threads: int, kv_cache_gib: float, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, model, str(threads), str(kv_cache_gib)], capture_output=True,
                          text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ns = parse_args(argv)
    source = resolve_model(ns.model)
    if source.format != "gguf":
        raise SystemExit(f"{ns.model} is not a GGUF file: nothing to index")
    index_dir = derived_dir(source.path, "gguf-index")
    if ns.revisions:
        from ab import revision_env

        cases = dict(revision_env(revision, ns.workdir) for revision in ns.revisions)
    else:
        cases = {"parse": None, "index": None}
    for env in cases.values():  # the tokenizer's conversion and the native kernels' build, if not cached
        start_once(ns.model, ns.threads, ns.kv_cache_gib, env)
    runs: dict[str, list[dict]] = {case: [] for case in cases}
    for _ in range(ns.repeats):
        for case, env in cases.items():
            if case == "parse":
                shutil.rmtree(index_dir, ignore_errors=True)  # it parses, then writes the index
            runs[case].append(start_once(ns.model, ns.threads, ns.kv_cache_gib, env))
        print({case: round(rows[-1]["build_s"], 2) for case, rows in runs.items()}, flush=True)
    medians = {case: {key: statistics.median(r[key] for r in rows) for key in ("import_s", "build_s")}
               for case, rows in runs.items()}
    first, second = cases
    result = {
        "benchmark": "startup",
        **common.environment("cpu", ns.threads),
        "setup": {"model": ns.model, "file": source.path.name, "threads": ns.threads, "repeats": ns.repeats,
                  "kv_cache_gib": ns.kv_cache_gib, "command": "python bench/startup.py " + " ".join(sys.argv[1:])},
        "runs": runs,
        "median": medians,
        f"build_{second}_over_{first}": medians[second]["build_s"] / medians[first]["build_s"],
    }
    tag = ns.tag or f"cpu-{common.cpu_kind_tag()}2core"
    name = f"startup-{tag}" + (f"-{first}-{second}" if ns.revisions else "")
    print(f"build: {first} {medians[first]['build_s']:.2f} s, {second} {medians[second]['build_s']:.2f} s; "
          f"wrote {common.write_result(name, result)}")
    return result


if __name__ == "__main__":
    main()
