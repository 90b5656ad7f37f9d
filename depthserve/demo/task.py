"""The demo task: k-hop variable chasing, where thinking longer is what it takes.

A problem assigns a digit to one variable and chains others to it, in shuffled order, with a
second, unrelated chain beside it; the question asks for the value at the end of one chain:

    f=c;c=4;q=x;h=f;x=8;h=?   ->  4        (h = f = c = 4: three hops)

Reading the answer takes one lookup per hop, each of which needs the previous one, so a model
with a fixed number of layers can only follow so many hops per pass: more recurrences, loops or
thinking steps buy more hops (the looped-transformer literature's k-hop / pointer-chasing probes).
The order is shuffled so that no position gives the answer away, and the distractor chain makes
the question's variable matter. The question is written like a statement (`h=?`), so the
question mark stands where a statement's value stands: whatever a model learns to find a
statement's variable from its value's position serves the question too.

Problems come from a seed, and every problem belongs to exactly one split, decided by a hash of
its text: the held-out split can never meet a training problem.
"""

from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass

VARIABLES = string.ascii_lowercase
DIGITS = string.digits
HELD_OUT_SHARE = 10  # one problem in this many (by hash) is held out
SPLITS = ("train", "held_out")


@dataclass(frozen=True)
class Problem:
    prompt: str  # "f=c;c=4;q=x;h=f;x=8;h=?"
    answer: str  # "4"
    hops: int  # assignments followed from the question to the digit

    @property
    def split(self) -> str:
        return split_of(self.prompt)


def split_of(prompt: str) -> str:
    digest = hashlib.sha256(prompt.encode()).digest()
    return "held_out" if int.from_bytes(digest[:8], "big") % HELD_OUT_SHARE == 0 else "train"


def make_problem(rng: random.Random, hops: int, distractor_hops: int) -> Problem:
    """One problem whose question is `hops` assignments away from its digit."""
    names = rng.sample(VARIABLES, hops + distractor_hops + 2)
    chain, other = names[: hops + 1], names[hops + 1 :]
    digit, other_digit = rng.choice(DIGITS), rng.choice(DIGITS)
    statements = [f"{chain[0]}={digit}"] + [f"{chain[i + 1]}={chain[i]}" for i in range(hops)]
    statements += [f"{other[0]}={other_digit}"] + [f"{other[i + 1]}={other[i]}" for i in range(distractor_hops)]
    rng.shuffle(statements)
    return Problem(prompt=";".join(statements) + f";{chain[-1]}=?", answer=digit, hops=hops)


def problems(seed: int, count: int, split: str, max_hops: int, min_hops: int = 1) -> list[Problem]:
    """`count` problems of one split, hops uniform in min_hops..max_hops, the same for a seed
    (0 hops: the question's variable holds the digit itself, a plain lookup)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0 <= min_hops <= max_hops or max_hops + max_hops + 2 > len(VARIABLES):
        raise ValueError(f"hops must satisfy 0 <= min_hops <= max_hops <= {(len(VARIABLES) - 2) // 2}")
    rng = random.Random(f"{seed}:{split}")
    out: list[Problem] = []
    while len(out) < count:
        hops = rng.randint(min_hops, max_hops)
        problem = make_problem(rng, hops, distractor_hops=rng.randint(0, max_hops))
        if problem.split == split:
            out.append(problem)
    return out


def solve(prompt: str) -> str:
    """The answer by following the assignments (the task's own check)."""
    *statements, question = prompt.split(";")
    values = dict(statement.split("=") for statement in statements)
    name = question.split("=")[0]
    while name in values:
        name = values[name]
    return name
