"""Held-out accuracy of the demo depth models at every setting of their depth knob.

    python bench/depth_quality.py                          # demo-itt, demo-dreamer, demo-put
    python bench/depth_quality.py --models demo-put --problems 200

Method: `--problems` held-out variable-chasing problems (depthserve/demo/task.py, hops uniform in
1..`--max-hops` (default: the hops the model was trained for), seed `--seed`; the held-out split
never meets a training problem) are answered greedily through `LLM.generate` (one token,
temperature 0) at each setting of the model's knob
(ITT: thinking steps and selection ratios; Dreamer: depth 1..D; PUT: loops 1..T), all problems of
a setting in one batch. Accuracy = answers equal to the solver's; the relative compute of a
setting is the mean of the engine's per-request depth report (FLOPs against the plain model's
on the same tokens), so it is what the engine counted, not a formula of this script. Chance is
1 / (digits in the prompt): a guess among the chains' digits. Not a timing benchmark.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

DEMO_MODELS = ("demo-itt", "demo-dreamer", "demo-put")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(DEMO_MODELS), help="comma-separated built-in names or checkpoint dirs")
    p.add_argument("--problems", type=int, default=1000, help="held-out problems per setting")
    p.add_argument("--max-hops", type=int, default=None, help="default: each model's own (train_demo.json)")
    p.add_argument("--seed", type=int, default=1234, help="seeds the held-out problems")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="depth-quality-demo", help="result name under bench/results")
    return p.parse_args(argv)


def chance(prompt: str) -> float:
    return 1.0 / sum(ch.isdigit() for ch in prompt)


def evaluate(model: str, problems, threads: int) -> dict:
    import json

    from depthserve import LLM, DepthParams, SamplingParams
    from depthserve.archs import demo_arches
    from depthserve.loading.registry import resolve_model

    path = resolve_model(model).path
    cfg = json.loads((path / "config.json").read_text())
    arch = demo_arches()[cfg["depth"]["architecture"]]
    llm = LLM(model, device="cpu", dtype="float32", load_progress=False, num_threads=threads,
              max_model_len=128, max_num_seqs=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = [p.prompt for p in problems]
    rows = []
    for setting in arch.settings(cfg):
        outputs = llm.generate(prompts, greedy, DepthParams(**setting))
        correct = [o.text.strip() == p.answer for o, p in zip(outputs, problems)]
        compute = [o.depth.relative_compute for o in outputs]
        by_hops: dict[int, list[bool]] = {}
        for ok, p in zip(correct, problems):
            by_hops.setdefault(p.hops, []).append(ok)
        rows.append({"setting": setting, "accuracy": sum(correct) / len(correct),
                     "relative_compute": sum(compute) / len(compute),
                     "accuracy_by_hops": {h: sum(v) / len(v) for h, v in sorted(by_hops.items())}})
        print(f"{model} {setting}: accuracy {rows[-1]['accuracy']:.3f} at relative compute "
              f"{rows[-1]['relative_compute']:.3f}", flush=True)
    del llm
    return {"model": model, "architecture": arch.name, "knob": arch.knob, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    torch.set_num_threads(ns.threads)
    import json

    from depthserve.demo.task import problems as make_problems
    from depthserve.loading.registry import resolve_model

    results = []
    for model in [m for m in ns.models.split(",") if m]:
        meta = json.loads((resolve_model(model).path / "train_demo.json").read_text())
        max_hops = ns.max_hops or meta["max_hops"]
        held_out = make_problems(ns.seed, ns.problems, "held_out", max_hops)
        result = evaluate(model, held_out, ns.threads)
        result.update(max_hops=max_hops, chance=sum(map(chance, (p.prompt for p in held_out))) / len(held_out),
                      training=meta)
        results.append(result)
    payload = {
        "benchmark": "depth-quality",
        "description": "held-out variable-chasing accuracy of the demo models at every depth setting "
                       "(greedy, through LLM.generate), with the relative compute the engine reported",
        "settings": {"problems": ns.problems, "seed": ns.seed, "split": "held_out", "dtype": "float32"},
        "models": results,
        "environment": common.environment("cpu", ns.threads),
    }
    print(f"wrote {common.write_result(ns.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
