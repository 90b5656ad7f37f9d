"""The offline API on the real default model: sampling features, finish reasons, errors, cleanup."""

from __future__ import annotations

import pytest

from depthserve import LLM, DepthParams, SamplingParams
from depthserve.errors import (
    EmptyPromptError,
    InvalidDepthError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    UnknownModelError,
)


@pytest.fixture(scope="module")
def llm(smollm_llm):
    return smollm_llm  # conftest.py: shared, and checked to be left idle and holding no page after each test


def _chat(llm, text):
    return llm.apply_chat_template([{"role": "user", "content": text}])


def test_generate_accepts_strings_token_ids_and_per_prompt_params(llm):
    ids = _chat(llm, "Name a colour.")
    params = [SamplingParams(temperature=0, max_tokens=5), SamplingParams(temperature=0, max_tokens=3)]
    out_ids, out_text = llm.generate([ids, llm.tokenizer.decode(ids)], params)
    assert len(out_ids.token_ids) <= 5 and len(out_text.token_ids) <= 3
    assert out_ids.token_ids[:3] == out_text.token_ids  # same tokens whichever way the prompt came
    assert out_ids.text == llm.tokenizer.decode(out_ids.token_ids, skip_special_tokens=True)


def test_finish_reasons_length_eos_stop_string_and_stop_token(llm):
    ids = _chat(llm, "What is the capital of France?")
    greedy = SamplingParams(temperature=0, max_tokens=64)
    free = llm.generate([ids], greedy)[0]
    assert free.finish_reason == "stop" and free.outputs[0].stop_reason is None  # eos
    assert "Paris" in free.text
    short = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0]
    assert short.finish_reason == "length" and short.token_ids == free.token_ids[:2]
    stopped = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, stop=["Paris"]))[0]
    assert stopped.finish_reason == "stop" and stopped.outputs[0].stop_reason == "Paris"
    assert "Paris" not in stopped.text and free.text.startswith(stopped.text)
    kept = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, stop=["Paris"],
                                              include_stop_str_in_output=True))[0]
    assert kept.text == stopped.text + "Paris"
    token = free.token_ids[1]
    by_id = llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[token]))[0]
    assert by_id.token_ids == free.token_ids[:2] and by_id.outputs[0].stop_reason == token
    forced = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert len(forced.token_ids) == 12 and forced.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    ids = _chat(llm, "Tell me a story about a dragon.")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([ids], seeded)[0].token_ids
    again = llm.generate([ids], seeded)[0].token_ids
    noise = SamplingParams(temperature=1.2, max_tokens=16, ignore_eos=True)
    others = [_chat(llm, f"Count to {i}.") for i in range(5)]
    batch = llm.generate(others[:2] + [ids] + others[2:], [noise, noise, seeded, noise, noise, noise])
    other_seed = llm.generate([ids], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=99,
                                                    ignore_eos=True))[0].token_ids
    assert alone == again == batch[2].token_ids
    assert other_seed != alone


def test_n_returns_distinct_samples(llm):
    ids = _chat(llm, "Suggest a name for a cat.")
    out = llm.generate([ids], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_logprobs_and_top_alternatives(llm):
    ids = _chat(llm, "Say hello.")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3
        assert all(lp.logprob <= entry[token].logprob + 1e-6 for lp in entry.values())
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_score_matches_prompt_logprobs_and_is_aligned(llm):
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    (scores,) = llm.score([ids])
    assert scores[0] is None and len(scores) == len(ids)
    assert all(s <= 0 for s in scores[1:])
    # Scoring a prefix gives the same numbers as the full prompt's first entries, to fp32 summation
    # order: the two prompts' GEMMs have different row counts, which MKL blocks differently (measured:
    # up to 6.7e-6 apart on torch's ops, 1.2e-5 on the native CPU kernels, at |logprob| 6.3, i.e.
    # 2e-6 relative); a misaligned or wrong score is off by far more.
    (prefix_scores,) = llm.score([ids[:5]])
    assert prefix_scores[1:] == pytest.approx(scores[1:5], rel=5e-6, abs=1e-5)


def test_prefix_cache_hit_gives_the_same_output(llm):
    ids = _chat(llm, "Describe the water cycle in detail, step by step, for a ten year old. " * 3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate([ids], params)[0]
    second = llm.generate([ids], params)[0]
    assert second.num_cached_tokens >= 16 * ((len(ids) - 1) // 16) - 16 and second.num_cached_tokens > 0
    assert first.token_ids == second.token_ids


def test_abort_frees_every_page(llm):
    engine = llm.engine
    ids = _chat(llm, "Write a long essay about the ocean.")
    for i in range(4):
        engine.add_request(f"abort-{i}", ids, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_pages > 0
    for i in range(4):
        out = engine.abort_request(f"abort-{i}")
        assert out.finished and out.finish_reason == "abort"
    assert engine.block_manager.num_used_pages == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda llm: llm.generate([""], SamplingParams()), EmptyPromptError),
        (lambda llm: llm.generate([[]], SamplingParams()), EmptyPromptError),
        (lambda llm: llm.generate([[1] * 2000], SamplingParams()), PromptTooLongError),
        (lambda llm: llm.generate([[10**9]], SamplingParams()), InvalidRequestError),
        (lambda llm: llm.generate([[5, -1]], SamplingParams()), InvalidRequestError),
        (lambda llm: llm.generate([[5, True]], SamplingParams()), InvalidRequestError),
        (lambda llm: llm.generate([[5, 6.0]], SamplingParams()), InvalidRequestError),
        (lambda llm: llm.generate([[5, "6"]], SamplingParams()), InvalidRequestError),
        (lambda llm: llm.generate(["hi"], SamplingParams(logit_bias={10**9: 1.0})), InvalidSamplingParamsError),
        (lambda llm: llm.generate(["hi"], depth=DepthParams(loops=2)), InvalidDepthError),
        (lambda llm: llm.generate(["hi"], depth=DepthParams(selection_ratios=[0.5])), InvalidDepthError),
        (lambda llm: llm.generate(["a", "b"], [SamplingParams()]), InvalidRequestError),
    ],
)
def test_bad_input_raises_typed_errors_and_leaves_no_state(llm, make, error):
    with pytest.raises(error):
        make(llm)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -5},
        {"min_p": 2.0},
        {"presence_penalty": 3.0},
        {"repetition_penalty": 0.0},
        {"n": 0},
        {"max_tokens": -1},
        {"stop": [""]},
        {"logprobs": 50},
        {"min_tokens": 10, "max_tokens": 5},
    ],
)
def test_invalid_sampling_values_are_rejected(kwargs):
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(**kwargs)


def test_unknown_model_and_depth_knob_names():
    with pytest.raises(UnknownModelError, match="unknown model"):
        LLM("no-such-model")
    from depthserve.archs import knob_names

    with pytest.raises(InvalidDepthError, match="unknown depth knob"):  # no registered architecture has it
        DepthParams.from_dict({"loopz": 1}, known=knob_names())


def test_failed_batch_submission_rolls_back(llm):
    with pytest.raises(EmptyPromptError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_the_start_up_line_names_the_depth_policy_and_its_settings():
    from depthserve.config import EngineArgs
    from depthserve.engine.llm_engine import _policy_summary

    assert _policy_summary(EngineArgs(model="m")) == "fixed"
    assert _policy_summary(EngineArgs(model="m", depth_policy="slo", tpot_slo_ms=60.0)) == "slo (TPOT target 60 ms)"
    assert (_policy_summary(EngineArgs(model="m", depth_policy="confidence", confidence_threshold=0.99))
            == "confidence (exit at top-1 probability 0.99)")


def test_warm_up_runs_a_request_and_leaves_no_trace(llm):
    """`serve` warms a GPU engine up before it reports ready: the warm-up runs prefill and decode
    steps, and afterwards the counters, the prefix cache and the pages are as if it never ran."""
    engine = llm.engine
    ids = _chat(llm, "Name a colour.")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = llm.generate([ids], params)[0]
    steps_run = []
    execute = engine.runner.execute
    engine.runner.execute = lambda scheduled: steps_run.append(len(scheduled)) or execute(scheduled)
    try:
        engine.warm_up()
    finally:
        engine.runner.execute = execute
    assert len(steps_run) == 2  # the prompt's step, which samples the first token, and one decode step
    stats = engine.stats()
    assert stats["tokens_generated"] == stats["prompt_tokens_computed"] == 0
    assert stats["prefix_cache_queries"] == stats["prefix_cache_hits"] == stats["num_preemptions"] == 0
    assert stats["depth_levels_run"] == {} and engine.block_manager.num_used_pages == 0
    after = llm.generate([ids], params)[0]
    assert after.token_ids == before.token_ids and after.num_cached_tokens == 0  # the prefix cache was reset
