"""Sampler: processing order, truncation, seeded determinism, distribution, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from depthserve.sampler import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_generator,
    prompt_logprobs,
    sample_inverse_cdf,
)
from depthserve.sampling_params import SamplingParams

EOS = 2


def row(params: SamplingParams, prompt=(5,), output=(), generator=None) -> SamplingRow:
    if generator is None and params.seed is not None:
        generator = make_generator(params.seed)
    return SamplingRow(params=params, generator=generator, prompt_token_ids=list(prompt),
                       output_token_ids=list(output))


def tokens(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return [s.token_id for s in sampler(logits, rows)]


def random_logits(batch: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * scale


# ---- greedy, bias, penalties, min_tokens -----------------------------------------------------------
def test_greedy_is_argmax_first_max_on_ties():
    logits = random_logits(6, 300, seed=1)
    logits[3, 17] = logits[3, 200] = 100.0  # tie: the first index wins
    sampler = Sampler({EOS}, 300)
    got = tokens(sampler, logits, [row(SamplingParams(temperature=0.0)) for _ in range(6)])
    assert got == logits.argmax(dim=-1).tolist()
    assert got[3] == 17


def test_logit_bias_forces_and_forbids_tokens():
    vocab = 50
    logits = random_logits(2, vocab, seed=2)
    low = int(logits[0].argmin())
    top = int(logits[1].argmax())
    logits[1, top] += 2.0  # a clear favourite (p > 0.7), so "most common" is not a coin flip
    sampler = Sampler({EOS}, vocab)
    forced = row(SamplingParams(temperature=0.0, logit_bias={low: 100.0}))
    assert tokens(sampler, logits[:1], [forced]) == [low]
    # A -100 bias on the most likely token (and temperature sampling) makes it practically impossible.
    torch.manual_seed(0)
    many = logits[1:].repeat(500, 1)
    banned = [row(SamplingParams(temperature=1.0, logit_bias={top: -100.0})) for _ in range(500)]
    assert top not in tokens(sampler, many, banned)
    # Without the bias it is the most common choice.
    free = Counter(tokens(sampler, many, [row(SamplingParams(temperature=1.0)) for _ in range(500)]))
    assert free.most_common(1)[0][0] == top


def test_repetition_penalty_matches_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    sampler = Sampler({EOS}, 6)
    r = row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1, 1], output=[4])
    got = sampler.processed_logits(logits, [r])
    # Seen tokens 0, 1, 4 (once each, however often they occur): positive / 2, negative * 2.
    expected = torch.tensor([[1.0, -2.0, 0.5, 3.0, -4.0, 1.0]])
    assert got[0].tolist() == pytest.approx(expected[0].tolist())
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]))  # input untouched


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]])
    sampler = Sampler({EOS}, 4)
    assert tokens(sampler, logits, [row(SamplingParams(temperature=0.0), prompt=[0])]) == [0]
    penalized = row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0])
    assert tokens(sampler, logits, [penalized]) == [1]  # 3 / 2 = 1.5 < 2


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    sampler = Sampler({EOS}, 5)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Token 0 only in the prompt: no penalty. Token 1 once, token 3 three times in the output.
    r = row(params, prompt=[0, 0, 0], output=[3, 1, 3, 3])
    got = sampler.processed_logits(logits, [r])
    expected = torch.tensor([[1.0, 1.0 - 0.5 - 0.25, 1.0, 1.0 - 0.5 - 0.75, 1.0]])
    assert got[0].tolist() == pytest.approx(expected[0].tolist())


def test_penalties_compose_in_order():
    logits = torch.tensor([[2.0, -1.0, 4.0]])
    sampler = Sampler({EOS}, 3)
    params = SamplingParams(logit_bias={1: 3.0}, repetition_penalty=2.0, presence_penalty=1.0,
                            frequency_penalty=0.5)
    r = row(params, prompt=[0], output=[1, 1])
    # token 0: 2 / 2 = 1. token 1: (-1 + 3) / 2 - 1 - 0.5 * 2 = -1. token 2: untouched.
    expected = torch.tensor([[1.0, -1.0, 4.0]])
    assert sampler.processed_logits(logits, [r])[0].tolist() == pytest.approx(expected[0].tolist())


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    vocab = 10
    logits = torch.zeros(1, vocab)
    logits[0, EOS] = 50.0
    logits[0, 7] = 40.0
    logits[0, 4] = 30.0
    sampler = Sampler({EOS}, vocab)
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7])
    assert tokens(sampler, logits, [row(params, output=[1, 1])]) == [4]
    assert tokens(sampler, logits, [row(params, output=[1, 1, 1])]) == [EOS]
    # With ignore_eos, eos does not stop the sequence, so only the stop token ids are banned.
    free_eos = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    assert tokens(sampler, logits, [row(free_eos, output=[1])]) == [EOS]
    # The ban holds for sampled rows too.
    torch.manual_seed(0)
    sampled = [row(SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[7])) for _ in range(300)]
    got = set(tokens(sampler, logits.repeat(300, 1), sampled))
    assert EOS not in got and 7 not in got


# ---- truncation ---------------------------------------------------------------------------------
def test_top_k_one_and_tiny_top_p_and_full_min_p_equal_greedy():
    vocab = 1000
    logits = random_logits(32, vocab, seed=3, scale=1.0)
    sampler = Sampler({EOS}, vocab)
    greedy = logits.argmax(dim=-1).tolist()
    torch.manual_seed(0)
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0),
                   SamplingParams(top_k=1, temperature=5.0, seed=4)):
        assert tokens(sampler, logits, [row(params) for _ in range(32)]) == greedy, params


def test_top_k_keeps_exactly_the_k_most_likely():
    vocab = 20
    logits = torch.arange(vocab, dtype=torch.float32).flip(0).unsqueeze(0) * 0.1  # token 0 best
    sampler = Sampler({EOS}, vocab)
    torch.manual_seed(0)
    params = SamplingParams(top_k=3)
    got = Counter(tokens(sampler, logits.repeat(2000, 1), [row(params) for _ in range(2000)]))
    assert set(got) == {0, 1, 2}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    sampler = Sampler({EOS}, 4)
    torch.manual_seed(0)
    for top_p, allowed in ((0.45, {0}), (0.55, {0, 1}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (0.97, {0, 1, 2, 3})):
        params = SamplingParams(top_p=top_p)
        rows = [row(params) for _ in range(3000)]
        assert set(tokens(sampler, logits.repeat(3000, 1), rows)) == allowed, top_p


def test_min_p_drops_tokens_below_the_scaled_max():
    probs = torch.tensor([[0.5, 0.26, 0.14, 0.1]])
    sampler = Sampler({EOS}, 4)
    torch.manual_seed(0)
    # min_p 0.25: threshold 0.125 keeps 0, 1, 2; min_p 0.5: threshold 0.25 keeps 0, 1.
    for min_p, allowed in ((0.25, {0, 1, 2}), (0.5, {0, 1})):
        params = SamplingParams(min_p=min_p)
        rows = [row(params) for _ in range(3000)]
        assert set(tokens(sampler, probs.log().repeat(3000, 1), rows)) == allowed, min_p


def test_truncation_building_blocks_exactly():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    p = probs.clone()
    apply_top_k(p, [2, 0, 1])
    assert torch.equal(p, torch.tensor([[0.0, 0.4, 0.0, 0.3], [0.25, 0.25, 0.25, 0.25], [0.7, 0, 0, 0]]))
    p = probs.clone() * 3  # unnormalized rows work the same
    apply_top_p(p, [0.65, 0.3, 1.0])
    assert (p > 0).tolist() == [[False, True, False, True], [True, True, True, True], [True] * 4]
    p = probs.clone()
    apply_min_p(p, [0.6, 0.0, 0.15])  # thresholds 0.24, 0, 0.105
    assert (p > 0).tolist() == [[False, True, False, True], [True] * 4, [True, False, False, False]]


def _top_p_reference(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Kept-token mask by a full sort in float64."""
    values, order = probs.double().sort(descending=True)
    drop_sorted = values.cumsum(0) - values >= top_p * values.sum()
    keep = torch.ones_like(probs, dtype=torch.bool)
    keep[order[drop_sorted]] = False
    return keep


@pytest.mark.parametrize("scale", [0.5, 2.0, 8.0])
def test_top_p_matches_a_full_sort_for_small_and_large_nuclei(scale):
    # Flat rows put the nucleus edge far beyond the first top-k look (the histogram path).
    g = torch.Generator().manual_seed(int(scale * 10))
    probs = torch.softmax(torch.randn(12, 5000, generator=g) * scale, dim=-1) * 3.0
    top_p = [0.05, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99, 0.2, 0.6, 0.8, 0.999, 1.0]
    got = probs.clone()
    apply_top_p(got, top_p)
    sizes = []
    for i, p in enumerate(top_p):
        expected = _top_p_reference(probs[i], p)
        mismatches = int(((got[i] > 0) != expected).sum())
        assert mismatches <= 1, (p, mismatches)  # float32 vs float64 sums may move the edge by one token
        assert torch.equal(got[i][got[i] > 0], probs[i][got[i] > 0])  # kept probabilities untouched
        sizes.append(int(expected.sum()))
    if scale == 0.5:
        assert max(sizes[:-1]) > 1000  # really exercised the large-nucleus path


def test_inverse_cdf_hits_each_token_in_proportion_and_never_a_zero():
    vocab = 1000  # 3 full chunks of 256 and a partial one
    g = torch.Generator().manual_seed(5)
    probs = torch.rand(vocab, generator=g)
    probs[torch.rand(vocab, generator=g) < 0.5] = 0.0
    probs[0] = probs[255] = probs[256] = probs[vocab - 1] = 0.01  # chunk edges
    n = 10_000
    uniforms = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # a regular grid over [0, 1)
    # A grid of u's maps onto the cdf: each token is hit n * p times, give or take one.
    counts = torch.bincount(sample_inverse_cdf(probs.expand(n, vocab), uniforms), minlength=vocab).double()
    expected = probs.double() / probs.double().sum() * n
    assert float((counts - expected).abs().max()) <= 1.0 + 1e-6
    assert int(counts[probs == 0].sum()) == 0
    # u just below 1 lands on the last token of non-zero probability.
    last = int(probs.nonzero().max())
    assert sample_inverse_cdf(probs.unsqueeze(0), torch.tensor([1.0 - 2**-53], dtype=torch.float64)).item() == last


# ---- randomness -----------------------------------------------------------------------------------
def _step_logits(step: int, vocab: int) -> torch.Tensor:
    return random_logits(1, vocab, seed=1000 + step, scale=2.0)[0]


def _run_seeded(position: int, others: list[SamplingParams], params: SamplingParams, steps: int,
                vocab: int) -> list[int]:
    """Decode `steps` tokens for one seeded sequence placed at `position` among other rows."""
    sampler = Sampler({EOS}, vocab)
    generator = make_generator(params.seed)
    out: list[int] = []
    other_rows = [row(p) for p in others]
    for step in range(steps):
        batch_rows = list(other_rows)
        batch_rows.insert(position, row(params, prompt=[1, 2, 3], output=out, generator=generator))
        logits = random_logits(len(batch_rows), vocab, seed=step)  # others: arbitrary
        logits[position] = _step_logits(step, vocab)
        out.append(sampler(logits, batch_rows)[position].token_id)
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(seed=123),
    SamplingParams(seed=7, temperature=0.7, top_p=0.9, top_k=40, min_p=0.02, repetition_penalty=1.2,
                   presence_penalty=0.3, frequency_penalty=0.2, logprobs=3),
])
def test_seeded_rows_are_reproducible_whatever_the_batch(params):
    vocab, steps = 512, 12
    alone = _run_seeded(0, [], params, steps, vocab)
    mixed = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=99, top_p=0.5),
             SamplingParams(top_k=5, temperature=2.0), SamplingParams(min_p=0.3, seed=5)]
    torch.manual_seed(1)
    assert _run_seeded(3, mixed, params, steps, vocab) == alone
    torch.manual_seed(2)
    assert _run_seeded(1, mixed[:2], params, steps, vocab) == alone
    assert _run_seeded(0, [SamplingParams(seed=params.seed)] * 4, params, steps, vocab) == alone
    assert len(set(alone)) > 3  # it really samples
    other_seed = SamplingParams(**{**params.__dict__, "seed": params.seed + 1})
    assert _run_seeded(0, [], other_seed, steps, vocab) != alone


def test_unseeded_sampling_matches_softmax():
    vocab, draws = 8, 8000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -3.0]])
    for temperature in (1.0, 0.5):
        expected = torch.softmax(logits[0] / temperature, dim=-1) * draws
        torch.manual_seed(1234)
        sampler = Sampler({EOS}, vocab)
        params = SamplingParams(temperature=temperature)
        got = Counter(tokens(sampler, logits.repeat(draws, 1), [row(params) for _ in range(draws)]))
        observed = torch.tensor([got.get(t, 0) for t in range(vocab)], dtype=torch.float32)
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < 30.0, (temperature, chi2, observed, expected)  # df = 7: p < 1e-4 to fail


def test_seeded_sampling_matches_softmax_too():
    # One seeded generator drawn over many steps behaves like the distribution.
    vocab, draws = 4, 1000
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    sampler = Sampler({EOS}, vocab)
    r = row(SamplingParams(seed=42))
    got = Counter(sampler(logits, [r])[0].token_id for _ in range(draws))
    expected = torch.softmax(logits[0], dim=-1) * draws
    observed = torch.tensor([got.get(t, 0) for t in range(vocab)], dtype=torch.float32)
    assert float(((observed - expected) ** 2 / expected).sum()) < 25.0


def test_padded_vocabulary_columns_are_never_sampled():
    logits = torch.zeros(64, 12)
    logits[:, 10:] = 30.0  # padding beyond the real vocabulary
    sampler = Sampler({EOS}, 10)
    got = tokens(sampler, logits, [row(SamplingParams(temperature=t)) for t in [0.0, 1.0] * 32])
    assert max(got) < 10


# ---- logprobs -------------------------------------------------------------------------------------
def test_logprobs_rank_and_top_describe_the_raw_distribution():
    vocab = 300
    logits = random_logits(5, vocab, seed=9)
    raw = torch.log_softmax(logits, dim=-1)
    sampler = Sampler({EOS}, vocab)
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=5)),
        row(SamplingParams(temperature=0.3, repetition_penalty=1.5, logit_bias={11: 8.0}, logprobs=2),
            prompt=list(range(50))),
        row(SamplingParams(seed=1, logprobs=0)),
        row(SamplingParams(logprobs=None)),
        row(SamplingParams(temperature=0.0, logit_bias={int(logits[4].argmin()): 100.0}, logprobs=20)),
    ]
    out = sampler(logits, rows)
    for i, (s, r) in enumerate(zip(out, rows)):
        assert math.isclose(s.logprob, float(raw[i, s.token_id]), abs_tol=1e-5)
        if r.params.logprobs is None:
            assert s.rank == 0 and s.top_logprobs == []
            continue
        assert s.rank == int((raw[i] > raw[i, s.token_id]).sum()) + 1
        k = r.params.logprobs
        values, ids = raw[i].topk(k)
        assert [t for t, _ in s.top_logprobs] == ids.tolist()
        assert [lp for _, lp in s.top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)
    assert out[0].rank == 1 and out[0].top_logprobs[0][0] == out[0].token_id
    assert out[4].token_id == int(logits[4].argmin()) and out[4].rank == vocab  # forced by bias


def test_logprobs_of_logits_spread_wider_than_the_exp_floor():
    """Logits spread over hundreds (and banned -inf entries): the floored normalizer still gives
    torch's log_softmax (the floor only spares the CPU denormal arithmetic)."""
    vocab = 5000
    logits = random_logits(3, vocab, seed=12, scale=60.0)
    logits[1, ::3] = float("-inf")
    logits[2] = torch.linspace(-400.0, 5.0, vocab)
    peak = logits.amax(dim=-1, keepdim=True)
    unfloored = logits - ((logits - peak).exp().sum(dim=-1, keepdim=True).log() + peak)  # same fp32 steps
    exact = torch.log_softmax(logits.double(), dim=-1)
    sampler = Sampler({EOS}, vocab)
    out = sampler(logits, [row(SamplingParams(temperature=0.0, logprobs=3)) for _ in range(3)])
    for i, s in enumerate(out):
        assert s.token_id == int(logits[i].argmax())
        assert s.logprob == float(unfloored[i, s.token_id])
        # fp32 rounding of logits near |peak| (~200 here) is ~1e-5; the floor adds nothing to it.
        tol = 4 * torch.finfo(torch.float32).eps * max(1.0, float(peak[i].abs()))
        assert math.isclose(s.logprob, float(exact[i, s.token_id]), abs_tol=tol)
        assert [lp for _, lp in s.top_logprobs] == pytest.approx(exact[i].topk(3).values.tolist(), abs=tol)


def test_prompt_logprobs():
    logits = random_logits(6, 100, seed=10)
    targets = torch.tensor([3, 50, 99, 0, int(logits[4].argmax()), 7])
    raw = torch.log_softmax(logits, dim=-1)
    got = prompt_logprobs(logits, targets, 4)
    assert len(got) == 6
    for i, (lp, rank, top) in enumerate(got):
        t = int(targets[i])
        assert lp == pytest.approx(float(raw[i, t]), abs=1e-6)
        assert rank == int((raw[i] > raw[i, t]).sum()) + 1
        values, ids = raw[i].topk(4)
        assert [a for a, _ in top] == ids.tolist()
        assert [b for _, b in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert got[4][1] == 1
    assert all(top == [] for _, _, top in prompt_logprobs(logits, targets, 0))


# ---- non-finite logits ----------------------------------------------------------------------------
def test_non_finite_logits_are_sanitised_and_a_row_with_no_finite_score_fails_alone():
    from depthserve.sampler import SamplingFault

    vocab = 300
    logits = random_logits(5, vocab, seed=21)
    logits[0, 40] = float("inf")  # greedy takes the +inf token
    logits[1, :150] = float("nan")  # NaN tokens are never sampled
    logits[2] = float("nan")  # no finite score at all: this row fails, alone
    logits[3, 7] = 3e38  # 3e38 / 0.05 overflows to inf under temperature
    sampler = Sampler({EOS}, vocab)
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=1.0, seed=1)),
            row(SamplingParams(temperature=0.7, seed=2)), row(SamplingParams(temperature=0.05, seed=3)),
            row(SamplingParams(temperature=0.9, seed=4, repetition_penalty=1.3), prompt=(1, 2, 3))]
    out = sampler(logits, rows)
    assert out[0].token_id == 40
    assert out[1].token_id >= 150
    assert isinstance(out[2], SamplingFault) and "NaN" in out[2].reason
    assert out[3].token_id == 7
    fresh = [row(SamplingParams(temperature=0.9, seed=4, repetition_penalty=1.3), prompt=(1, 2, 3))]
    assert out[4].token_id == sampler(logits[4:], fresh)[0].token_id  # the other rows are unaffected
    assert all(math.isfinite(t.logprob) for i, t in enumerate(out) if i != 2)


@pytest.mark.parametrize("field, value", [("repetition_penalty", 1e-40), ("repetition_penalty", 0.0),
                                          ("repetition_penalty", 11.0), ("temperature", float("inf")),
                                          ("top_k", -5), ("seed", 2**64), ("presence_penalty", float("nan"))])
def test_every_sampling_parameter_has_a_finite_range(field, value):
    from depthserve.errors import InvalidSamplingParamsError

    with pytest.raises(InvalidSamplingParamsError, match=field):
        SamplingParams(**{field: value})


def test_the_native_greedy_pick_gives_what_the_torch_path_gives():
    from depthserve.kernels import cpu_native

    if cpu_native.unavailable_reason() is not None:
        pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    logits = random_logits(9, 1003, seed=4, scale=6.0)  # a vocabulary padded past the sampler's 1000
    logits[2, 10] = logits[2, 500] = 50.0
    logits[5, :600] = float("-inf")
    rows = [row(SamplingParams(temperature=0.0, logprobs=3)) for _ in range(9)]
    plain = Sampler({EOS}, 1000)(logits.clone(), rows)
    native = Sampler({EOS}, 1000, greedy_pick=cpu_native.greedy_pick)(logits.clone(), rows)
    for a, b in zip(plain, native):
        assert (a.token_id, a.rank) == (b.token_id, b.rank)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        assert [v for _, v in a.top_logprobs] == pytest.approx([v for _, v in b.top_logprobs], abs=1e-5)
    nan = logits.clone()
    nan[1, 3] = float("nan")  # the native call reports it; the torch path handles the step
    assert Sampler({EOS}, 1000, greedy_pick=cpu_native.greedy_pick)(nan, rows)[1].token_id == plain[1].token_id
