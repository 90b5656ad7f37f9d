"""The long-prefill caps on the real engine (docs/server.md, "Scheduling"): a prompt cut into chunks
that shrink with the context gives the tokens it gives in one piece, and a short request that
arrives mid-prefill gets its first token in the next step, which the long prompt sits out."""

from __future__ import annotations

from dataclasses import replace

import pytest

from depthserve import SamplingParams
from depthserve.config import EngineArgs
from depthserve.errors import ConfigurationError
from tests.batch_workload import TEXT, compare

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


def long_prompt(tokenizer, length: int) -> list[int]:
    ids = tokenizer.encode(" ".join([TEXT] * 8), add_special_tokens=False)
    assert len(ids) >= length
    return ids[:length]


def steps_to_first_token(engine, request_id: str) -> tuple[int, list]:
    """Steps until `request_id` has an output token, and every output of the requests that finished."""
    finished, steps = [], 0
    while engine.has_unfinished_requests():
        steps += 1
        outputs = engine.step()
        finished += [out for out in outputs if out.finished]
        mine = [out for out in outputs if out.request_id == request_id]
        if mine and mine[0].outputs[0].token_ids:
            return steps, finished
    raise AssertionError(f"{request_id} never produced a token")


def test_defaults_per_device_and_validation():
    assert EngineArgs().long_prefill_caps("cpu") == (128, 1024)
    assert EngineArgs().long_prefill_caps("cuda") == (2048, 0)
    assert (EngineArgs().long_prefill_chunk("cpu"), EngineArgs().long_prefill_chunk("cuda")) == (32, 0)
    assert EngineArgs(long_prefill_token_threshold=0, long_prefill_context_scale=64).long_prefill_caps("cpu") == (0, 64)
    assert EngineArgs(long_prefill_chunk_tokens=8).long_prefill_chunk("cuda") == 8
    for bad in (dict(long_prefill_token_threshold=-1), dict(long_prefill_context_scale=-1),
                dict(long_prefill_chunk_tokens=-1), dict(max_long_partial_prefills=0)):
        with pytest.raises(ConfigurationError):
            EngineArgs(**bad).validate()


def test_capped_chunks_give_the_tokens_of_one_piece_and_short_requests_go_first(smollm_llm, smollm_tokenizer):
    engine = smollm_llm.engine  # the CPU defaults: 32 tokens a chunk at context 0, fewer further on
    config = engine.scheduler.config
    prompt = long_prompt(smollm_tokenizer, 400)
    chunks = []
    while sum(chunks) < len(prompt):
        chunks.append(min(config.prefill_chunk_cap(sum(chunks)), len(prompt) - sum(chunks)))
    assert chunks[0] == 32 and chunks[-2] < 32 and len(chunks) > 400 // 32

    engine.reset_prefix_cache()
    engine.add_request("long", prompt, GREEDY)
    engine.step()  # the long prompt is mid-prefill
    long = engine.scheduler.running[0]
    assert long.num_computed_tokens == chunks[0]
    engine.add_request("short", prompt[-5:], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    short_steps, finished = steps_to_first_token(engine, "short")
    assert short_steps == 1  # its first token came in the very next step
    assert long.num_computed_tokens == chunks[0]  # which the long prompt sat out
    long_steps, more = steps_to_first_token(engine, "long")
    assert 1 + short_steps + long_steps == len(chunks) + 1  # then it took its capped chunks again, one a step
    finished += more
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    capped = next(out for out in finished if out.request_id == "long")

    engine.reset_prefix_cache()
    engine.scheduler.config = replace(config, long_prefill_token_threshold=0)  # the budget (512) only: one piece
    try:
        computed = engine.prompt_tokens_computed
        one_piece = smollm_llm.generate([prompt], GREEDY)[0]
        assert engine.prompt_tokens_computed - computed == len(prompt)
    finally:
        engine.scheduler.config = config
        engine.reset_prefix_cache()
    compare([one_piece], [capped])
