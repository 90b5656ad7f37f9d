"""The demo task (k-hop variable chasing) and its character-level tokenizer."""

from __future__ import annotations

from collections import Counter

import pytest

from depthserve.demo.task import Problem, make_problem, problems, solve, split_of
from depthserve.demo.tokenizer import CHARACTERS, save_tokenizer


def test_problems_are_seeded_solvable_and_in_their_split():
    first = problems(3, 200, "train", max_hops=4)
    assert first == problems(3, 200, "train", max_hops=4)
    assert first != problems(4, 200, "train", max_hops=4)
    for problem in first:
        assert problem.split == "train" and solve(problem.prompt) == problem.answer
        assert problem.prompt.endswith("=?") and problem.answer.isdigit()
    assert Counter(p.hops for p in first).keys() == {1, 2, 3, 4}


def test_held_out_problems_never_appear_in_training():
    held_out = {p.prompt for p in problems(0, 300, "held_out", max_hops=3)}
    train = {p.prompt for p in problems(0, 3000, "train", max_hops=3)}
    assert len(held_out) > 250 and not held_out & train
    assert all(split_of(prompt) == "held_out" for prompt in held_out)


def test_the_answer_needs_every_hop_and_the_right_chain():
    import random

    problem = make_problem(random.Random(5), hops=3, distractor_hops=2)
    statements = problem.prompt.split(";")[:-1]
    assert len(statements) == (3 + 1) + (2 + 1)
    # The digit sits at the far end of the question's chain: changing it changes the answer,
    # changing the other chain's digit does not.
    values = dict(s.split("=") for s in statements)
    name = problem.prompt.split(";")[-1][:-2]
    for _ in range(problem.hops):
        name = values[name]
    assert values[name] == problem.answer
    digits = [v for v in values.values() if v.isdigit()]
    assert len(digits) == 2


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="split"):
        problems(0, 1, "test", 3)
    with pytest.raises(ValueError, match="hops"):
        problems(0, 1, "train", max_hops=20)


def test_tokenizer_is_one_token_per_character_and_loads_as_a_checkpoint_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    problem = Problem("f=c;c=4;h=f;h=?", "4", 2)
    ids = tokenizer.encode(problem.prompt + problem.answer, add_special_tokens=False)
    assert len(ids) == len(problem.prompt) + 1
    assert tokenizer.decode(ids) == problem.prompt + problem.answer
    assert len(set(tokenizer.convert_ids_to_tokens(ids))) == len(set(problem.prompt + problem.answer))
    assert tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<pad>"
    assert len(tokenizer) == len(CHARACTERS) + 3
