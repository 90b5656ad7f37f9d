"""`depthserve train-demo`: the command line of depthserve/lab/demo/train.py, for every registered
architecture with a demo recipe (`Architecture.demo`)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from depthserve.archs import demo_arches
from depthserve.lab.demo.kit import Shape
from depthserve.lab.demo.train import Recipe

HELP = "train a small depth model on variable chasing"


def add_subcommands(sub) -> None:
    from depthserve.tools.cli import HelpFormatter

    demos = demo_arches()
    defaults = {f.name: f.default for f in fields(Recipe)}
    p = sub.add_parser("train-demo", help=HELP, formatter_class=HelpFormatter,
                       description="Train a demo depth model on the variable-chasing task (depthserve/demo/task.py) "
                                   "and write a native checkpoint the engine serves like any other.")
    p.add_argument("--arch", required=True, choices=sorted(demos), help="the architecture")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=defaults["steps"],
                   help="optimizer steps (0: the architecture's recipe, "
                        + ", ".join(f"{name} {arch.steps}" for name, arch in sorted(demos.items())) + ")")
    p.add_argument("--batch-size", type=int, default=defaults["batch_size"], help="problems per step")
    p.add_argument("--lr", type=float, default=defaults["lr"], help="peak learning rate (AdamW, cosine decay)")
    p.add_argument("--max-hops", type=int, default=defaults["max_hops"],
                   help="the task's longest chains (0: the hops the largest setting reaches)")
    p.add_argument("--eval-every", type=int, default=defaults["eval_every"],
                   help="steps between held-out evaluations (the curriculum's check)")
    p.add_argument("--hidden-size", type=int, default=Shape.hidden_size, help="model width")
    p.add_argument("--intermediate-size", type=int, default=Shape.intermediate_size, help="MLP width")
    p.add_argument("--heads", type=int, default=Shape.num_attention_heads, help="attention heads")
    p.add_argument("--seed", type=int, default=defaults["seed"], help="seeds the problems, the order and the weights")
    p.add_argument("--threads", type=int, default=defaults["threads"], help="torch threads (0: torch's default)")
    p.set_defaults(func=_cmd_train_demo)


def _cmd_train_demo(ns: argparse.Namespace) -> int:
    from depthserve.lab.demo.train import train

    for name in ("steps", "max_hops"):
        if getattr(ns, name) < 0:
            print(f"error: --{name.replace('_', '-')} must be at least 0", file=sys.stderr)
            return 2
    for name in ("batch_size", "eval_every", "hidden_size", "intermediate_size", "heads"):
        if getattr(ns, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if ns.hidden_size % ns.heads:
        print("error: --heads must divide --hidden-size", file=sys.stderr)
        return 2
    if not ns.lr > 0:
        print("error: --lr must be positive", file=sys.stderr)
        return 2
    recipe = Recipe(ns.arch, steps=ns.steps, batch_size=ns.batch_size, lr=ns.lr, max_hops=ns.max_hops,
                    eval_every=ns.eval_every, seed=ns.seed, threads=ns.threads,
                    shape=Shape(hidden_size=ns.hidden_size, intermediate_size=ns.intermediate_size,
                                num_attention_heads=ns.heads))
    demo = demo_arches()[ns.arch]
    result = train(demo, recipe, Path(ns.out))
    print(f"wrote {result.out}: held-out accuracy {result.accuracy:.1%} at the largest setting "
          f"(hops 1..{recipe.hops(demo)}), {result.seconds:.0f} s")
    return 0
