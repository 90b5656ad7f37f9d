"""The demo task (variable chasing in a straight-line program) and its word-level tokenizer."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from depthserve.demo.task import CHAINS, chase, definitions, make_problem, problems, solve, split_of
from depthserve.demo.tokenizer import save_tokenizer, vocabulary


def test_problems_are_seeded_solvable_and_in_their_split():
    first = problems(3, 300, "train", max_hops=4)
    assert first == problems(3, 300, "train", max_hops=4)
    assert first != problems(4, 300, "train", max_hops=4)
    for problem in first:
        assert problem.split == "train" and solve(problem.prompt) == problem.answer
        assert problem.prompt.split()[-1].endswith("?") and problem.answer.isdigit()
        assert chase(definitions(problem.prompt), problem.prompt.split()[-1][:-1]) == (problem.answer, problem.hops)
    assert Counter(p.hops for p in first).keys() == {1, 2, 3, 4}


def test_held_out_problems_never_appear_in_training():
    held_out = {p.prompt for p in problems(0, 300, "held_out", max_hops=3)}
    train = {p.prompt for p in problems(0, 3000, "train", max_hops=3)}
    assert len(held_out) > 250 and not held_out & train
    assert all(split_of(prompt) == "held_out" for prompt in held_out)


def test_every_variable_is_defined_before_use_and_the_chains_are_distinct():
    for seed in range(200):
        problem = make_problem(random.Random(seed), hops=4, max_hops=6)
        statements = problem.prompt.split()[:-1]
        defined: set[str] = set()
        for statement in statements:
            name, value = statement.split("=")
            assert value.isdigit() or value in defined  # causal attention can see what it reads
            assert name not in defined  # each variable assigned once
            defined.add(name)
        digits = [s.split("=")[1] for s in statements if s.split("=")[1].isdigit()]
        assert len(digits) == CHAINS == len(set(digits))  # one digit per chain, all different


def test_the_answer_needs_every_hop_of_the_right_chain():
    problem = make_problem(random.Random(5), hops=3, max_hops=3)
    values = definitions(problem.prompt)
    name = problem.prompt.split()[-1][:-1]
    for _ in range(problem.hops - 1):
        name = values[name]
        assert not name.isdigit()
    assert values[name] == problem.answer
    # Changing the asked chain's digit changes the answer; another chain's digit does not.
    other = next(v for k, v in values.items() if v.isdigit() and v != problem.answer)
    assert solve(problem.prompt.replace(f"={problem.answer}", "=#")) == "#"
    assert solve(problem.prompt.replace(f"={other}", "=#")) == problem.answer


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="split"):
        problems(0, 1, "test", 3)
    with pytest.raises(ValueError, match="variables"):
        problems(0, 1, "train", max_hops=9)
    with pytest.raises(ValueError, match="hops"):
        make_problem(random.Random(0), hops=4, max_hops=3)


def test_tokenizer_is_one_token_per_word_and_loads_as_a_checkpoint_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    problem = problems(1, 1, "train", max_hops=3)[0]
    text = problem.prompt + " " + problem.answer
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.split())
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids[-1:]) == problem.answer
    assert tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<pad>"
    assert len(tokenizer) == len(vocabulary()) == 3 + 10 + 26 + 26 * 35
    with pytest.raises(Exception):
        tokenizer.encode("a=bb", add_special_tokens=False)
