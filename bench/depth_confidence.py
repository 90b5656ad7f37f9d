"""The confidence depth policy (early exit) on a demo model with a readout at every level (demo-dreamer,
demo-put): held-out accuracy against the compute it spent, one row per threshold, beside the model at
full depth.

    python bench/depth_confidence.py                       # demo-dreamer, 1000 problems
    python bench/depth_confidence.py --model demo-put --out depth-confidence-demo-put
    python bench/depth_confidence.py --problems 200 --thresholds 0.9,0.99

Method: `--problems` held-out variable-chasing problems (depthserve/demo/task.py, hops uniform in
1..6, seed `--seed`) answered greedily through `LLM.generate` (one token). The baseline runs the
fixed knob at the trained depth; each threshold runs an engine with `--depth-policy confidence
--confidence-threshold p` on requests asking for the whole range of the model's elastic knob
(`"depth": "auto"` or `"loops": "auto"`): every token whose readout is sampled stops at the first
level whose readout's top-1 probability reaches p. Relative compute: the FLOPs the engine reported
for each request (usage.depth.flops: the schedule it ran, prompt tokens included, plus the LM-head
readouts the exit took) over those of the same problem at full depth, averaged over problems. The depth of the answer is the level of the question token, the position whose
readout is the answer. `--prompt-exit` runs each threshold a second time with prompt tokens by need
(a prompt token stops at the first depth whose readout gives the prompt's next token probability p).
Not a timing benchmark.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo-dreamer",
                   help="a demo model with a readout at every level (built-in name or directory)")
    p.add_argument("--thresholds", default="0.5,0.7,0.8,0.9,0.95,0.99,0.999")
    p.add_argument("--problems", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1234, help="seeds the held-out problems")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="depth-confidence-demo", help="result name under bench/results")
    p.add_argument("--prompt-exit", action="store_true",
                   help="prompt tokens by need too (EngineArgs.prompt_exit): each threshold runs twice, without "
                        "and with it")
    p.add_argument("--quick", action="store_true", help="100 problems, thresholds 0.9 and 0.99")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.problems, ns.thresholds, ns.out = 100, "0.9,0.99", f"{ns.out}-quick"
    return ns


def elastic_knob(llm) -> str:
    """The model's knob that takes a range (Dreamer `depth`, PUT `loops`)."""
    return next(name for name, knob in llm.engine.model.depth_knobs().items() if knob.elastic)


def evaluate(llm, problems, depth, full_flops: list[float] | None = None) -> tuple[dict, list[float]]:
    """The row of one engine, and each problem's FLOPs (`full_flops`: those at full depth, which the
    row's relative compute divides by; None: this is that run)."""
    from depthserve import SamplingParams

    outputs = llm.generate([p.prompt for p in problems], SamplingParams(temperature=0.0, max_tokens=1), depth)
    flops = [o.depth.flops for o in outputs]
    correct = [o.text.strip() == p.answer for o, p in zip(outputs, problems)]
    answer_depth = [o.outputs[0].token_depths[0] if o.outputs[0].token_depths else None for o in outputs]
    row = {"accuracy": sum(correct) / len(correct),
           "relative_compute": sum(f / full for f, full in zip(flops, full_flops or flops)) / len(outputs)}
    if answer_depth[0] is not None:
        row["mean_answer_depth"] = sum(answer_depth) / len(answer_depth)
        row["mean_token_depth"] = (sum(sum(o.depth.per_token) for o in outputs)
                                   / sum(len(o.depth.per_token) for o in outputs))
        by_hops: dict[int, list[int]] = {}
        for d, p in zip(answer_depth, problems):
            by_hops.setdefault(p.hops, []).append(d)
        row["answer_depth_by_hops"] = {h: sum(v) / len(v) for h, v in sorted(by_hops.items())}
    by_hops_ok: dict[int, list[bool]] = {}
    for ok, p in zip(correct, problems):
        by_hops_ok.setdefault(p.hops, []).append(ok)
    row["accuracy_by_hops"] = {h: sum(v) / len(v) for h, v in sorted(by_hops_ok.items())}
    return row, flops


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    torch.set_num_threads(ns.threads)
    from depthserve import LLM, DepthParams
    from depthserve.demo.task import problems as make_problems

    held_out = make_problems(ns.seed, ns.problems, "held_out", 6)
    engine = dict(device="cpu", dtype="float32", load_progress=False, num_threads=ns.threads, max_model_len=128,
                  max_num_seqs=256)
    baseline = LLM(ns.model, **engine)
    knob = elastic_knob(baseline)
    full, full_flops = evaluate(baseline, held_out, DepthParams())
    del baseline
    print(f"full depth: accuracy {full['accuracy']:.3f} at relative compute {full['relative_compute']:.3f}", flush=True)
    rows = []
    for threshold in common.parse_number_list(ns.thresholds):
        for prompt_exit in (False, True) if ns.prompt_exit else (False,):
            llm = LLM(ns.model, depth_policy="confidence", confidence_threshold=threshold, prompt_exit=prompt_exit,
                      **engine)
            measured, _ = evaluate(llm, held_out, DepthParams.from_dict({knob: "auto"}), full_flops)
            row = {"threshold": threshold, "prompt_exit": prompt_exit, **measured}
            rows.append(row)
            print(f"threshold {threshold:g}{', prompt tokens by need' if prompt_exit else ''}: accuracy "
                  f"{row['accuracy']:.3f} at relative compute {row['relative_compute']:.3f}, answer depth "
                  f"{row['mean_answer_depth']:.2f}, token depth {row['mean_token_depth']:.2f}", flush=True)
            del llm
    payload = {
        "benchmark": "depth-confidence",
        "description": "held-out accuracy of a demo model under the confidence depth policy (a sampled "
                       "token stops at the first level whose readout is confident), per threshold, with the "
                       "compute the engine reported relative to the same problems at full depth",
        "settings": {"model": ns.model, "problems": ns.problems, "seed": ns.seed, "split": "held_out",
                     "max_hops": 6, knob: "auto", "dtype": "float32", "prompt_exit": ns.prompt_exit},
        "full_depth": full,
        "rows": rows,
        "environment": common.environment("cpu", ns.threads),
    }
    print(f"wrote {common.write_result(ns.out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
