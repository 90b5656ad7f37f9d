"""bench/quant_fidelity.py's pure scoring: lm-eval's pair encoding, choice picks, acc / acc_norm,
perplexity from log-probs, greedy agreement, the pass criteria. No model, no data files."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import quant_fidelity as qf  # noqa: E402


def char_encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character."""
    return [ord(c) for c in text]


def word_encode(text: str) -> list[int]:
    """A stand-in tokenizer that merges a leading space into the word, as BPE does (' cat' is one
    token): ids are the hashes of the pieces, so context and continuation split like SmolLM2's."""
    pieces, current = [], ""
    for ch in text:
        if ch in " \n" and current.strip():
            pieces.append(current)
            current = ""
        current += ch
    if current:
        pieces.append(current)
    return [hash(p) % 100_003 for p in pieces]


def row(question: str, choices: list[str], answer: str) -> dict:
    labels = "ABCDE"[: len(choices)]
    return {"id": question, "question": question, "choices": {"text": choices, "label": list(labels)},
            "answerKey": answer, "gold": labels.index(answer)}


def test_encode_pair_moves_trailing_spaces_to_the_continuation():
    context, continuation = qf.encode_pair(char_encode, "Answer: ", "cat")
    assert context == char_encode("Answer:") and continuation == char_encode(" cat")
    context, continuation = qf.encode_pair(word_encode, "Question: q\nAnswer:", " big cat")
    assert context == word_encode("Question: q\nAnswer:")
    assert continuation == word_encode(" big cat") and len(continuation) == 2


def test_arc_requests_layout():
    rows = [row("Why?", ["yes", "no way"], "B"), row("Who?", ["me", "you", "them"], "A")]
    prompts, index = qf.arc_requests(rows, word_encode)
    assert [(q, c) for q, c, _ in index] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert [n for _, _, n in index] == [1, 2, 1, 1, 1]
    assert prompts[1] == word_encode("Question: Why?\nAnswer: no way")
    assert prompts[1][-2:] == word_encode(" no way")


def test_read_arc_gold_index_and_limit(tmp_path):
    path = tmp_path / "arc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [row("a", ["x", "y"], "B"), row("b", ["x", "y", "z"], "C")])
                    + "\n\n")
    rows = qf.read_arc(path)
    assert [r["gold"] for r in rows] == [1, 2]
    assert len(qf.read_arc(path, limit=1)) == 1


def test_continuation_loglik_sums_the_tail_of_a_score_row():
    scores = [None, -1.0, -2.0, -0.5, -0.25]
    assert qf.continuation_loglik(scores, 2) == -0.75
    assert qf.continuation_loglik(scores, 4) == -3.75
    with pytest.raises(ValueError):
        qf.continuation_loglik(scores, 5)  # would need position 0's missing log-prob
    with pytest.raises(ValueError):
        qf.continuation_loglik(scores, 0)


def test_group_logliks_and_picks():
    index = [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1), (1, 2, 1)]
    grouped = qf.group_logliks([-3.0, -1.0, -2.0, -2.0, -5.0], index, 2)
    assert grouped == [[-3.0, -1.0], [-2.0, -2.0, -5.0]]
    assert qf.argmax(grouped[1]) == 0  # ties: the first, as numpy
    with pytest.raises(ValueError):
        qf.group_logliks([-1.0, -2.0], [(0, 1, 1), (0, 0, 1)], 1)
    # acc picks the largest sum; acc_norm divides by the choice's characters (no leading space)
    assert qf.predictions([-4.0, -6.0], ["ab", "abcdef"]) == (0, 1)


def test_arc_metrics_acc_acc_norm_and_stderr():
    rows = [row("q1", ["a", "bbbb"], "B"), row("q2", ["a", "bb"], "A"), row("q3", ["aaa", "b"], "B"),
            row("q4", ["a", "b"], "A")]
    logliks = [[-1.0, -2.0],   # acc: a (wrong); norm: -1 vs -0.5 -> bbbb (right)
               [-1.0, -1.5],   # acc: a (right); norm: -1 vs -0.75 -> bb (wrong)
               [-3.3, -1.0],   # both: b (right)
               [-2.0, -1.0]]   # both: b (wrong)
    m = qf.arc_metrics(logliks, rows)
    assert m["pred"] == [0, 0, 1, 1] and m["pred_norm"] == [1, 1, 1, 1]
    assert m["acc"] == 0.5 and m["acc_norm"] == 0.5
    # sample std of [0, 1, 1, 0] / sqrt(4)
    assert m["acc_stderr"] == pytest.approx(math.sqrt(1 / 3) / 2)
    assert math.isnan(qf.mean_stderr([1.0]))


def test_paired_difference_in_points():
    gold = [0, 1, 2, 3]
    d = qf.paired_difference([0, 1, 0, 0], [0, 0, 2, 0], gold)  # +1 on q2, -1 on q3
    assert d["points"] == 0.0 and d["gained"] == 1 and d["lost"] == 1 and d["different_picks"] == 2
    d = qf.paired_difference([0, 1, 2, 3], [0, 1, 2, 0], gold)
    assert d["points"] == 25.0 and d["stderr_points"] == pytest.approx(100 * 0.5 / 2)


def test_perplexity_pools_every_token_past_the_first():
    rows = [[None, math.log(0.5), math.log(0.25)], [None, math.log(0.5)]]
    p = qf.perplexity(rows)
    assert p["tokens"] == 3
    assert p["nll"] == pytest.approx(math.log(2) * 4)
    assert p["perplexity"] == pytest.approx(2 ** (4 / 3))
    assert p["per_document"] == pytest.approx([2 ** 1.5, 2.0])
    with pytest.raises(ValueError):
        qf.perplexity([[None]])


def test_logprob_drift_and_finiteness():
    d = qf.logprob_drift([[None, -1.0, -2.0]], [[None, -1.5, -2.0]])
    assert d == {"mean_abs": 0.25, "max_abs": 0.5}
    assert qf.all_finite([[None, -1.0]]) and not qf.all_finite([[None, float("nan")]])
    assert not qf.all_finite([[None, float("-inf")]])


def test_greedy_agreement_counts_up_to_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    out = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]  # later matches after a divergence do not count
    g = qf.greedy_agreement(out, ref)
    assert g["prompts"] == 3 and g["identical_prompts"] == 1
    assert g["token_agreement"] == pytest.approx((4 + 2 + 0) / 12)
    assert g["identical_fraction"] == pytest.approx(1 / 3)
    assert g["first_divergence"] == [None, 2, 0]
    assert qf.greedy_agreement([[1, 2]], [[1, 2, 3]])["first_divergence"] == [2]  # a shorter output diverges
    assert qf.common_prefix([1, 2, 3], [1, 2, 4]) == 2


def test_criteria():
    ok = qf.criteria({"points": -1.0}, 1.019)
    assert ok == {"arc_acc_within_1_point": True, "c4_perplexity_within_2_percent": True, "pass": True}
    assert not qf.criteria({"points": -1.2}, 1.0)["pass"]
    assert not qf.criteria({"points": 0.0}, 0.97)["pass"]
    assert qf.criteria(None, None)["pass"] is None


def test_parse_args_quick_defaults_and_output_name(tmp_path):
    ns = qf.parse_args(["--quick", "--machine", "box", "--formats", "int8,fp32"])
    assert ns.format_names == ["fp32", "int8"] and ns.limit == 40 and ns.new_tokens == 32
    assert ns.output.name == "quant-fidelity-box-quick.json"
    full = qf.parse_args([])
    assert full.format_names == ["fp32", "default", "bf16", "int8"] and full.limit is None and full.window == 512
    assert full.output.name == "quant-fidelity-cpu-2core.json"
    with pytest.raises(SystemExit):
        qf.parse_args(["--formats", "fp8"])


def test_missing_data_exits_with_a_message(tmp_path, capsys):
    code = qf.main(["--quick", "--arc", str(tmp_path / "none.jsonl"), "--c4", str(tmp_path / "none2.jsonl"),
                    "--output", str(tmp_path / "out.json")])
    assert code == 2 and "missing" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_chunk_ranges_keep_questions_whole():
    index = [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1), (1, 2, 1), (2, 0, 1), (2, 1, 1)]
    assert qf.chunk_ranges(index, 2) == [(0, 5), (5, 7)]
    assert qf.chunk_ranges(index, 1) == [(0, 2), (2, 5), (5, 7)]
    assert qf.chunk_ranges(index, 10) == [(0, 7)]
