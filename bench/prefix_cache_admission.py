"""What a full prefix cache costs the engine's host: the time to serve a batch of new prompts while
the cache holds more and more unreferenced rows (blocks of finished requests, kept for later hits).

    python bench/prefix_cache_admission.py --revisions 8f2c711 HEAD

A tiny Llama (random weights, make-tiny), so that the model's compute is small beside the host's
bookkeeping: `--batch` prompts of `--input-len` random tokens, one token each, prefix caching on.
Rounds of new prompts fill the cache (each leaves batch * input_len / block_size rows behind); at
each of `--cached-rows` the next `--repeats` rounds are timed and their median kept. The scheduler
asks the block manager for its free pages at every admission, so a count that walks the cached rows
grows with them. Each commit runs in its own process from its own git worktree (bench/ab.py's
`checkout`), the two alternating target by target. Writes
bench/results/prefix-cache-admission-<tag>-<A>-<B>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CHILD = """
import json, random, statistics, sys, time
from depthserve import LLM, SamplingParams
setup = json.loads(sys.argv[1])
llm = LLM(setup["model"], dtype="float32", max_num_batched_tokens=setup["batch"] * setup["input_len"],
          max_num_seqs=setup["batch"], max_model_len=2 * setup["input_len"], kv_cache_memory_gib=setup["kv_cache_gib"],
          load_progress=False, enforce_eager=True, num_threads=1)
params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
evictable = llm.engine.block_manager._evictable  # unreferenced cached rows (private: read for this count only)
rng = random.Random(0)
def round_ms():
    prompts = [[rng.randrange(10, 40000) for _ in range(setup["input_len"])] for _ in range(setup["batch"])]
    start = time.perf_counter()
    llm.generate(prompts, params)
    return 1000 * (time.perf_counter() - start)
round_ms()  # warm-up
for target in setup["cached_rows"]:
    sys.stdin.readline()  # this commit's turn (the other waits)
    while len(evictable) < target:
        round_ms()
    rows = len(evictable)
    times = [round_ms() for _ in range(setup["repeats"])]
    print(json.dumps({"cached_rows": rows, "round_ms": times, "median_ms": statistics.median(times)}), flush=True)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--revisions", nargs=2, metavar=("A", "B"), required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--cached-rows", default="0,4000,16000", help="comma-separated cache sizes, in rows")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--tag", default=None, help="machine tag in the result file name (default: cpu-<cpu kind>-2core)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/depthserve-ab"), help="worktrees and kernel builds")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from ab import revision_env

    from depthserve.lab.make_tiny import make_tiny

    ns = parse_args(argv)
    targets = [int(rows) for rows in common.parse_number_list(ns.cached_rows)]
    model = make_tiny("llama", Path(tempfile.mkdtemp(prefix="depthserve-admission-")) / "llama", seed=1)
    setup = {"model": str(model), "batch": ns.batch, "input_len": ns.input_len, "cached_rows": targets,
             "repeats": ns.repeats, "kv_cache_gib": ns.kv_cache_gib}
    children = {}
    for revision in ns.revisions:
        sha, env = revision_env(revision, ns.workdir)
        children[sha] = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(setup)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=env)
    rows: dict[str, list[dict]] = {sha: [] for sha in children}
    for _ in targets:
        for sha, child in children.items():  # one at a time: the other waits on its stdin
            child.stdin.write("\n")
            child.stdin.flush()
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"{sha}: the child exited (exit status {child.wait()})")
            rows[sha].append(json.loads(line))
        print({sha: round(r[-1]["median_ms"], 1) for sha, r in rows.items()}, flush=True)
    for child in children.values():
        child.wait()
    first, second = children
    result = {
        "benchmark": "prefix-cache-admission",
        **common.environment("cpu", 1),
        "setup": {**setup, "model": "make-tiny llama, seed 1",
                  "command": "python bench/prefix_cache_admission.py " + " ".join(sys.argv[1:])},
        "rows": rows,
        f"round_{second}_over_{first}": [b["median_ms"] / a["median_ms"] for a, b in zip(rows[first], rows[second])],
    }
    tag = ns.tag or f"cpu-{common.cpu_kind_tag()}2core"
    print(f"wrote {common.write_result(f'prefix-cache-admission-{tag}-{first}-{second}', result)}")
    return result


if __name__ == "__main__":
    main()
