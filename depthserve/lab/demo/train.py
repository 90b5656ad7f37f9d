"""`depthserve train-demo`: train a small adaptive-depth model on the variable-chasing task.

A plain PyTorch loop (AdamW with warm-up, a constant rate and a cosine decay over the last fifth,
seeded). Every step draws fresh problems from the training split (never a fixed pool: a model
that sees each problem once cannot learn them by heart) and builds one sequence per problem that
asks about every variable, the problem's own question first, answered and closed with </s> (the
exact text a user sends and the reply the model should give), then the other variables'
questions, unanswered:

    c=4 x=8 f=c h=f h? 4 f? x? c?        targets: 4 after h?, </s> after 4, 4 8 4 after f? x? c?

The loss is the cross-entropy of those targets at every depth the architecture's training
forward reads out (`Trainable.readouts`: every loops / depth setting from one run for PUT and
Dreamer, a setting drawn per batch for ITT), each depth on the questions within its reach (a
question of k hops needs k layer passes). Chain lengths come as a curriculum: level L draws
problems whose chains are at most L statements long, and training moves up a level once the
level's longest problems are answered at the largest setting (held-out check); problems of one
hop are learnt in a few hundred steps, and every level after that reuses the same lookup one
pass later. The result is a native checkpoint, calibrated for ITT.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from depthserve.lab.demo.kit import DemoArch, Shape, Trainable
from depthserve.demo.task import Problem, chase, definitions, draw, problems
from depthserve.demo.tokenizer import question, save_tokenizer


@dataclass(frozen=True)
class Recipe:
    arch: str
    steps: int = 0  # optimizer steps (0: the architecture's own, DemoArch.steps)
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    max_hops: int = 0  # the task: hops 1..max_hops (0: the hops the architecture's largest setting reaches)
    advance_at: float = 0.9  # held-out accuracy on a level's longest chains that moves training up a level
    eval_every: int = 250
    eval_problems: int = 200
    seed: int = 0
    shape: Shape = Shape()
    threads: int = 0  # torch threads (0: torch's default)

    def hops(self, demo: DemoArch) -> int:
        return self.max_hops or demo.max_hops

    def num_steps(self, demo: DemoArch) -> int:
        return self.steps or demo.steps

    def command(self) -> str:
        """The `depthserve train-demo` command line that reproduces this recipe (the out dir aside)."""
        default = Recipe(self.arch)
        parts = [f"depthserve train-demo --arch {self.arch}"]
        for name in ("steps", "batch_size", "lr", "max_hops", "eval_every", "seed", "threads"):
            if getattr(self, name) != getattr(default, name):
                parts.append(f"--{name.replace('_', '-')} {getattr(self, name)}")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads"):
            if getattr(self.shape, name) != getattr(default.shape, name):
                parts.append(f"--{'heads' if name == 'num_attention_heads' else name.replace('_', '-')} "
                             f"{getattr(self.shape, name)}")
        return " ".join(parts)


@dataclass
class TrainResult:
    out: Path
    curve: list[dict[str, Any]]  # per evaluation: step, mean loss since the last, level, accuracies
    accuracy: float  # held-out (eval_problems), at the largest setting
    seconds: float


@dataclass(frozen=True)
class Target:
    position: int  # the token whose next-token logits are scored
    token: int
    hops: int  # the depth it needs (0: any depth, e.g. </s> after an answer)


def training_sequence(problem: Problem, vocab: dict[str, int], eos: int, rng: random.Random
                      ) -> tuple[list[int], list[Target]]:
    """The problem's prompt, its answer and </s>, then every other variable's question (module doc)."""
    words = problem.prompt.split()
    values = definitions(problem.prompt)
    ids = [vocab[w] for w in words] + [vocab[problem.answer]]
    targets = [Target(len(words) - 1, vocab[problem.answer], problem.hops), Target(len(words), eos, 0)]
    asked = words[-1].rstrip("?")
    others = [name for name in values if name != asked]
    rng.shuffle(others)
    for name in others:
        digit, hops = chase(values, name)
        targets.append(Target(len(ids), vocab[digit], hops))
        ids.append(vocab[question(name)])
    return ids, targets


def pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, n] and the real-token mask."""
    n = max(map(len, rows))
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        valid[i, : len(row)] = True
    return ids, valid


def training_loss(model: Trainable, batch: list[Problem], vocab: dict[str, int], eos: int, pad_id: int,
                  rng: random.Random) -> torch.Tensor:
    """Mean cross-entropy over every target of the batch at every readout whose reach covers it."""
    rows, targets = zip(*(training_sequence(p, vocab, eos, rng) for p in batch))
    ids, valid = pad(list(rows), pad_id)
    row = torch.tensor([i for i, ts in enumerate(targets) for _ in ts])
    position = torch.tensor([t.position for ts in targets for t in ts])
    token = torch.tensor([t.token for ts in targets for t in ts])
    hops = torch.tensor([t.hops for ts in targets for t in ts])
    terms = [F.cross_entropy(logits[row, position], token, reduction="none")[hops <= reach]
             for reach, logits in model.readouts(ids, valid, rng)]
    return torch.cat(terms).mean()


def accuracy(model: Trainable, batch: list[Problem], vocab: dict[str, int], pad_id: int,
             setting: dict[str, Any]) -> float:
    """Share of the prompts' questions answered right (greedy) at one setting."""
    rows = [[vocab[w] for w in p.prompt.split()] for p in batch]
    ids, valid = pad(rows, pad_id)
    with torch.no_grad():
        logits = model.logits(ids, valid, setting)
    predicted = logits[torch.arange(len(rows)), torch.tensor([len(r) - 1 for r in rows])].argmax(-1)
    return float((predicted == torch.tensor([vocab[p.answer] for p in batch])).float().mean())


def write_initial(arch: DemoArch, recipe: Recipe, out: Path):
    from depthserve.loading.checkpoint import write_checkpoint

    tokenizer = save_tokenizer(out)
    cfg, weights = arch.initial(recipe.shape, tokenizer)
    write_checkpoint(out, cfg, weights, tokenizer)
    return cfg, tokenizer


def train(arch: DemoArch, recipe: Recipe, out: Path, progress: bool = True) -> TrainResult:
    """Train `recipe` of the demo architecture `arch` and write the checkpoint to `out`."""
    from tqdm import tqdm

    from depthserve.loading.checkpoint import write_checkpoint

    hops, num_steps = recipe.hops(arch), recipe.num_steps(arch)
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    out = Path(out)
    cfg, tokenizer = write_initial(arch, recipe, out)
    vocab, eos, pad_id = tokenizer.get_vocab(), tokenizer.eos_token_id, tokenizer.pad_token_id
    model = arch.trainable(out)
    opt = torch.optim.AdamW(model.params.values(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    checks = [problems(recipe.seed + level, recipe.eval_problems, "held_out", level, min_hops=level)
              for level in range(1, hops + 1)]
    held_out = problems(recipe.seed, recipe.eval_problems, "held_out", hops)
    settings = arch.settings(cfg)
    level, losses, curve, start = 1, [], [], time.time()
    bar = tqdm(range(num_steps), desc=f"train-demo {recipe.arch}", disable=not progress, unit="step")
    for step in bar:
        batch = [draw(rng, "train", level) for _ in range(recipe.batch_size)]
        loss = training_loss(model, batch, vocab, eos, pad_id, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.params.values(), 1.0)
        for group in opt.param_groups:
            group["lr"] = learning_rate(recipe, step, num_steps)
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % recipe.eval_every == 0 or step + 1 == num_steps:
            at_level = accuracy(model, checks[level - 1], vocab, pad_id, settings[-1])
            smallest, largest = (accuracy(model, held_out, vocab, pad_id, s) for s in (settings[0], settings[-1]))
            recent = losses[len(curve) * recipe.eval_every:]
            curve.append({"step": step + 1, "loss": round(sum(recent) / len(recent), 4), "level": level,
                          "accuracy_at_level": round(at_level, 4), "accuracy_smallest": round(smallest, 4),
                          "accuracy_largest": round(largest, 4), "seconds": round(time.time() - start, 1)})
            if at_level >= recipe.advance_at and level < hops:
                level += 1
            bar.set_postfix(loss=f"{curve[-1]['loss']:.3f}", level=level, at_level=f"{at_level:.2f}",
                            acc=f"{smallest:.2f}..{largest:.2f}")
    final = curve[-1]["accuracy_largest"]
    write_checkpoint(out, cfg, model.export(), tokenizer)
    if arch.finish is not None:
        calibration = problems(recipe.seed, 256, "train", hops)
        arch.finish(out, [[vocab[w] for w in p.prompt.split()] for p in calibration])
    result = TrainResult(out, curve, final, time.time() - start)
    (out / "train_demo.json").write_text(json.dumps(
        {"command": recipe.command(), "recipe": {**asdict(recipe), "shape": asdict(recipe.shape)},
         "description": arch.description, "max_hops": hops, "held_out_accuracy_at_largest": final, "largest_setting": settings[-1],
         "seconds": round(result.seconds, 1), "torch_threads": torch.get_num_threads(),
         "torch": torch.__version__, "curve": curve}, indent=2) + "\n")
    return result


def learning_rate(recipe: Recipe, step: int, num_steps: int) -> float:
    """Linear warm-up, constant (the curriculum's levels arrive at unknown steps), and a cosine decay
    over the last fifth of the `num_steps`."""
    warm = min(1.0, (step + 1) / recipe.warmup)
    decay_start = 0.8 * num_steps
    fraction = max(0.0, (step - decay_start) / (num_steps - decay_start))
    return recipe.lr * warm * 0.5 * (1 + math.cos(math.pi * fraction))
