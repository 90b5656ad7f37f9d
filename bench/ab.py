"""Paired A/B of two commits' decode steps, in lockstep, so that the machine's drift cancels.

    python bench/ab.py 63a08b9 9e89f96                                  # SmolLM2, 1 and 32 sequences
    python bench/ab.py 63a08b9 9e89f96 --compiled                       # decode steps compiled
    python bench/ab.py 63a08b9 9e89f96 --model ~/.cache/depthserve/bench-checkpoints/itt-... \\
        --depth '{"thinking_steps": 3}' --concurrency 32

On a shared VM the same code's throughput moves by 10-30% between runs minutes apart, more than the
few percent a refactoring must be shown not to cost. Here each commit is checked out into its own
git worktree and laid out as the installed package (`depthserve.kernels` from `kernels/`, as
pyproject.toml maps it), and one process per commit (bench/ab_worker.py, that commit's code on
PYTHONPATH, its own native-kernel build directory) builds the same engine on the same batch:
`--concurrency` requests of `--input-len` random tokens, greedy, EOS ignored, prefilled, warmed up.
Then the two take turns one decode step at a time (A B, then B A, ...: the other process waits
on its pipe), `--steps` times. Each pair of adjacent steps gives a ratio B/A. Whichever side steps
second in a pair runs slower (by ~30% at batch 1 on the 2-core VM: it wakes from its pipe into
caches the other filled), so the ratios of the two orders are summarised apart, each by its
median (robust to the VM's stalls, which hit single steps), and combined as their geometric mean,
in which that order effect cancels; the 95% interval bootstraps the pairs within each order. The
result also gives each side's median step time and whether both generated the same tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "ab_worker.py"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", help="commit A (git revision)")
    p.add_argument("after", help="commit B (git revision)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--depth", default="", help="depth knobs as JSON, the same for both")
    p.add_argument("--concurrency", default="1,32", help="comma-separated batch sizes, one comparison each")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=60, help="timed decode steps per side")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--compiled", action="store_true", help="decode steps compiled at static shapes (enforce_eager=False)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/depthserve-ab"), help="worktrees and kernel builds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args()


def checkout(revision: str, workdir: Path) -> tuple[str, Path]:
    """The commit's worktree and its package link tree (`root/depthserve` as pyproject.toml maps it)."""
    sha = subprocess.run(["git", "rev-parse", "--short", revision], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = workdir / f"tree-{sha}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=REPO, check=True, capture_output=True)
    package = workdir / f"root-{sha}" / "depthserve"
    if not package.exists():
        package.mkdir(parents=True)
        for entry in (tree / "depthserve").iterdir():
            (package / entry.name).symlink_to(entry)
        for name in ("kernels", "server", "clients"):
            (package / name).symlink_to(tree / name)
    return sha, package.parent


def checkout_env(sha: str, root: Path, workdir: Path) -> dict[str, str]:
    """The environment of a process that runs the commit `sha` from its link tree `root` (`checkout`),
    with its own native-kernel build directory."""
    return dict(os.environ, PYTHONPATH=str(root), PYTHONSAFEPATH="1",
                TORCH_EXTENSIONS_DIR=str(workdir / f"extensions-{sha}"))


def revision_env(revision: str, workdir: Path) -> tuple[str, dict[str, str]]:
    """The commit's short hash and the environment of a process that runs it from its worktree."""
    sha, root = checkout(revision, workdir)
    return sha, checkout_env(sha, root, workdir)


class Side:
    """One commit's worker process."""

    def __init__(self, sha: str, root: Path, config: dict[str, Any], workdir: Path):
        env = checkout_env(sha, root, workdir)
        self.sha = sha
        self.process = subprocess.Popen([sys.executable, str(WORKER), json.dumps(config)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)
        ready = self.read()
        if not ready.get("ready") or not ready["depthserve"].startswith(str(root)):
            raise RuntimeError(f"{sha}: the worker did not start from its own tree: {ready}")
        self.samples: list[float] = []

    def read(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.sha}: the worker exited (exit status {self.process.wait()})")
        message = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"{self.sha}: {message['error']}")
        return message

    def ask(self, command: str) -> dict[str, Any]:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()

    def step(self) -> float:
        seconds = self.ask("step")["seconds"]
        self.samples.append(seconds)
        return seconds

    def close(self) -> None:
        self.process.stdin.write("quit\n")
        self.process.stdin.close()
        self.process.wait(timeout=60)


def order_balanced_ratio(first: list[float], second: list[float]) -> float:
    """exp of the mean of the two orders' median log ratios (A first, B first)."""
    return math.exp((statistics.median(first) + statistics.median(second)) / 2)


def bootstrap_interval(first: list[float], second: list[float], seed: int, rounds: int = 2000) -> tuple[float, float]:
    rng = random.Random(seed)
    estimates = sorted(order_balanced_ratio(rng.choices(first, k=len(first)), rng.choices(second, k=len(second)))
                       for _ in range(rounds))
    return estimates[int(0.025 * rounds)], estimates[int(0.975 * rounds) - 1]


def compare(a: Side, b: Side, steps: int, seed: int) -> dict[str, Any]:
    """`steps` pairs, A first in the even ones: the log ratios log(B / A) by order."""
    a_first, b_first = [], []
    for i in range(steps):
        if i % 2 == 0:
            before = a.step()
            a_first.append(math.log(b.step() / before))
        else:
            after = b.step()
            b_first.append(math.log(after / a.step()))
    low, high = bootstrap_interval(a_first, b_first, seed)
    same_tokens = a.ask("tokens")["tokens"] == b.ask("tokens")["tokens"]
    return {
        "before_step_ms": 1000 * statistics.median(a.samples),
        "after_step_ms": 1000 * statistics.median(b.samples),
        "after_over_before": order_balanced_ratio(a_first, b_first),
        "after_over_before_95ci": [low, high],
        "after_over_before_by_order": {"before_first": math.exp(statistics.median(a_first)),
                                       "after_first": math.exp(statistics.median(b_first))},
        "same_tokens": same_tokens,
        "before_step_ms_samples": [1000 * s for s in a.samples],
        "after_step_ms_samples": [1000 * s for s in b.samples],
    }


def main() -> None:
    ns = parse_args()
    ns.workdir.mkdir(parents=True, exist_ok=True)
    (before, before_root), (after, after_root) = checkout(ns.before, ns.workdir), checkout(ns.after, ns.workdir)
    rows = []
    for concurrency in [int(c) for c in common.parse_number_list(ns.concurrency)]:
        config = {"model": ns.model, "dtype": ns.dtype, "threads": ns.threads, "concurrency": concurrency,
                  "input_len": ns.input_len, "max_tokens": ns.warmup_steps + ns.steps + 4, "compiled": ns.compiled,
                  "quantization": ns.quantization, "depth": json.loads(ns.depth) if ns.depth else {},
                  "warmup_steps": ns.warmup_steps, "seed": ns.seed, "step_token_budget": 2048}
        sides = [Side(before, before_root, config, ns.workdir), Side(after, after_root, config, ns.workdir)]
        try:
            row = {"concurrency": concurrency, **compare(*sides, ns.steps, ns.seed)}
        finally:
            for side in sides:
                side.close()
        rows.append(row)
        low, high = row["after_over_before_95ci"]
        print(f"concurrency {concurrency:3d}: step {row['before_step_ms']:.2f} ms ({before}) -> "
              f"{row['after_step_ms']:.2f} ms ({after}), after/before {row['after_over_before']:.3f} "
              f"(95% {low:.3f}-{high:.3f}), same tokens: {row['same_tokens']}", flush=True)
    result = {
        "benchmark": "ab",
        "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
                     "before_commit": before, "after_commit": after},
        "environment": common.environment("cpu", ns.threads),
        "method": "two processes, one per commit, one decode step each in turn, the order alternating; ratio = geometric mean of the two orders' median pair ratios",
        "rows": rows,
    }
    name = ns.out or f"ab-{before}-{after}{'-compiled' if ns.compiled else ''}"
    print("wrote", common.write_result(name, result))


if __name__ == "__main__":
    main()
