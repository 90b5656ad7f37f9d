"""`depthserve train-demo`: train a small adaptive-depth model on the variable-chasing task.

A plain PyTorch loop (AdamW with warm-up, a constant rate and a cosine decay over the last fifth,
seeded): each batch draws problems from the training split and a depth setting
(`DemoArch.sample_setting`), and the loss is the answer digit's cross-entropy at question marks.
A training sequence asks about every variable of its problem, the problem's own question first
(so the first question is exactly the prompt a user sends) and the others after it, with no
answer written anywhere in the sequence (nothing to copy): `f=c;c=4;q=x;h=f;x=8;h=?;c=?;x=?;f=?;q=?`,
answers 4 4 8 4 8 at the five question marks, so one problem gives questions of every hop count
up to its own. Hop levels come as a curriculum (level L: problems of 0..L hops, 0 being a plain
lookup; up a level once the level's hardest held-out problems are answered at the largest
setting): a model that cannot look one variable up cannot learn to chain lookups. The result is
a native checkpoint (with the ITT calibration table where the architecture has one).
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

from depthserve.demo.arches import DEMO_ARCHES, DemoArch, Shape, Trainable
from depthserve.demo.task import Problem, problems, solve
from depthserve.demo.tokenizer import save_tokenizer


@dataclass(frozen=True)
class Recipe:
    arch: str
    steps: int = 3000
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    max_hops: int = 3  # the task: hops 1..max_hops
    pool_size: int = 20000  # training problems drawn from, per curriculum level
    advance_at: float = 0.9  # held-out accuracy on a level's hardest problems that moves training up a level
    eval_every: int = 100
    eval_problems: int = 200
    seed: int = 0
    shape: Shape = Shape()
    threads: int = 0  # torch threads (0: torch's default)

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


def encode(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, n], the index of each row's last token, and the real-token mask."""
    rows = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    n = max(map(len, rows))
    ids = torch.full((len(rows), n), tokenizer.pad_token_id, dtype=torch.long)
    valid = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        valid[i, : len(row)] = True
    return ids, torch.tensor([len(r) - 1 for r in rows]), valid


def answer_logits(model: Trainable, tokenizer, batch: list[Problem], setting: dict[str, Any]) -> torch.Tensor:
    """The logits at each prompt's last token (its question mark) [B, V]."""
    ids, last, valid = encode(tokenizer, [p.prompt for p in batch])
    logits = model.logits(ids, {**setting, "valid": valid})
    return logits[torch.arange(len(batch)), last]


def every_question(problem: Problem, rng: random.Random) -> tuple[str, list[str]]:
    """The problem's prompt followed by a question about each of its other variables, in random
    order, and the answers of all its questions in order."""
    *statements, question = problem.prompt.split(";")
    others = [s.split("=")[0] for s in statements if s.split("=")[0] != question.split("=")[0]]
    rng.shuffle(others)
    questions = [question] + [f"{name}=?" for name in others]
    head = ";".join(statements) + ";"
    return head + ";".join(questions), [solve(head + q) for q in questions]


def training_loss(model: Trainable, tokenizer, batch: list[Problem], setting: dict[str, Any],
                  rng: random.Random) -> torch.Tensor:
    """Mean cross-entropy of the answers at every question mark of the batch's sequences."""
    texts, answers = zip(*(every_question(p, rng) for p in batch))
    ids, _, valid = encode(tokenizer, list(texts))
    logits = model.logits(ids, {**setting, "valid": valid})
    marks = ids == tokenizer.convert_tokens_to_ids("?")
    targets = torch.tensor([tokenizer.convert_tokens_to_ids(a) for row in answers for a in row])
    return F.cross_entropy(logits[marks], targets)  # row-major: each row's marks in order


def accuracy(model: Trainable, tokenizer, batch: list[Problem], setting: dict[str, Any]) -> float:
    with torch.no_grad():
        predicted = answer_logits(model, tokenizer, batch, setting).argmax(-1)
    targets = torch.tensor([tokenizer.convert_tokens_to_ids(p.answer) for p in batch])
    return float((predicted == targets).float().mean())


def write_initial(arch: DemoArch, recipe: Recipe, out: Path):
    from depthserve.loading.checkpoint import write_checkpoint

    tokenizer = save_tokenizer(out)
    cfg, weights = arch.initial(recipe.shape, tokenizer)
    write_checkpoint(out, cfg, weights, tokenizer)
    return cfg, tokenizer


def train(recipe: Recipe, out: Path, progress: bool = True) -> TrainResult:
    """Train `recipe` and write the checkpoint to `out`."""
    from tqdm import tqdm

    from depthserve.loading.checkpoint import write_checkpoint

    arch = DEMO_ARCHES[recipe.arch]
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    out = Path(out)
    cfg, tokenizer = write_initial(arch, recipe, out)
    model = arch.trainable(out)
    opt = torch.optim.AdamW(model.params.values(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    # Level L trains on problems of 0..L hops; it moves up once the hardest of its problems are
    # answered at the largest setting (held-out check), so the lookup is learnt before chaining it.
    pools = [problems(recipe.seed, recipe.pool_size, "train", level, 0) for level in range(recipe.max_hops + 1)]
    checks = [problems(recipe.seed, recipe.eval_problems, "held_out", level, level)
              for level in range(recipe.max_hops + 1)]
    held_out = problems(recipe.seed, recipe.eval_problems, "held_out", recipe.max_hops)
    settings = arch.settings(cfg)
    level, losses, curve, start = 0, [], [], time.time()
    bar = tqdm(range(recipe.steps), desc=f"train-demo {recipe.arch}", disable=not progress, unit="step")
    for step in bar:
        batch = [rng.choice(pools[level]) for _ in range(recipe.batch_size)]
        loss = training_loss(model, tokenizer, batch, arch.sample_setting(rng), rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.params.values(), 1.0)
        for group in opt.param_groups:
            group["lr"] = learning_rate(recipe, step)
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
            at_level = accuracy(model, tokenizer, checks[level], settings[-1])
            smallest, largest = (accuracy(model, tokenizer, held_out, s) for s in (settings[0], settings[-1]))
            recent = losses[len(curve) * recipe.eval_every:]
            curve.append({"step": step + 1, "loss": round(sum(recent) / len(recent), 4), "level": level,
                          "accuracy_at_level": round(at_level, 4), "accuracy_smallest": round(smallest, 4),
                          "accuracy_largest": round(largest, 4)})
            if at_level >= recipe.advance_at and level < recipe.max_hops:
                level += 1
            bar.set_postfix(loss=f"{curve[-1]['loss']:.3f}", level=level, at_level=f"{at_level:.2f}",
                            acc=f"{smallest:.2f}..{largest:.2f}")
    final = curve[-1]["accuracy_largest"]
    write_checkpoint(out, cfg, model.export(), tokenizer)
    if arch.finish is not None:
        arch.finish(out, [tokenizer.encode(p.prompt, add_special_tokens=False) for p in pools[-1][:256]])
    result = TrainResult(out, curve, final, time.time() - start)
    (out / "train_demo.json").write_text(json.dumps(
        {"command": recipe.command(), "recipe": {**asdict(recipe), "shape": asdict(recipe.shape)},
         "held_out_accuracy_at_largest": final, "largest_setting": settings[-1],
         "seconds": round(result.seconds, 1), "torch_threads": torch.get_num_threads(), "curve": curve},
        indent=2) + "\n")
    return result


def learning_rate(recipe: Recipe, step: int) -> float:
    """Linear warm-up, constant (the curriculum's levels arrive at unknown steps), and a cosine decay
    over the last fifth."""
    warm = min(1.0, (step + 1) / recipe.warmup)
    decay_start = 0.8 * recipe.steps
    fraction = max(0.0, (step - decay_start) / (recipe.steps - decay_start))
    return recipe.lr * warm * 0.5 * (1 + math.cos(math.pi * fraction))
