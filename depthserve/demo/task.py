"""The demo task: variable chasing in a straight-line program, where thinking longer is what it takes.

A problem is a short program of assignments, each variable defined before it is used, with two
unrelated chains interleaved beside the asked one; the question asks for the digit at the end of
one chain:

    c=4 x=8 f=c q=x h=f h?   ->  4        (h = f = c = 4: three hops)

Each statement is one word (one token), so looking a variable up is a single attention step, and
a chain of k statements takes k lookups, each needing the one before. A looped model can resolve
the chains level by level, every statement reading its right-hand side's definition (written
earlier, so causal attention sees it) once per pass: after t passes every variable at most t hops
from its digit holds that digit, and the question reads its own. So t passes answer exactly the
questions of at most t hops, and every extra loop, recurrence or thinking step buys one more hop:
the looped-transformer literature's k-hop and variable-tracking probes, at a size that trains on
two CPU cores. The interleaving is random, the digits of the chains differ, and the distractor
chains are as long as the asked one may be, so neither position nor length gives the answer away.

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
CHAINS = 3  # the asked chain and two distractors
HELD_OUT_SHARE = 10  # one problem in this many (by hash) is held out
SPLITS = ("train", "held_out")


@dataclass(frozen=True)
class Problem:
    prompt: str  # "c=4 x=8 f=c q=x h=f h?"
    answer: str  # "4"
    hops: int  # statements followed from the question to its digit (1: the variable holds the digit)

    @property
    def split(self) -> str:
        return split_of(self.prompt)


def split_of(prompt: str) -> str:
    digest = hashlib.sha256(prompt.encode()).digest()
    return "held_out" if int.from_bytes(digest[:8], "big") % HELD_OUT_SHARE == 0 else "train"


def make_problem(rng: random.Random, hops: int, max_hops: int, chains: int = CHAINS) -> Problem:
    """One problem whose question is `hops` statements away from its digit, beside `chains - 1`
    distractor chains of 1..max_hops statements, interleaved at random with each chain in order."""
    if not 1 <= hops <= max_hops or chains < 1:
        raise ValueError("hops must lie in 1..max_hops and there must be at least one chain")
    if chains * max_hops > len(VARIABLES) or chains > len(DIGITS):
        raise ValueError(f"{chains} chains of up to {max_hops} statements need more than {len(VARIABLES)} variables")
    lengths = [hops] + [rng.randint(1, max_hops) for _ in range(chains - 1)]
    names = rng.sample(VARIABLES, sum(lengths))
    digits = rng.sample(DIGITS, chains)
    pending: list[list[str]] = []
    for length, digit in zip(lengths, digits):
        chain, names = names[:length], names[length:]
        pending.append([f"{chain[0]}={digit}"] + [f"{chain[i]}={chain[i - 1]}" for i in range(1, length)])
    asked = pending[0][-1].split("=")[0]
    statements = []
    while any(pending):  # a uniform random interleaving of the chains, each kept in order
        chain = rng.choices(pending, weights=[len(c) for c in pending])[0]
        statements.append(chain.pop(0))
    return Problem(prompt=" ".join(statements) + f" {asked}?", answer=digits[0], hops=hops)


def problems(seed: int, count: int, split: str, max_hops: int, min_hops: int = 1,
             chains: int = CHAINS) -> list[Problem]:
    """`count` problems of one split, hops uniform in min_hops..max_hops, the same for a seed."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{seed}:{split}")
    return [draw(rng, split, max_hops, min_hops, chains) for _ in range(count)]


def draw(rng: random.Random, split: str, max_hops: int, min_hops: int = 1, chains: int = CHAINS) -> Problem:
    """A fresh problem of `split` (training draws one per sequence, so no problem is learnt by heart)."""
    while True:
        problem = make_problem(rng, rng.randint(min_hops, max_hops), max_hops, chains)
        if problem.split == split:
            return problem


def definitions(prompt: str) -> dict[str, str]:
    """Variable -> its right-hand side, from a prompt's statements."""
    return dict(word.split("=") for word in prompt.split() if "=" in word)


def chase(values: dict[str, str], name: str) -> tuple[str, int]:
    """The digit `name` holds and the statements followed to reach it."""
    hops = 0
    while name in values:
        name, hops = values[name], hops + 1
    return name, hops


def solve(prompt: str) -> str:
    """The answer by following the assignments (the task's own check)."""
    return chase(definitions(prompt), prompt.split()[-1].rstrip("?"))[0]
