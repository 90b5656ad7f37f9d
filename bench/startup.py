"""How long an engine takes to start on a GGUF model, with and without the GGUF index
(depthserve/loading/gguf_loader.py: the first read of a file saves what later starts need from gguf's
parse of it).

    python bench/startup.py --threads 1 --repeats 3

Each start is a fresh Python process that imports the engine and builds it (`LLMEngine`, fp32, as a
Ray replica or `depthserve serve` would): the time to import, and to build. The two cases alternate
within every repeat: "parse" with the file's index removed first (what a first start pays), "index"
with it in place. The tokenizer's own cache (converted once from the GGUF) is kept in both.
Writes bench/results/startup-<tag>.json.
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
LLMEngine(EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=1024, kv_cache_memory_gib=0.1,
                     load_progress=False, num_threads=int(sys.argv[2])))
print(json.dumps({"import_s": imported - started, "build_s": time.perf_counter() - imported}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tag", default=None, help="machine tag in the result file name (default: cpu-<cpu kind>-2core)")
    return p.parse_args(argv)


def start_once(model: str, threads: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, model, str(threads)], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ns = parse_args(argv)
    source = resolve_model(ns.model)
    if source.format != "gguf":
        raise SystemExit(f"{ns.model} is not a GGUF file: nothing to index")
    index_dir = derived_dir(source.path, "gguf-index")
    start_once(ns.model, ns.threads)  # the tokenizer's conversion and the native kernels' build, if not cached
    runs: dict[str, list[dict]] = {"parse": [], "index": []}
    for _ in range(ns.repeats):
        shutil.rmtree(index_dir, ignore_errors=True)
        runs["parse"].append(start_once(ns.model, ns.threads))  # parses, then writes the index
        runs["index"].append(start_once(ns.model, ns.threads))
        print({case: round(rows[-1]["build_s"], 2) for case, rows in runs.items()}, flush=True)
    medians = {case: {key: statistics.median(r[key] for r in rows) for key in ("import_s", "build_s")}
               for case, rows in runs.items()}
    result = {
        "benchmark": "startup",
        **common.environment("cpu", ns.threads),
        "setup": {"model": ns.model, "file": source.path.name, "threads": ns.threads, "repeats": ns.repeats,
                  "command": "python bench/startup.py " + " ".join(sys.argv[1:])},
        "runs": runs,
        "median": medians,
        "build_index_over_parse": medians["index"]["build_s"] / medians["parse"]["build_s"],
    }
    tag = ns.tag or f"cpu-{common.cpu_kind_tag()}2core"
    print(f"build: parse {medians['parse']['build_s']:.2f} s, index {medians['index']['build_s']:.2f} s; "
          f"wrote {common.write_result(f'startup-{tag}', result)}")
    return result


if __name__ == "__main__":
    main()
