"""Steps ahead (engine/static_decode.py "Steps ahead", EngineArgs.num_scheduler_steps): greedy
decode-only batches run several compiled decode steps in one engine step, each step's token fed to
the next on the device. The engine's outputs are those of one step at a time (tokens, logprobs,
finish reasons, text, depth reports; logprobs within 1e-5 a token) on mixed batches with stops inside the steps ahead, mixed
max_tokens, mixed depth and preemption; they equal the eager engine's; a batch with a row the
greedy pick cannot serve runs one step at a time; and no page is left held."""

from __future__ import annotations

import pytest
import torch

from depthserve import SamplingParams
from depthserve.config import EngineArgs
from depthserve.errors import ConfigurationError
from depthserve.lab.make_tiny import make_tiny
from tests.depth_helpers import depth_params, stream_prompts, tiny_llm

LENGTHS = [3, 17, 9, 30, 5, 12, 41]
MAX_TOKENS = [19, 24, 1, 22, 6, 21, 18]  # none a multiple of the 4 steps ahead but 1
STEPS = 4


def _prompts() -> list[list[int]]:
    return stream_prompts(LENGTHS, seed=2, stride=9)


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (CUDA graphs)")])]


def _engines(path, pages: int | None, device: str = "cpu"):
    """The same compiled engine one step at a time and STEPS at a time (on CUDA with CUDA graphs; on
    CPU with torch's kernels, so that the one-step sampler's greedy pick takes the arithmetic of the
    steps-ahead pick instead of the native one, as on CUDA)."""
    backend = "torch" if device == "cpu" else "auto"
    return [tiny_llm(path, pages=pages, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, device=device,
                     enforce_eager=False, kernel_backend=backend, num_scheduler_steps=steps) for steps in (1, STEPS)]


def _count_steps_ahead(llm) -> list[int]:
    """Records the number of steps of every run_ahead call of the engine."""
    static, calls = llm.engine.runner.static, []
    run_ahead = static.run_ahead

    def counted(rows, steps):
        calls.append(steps)
        return run_ahead(rows, steps)

    static.run_ahead = counted
    return calls


def _params(stops: list[list[int]]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=stop) for n, stop in zip(MAX_TOKENS, stops)]


def assert_same_outputs(expected, got) -> None:
    for e, g in zip(expected, got, strict=True):
        assert g.token_ids == e.token_ids
        # The steps ahead run the LM head on the bucket's rows, padding included, and the eager engine
        # its own kernels: GEMMs of other shapes, whose fp32 sums may round differently. Each token's
        # logprob within 1e-5, so their sum within 1e-5 per token (a flat 1e-4 held on an Intel Xeon
        # and missed by 5e-6 on an AMD EPYC, with 24 tokens).
        bound = 1e-5 * max(1, len(g.token_ids))
        assert g.outputs[0].cumulative_logprob == pytest.approx(e.outputs[0].cumulative_logprob, abs=bound)
        assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (e.outputs[0].finish_reason,
                                                                          e.outputs[0].stop_reason)
        assert g.text == e.text
        assert g.depth == e.depth


@pytest.fixture(scope="module")
def path(tmp_path_factory, smollm_tokenizer):
    return make_tiny("llama", tmp_path_factory.mktemp("ahead") / "llama", seed=5, tokenizer=smollm_tokenizer)


@pytest.fixture(scope="module")
def cpu_engines(path):
    """The CPU pair of `_engines` (compiled once for the tests of this file) and the steps of each of
    the steps-ahead engine's run_ahead calls."""
    one, ahead = _engines(path, pages=64)
    return one, ahead, _count_steps_ahead(ahead)


@pytest.mark.parametrize("device", DEVICES)
def test_steps_ahead_equal_one_step_at_a_time_with_stops_inside_them_and_preemption(path, device, request):
    if device == "cpu":
        one, ahead, calls = request.getfixturevalue("cpu_engines")
    else:
        one, ahead = _engines(path, pages=64, device=device)
        calls = _count_steps_ahead(ahead)
    calls.clear()
    prompts = _prompts()
    free_run = one.generate(prompts, _params([[]] * len(prompts)))
    # Every other request stops at a token the free run emits 2..5 tokens in: the stop falls inside a
    # window of steps ahead. The rest run long enough to run out of pages.
    stops = [[out.token_ids[min(2 + i % 4, len(out.token_ids) - 1)]] if i % 2 == 0 else []
             for i, out in enumerate(free_run)]
    expected = one.generate(prompts, _params(stops))
    assert sum(out.outputs[0].finish_reason == "stop" for out in expected) >= 3
    got = ahead.generate(prompts, _params(stops))
    assert_same_outputs(expected, got)
    assert any(steps > 1 for steps in calls), "the batch was meant to run steps ahead"
    assert ahead.engine.scheduler.num_preemptions > 0, "the page budget was meant to force preemption"
    assert ahead.engine.block_manager.num_used_pages == 0
    # The incremental engine = recompute: the eager engine's tokens.
    eager = tiny_llm(path, max_model_len=64, max_num_seqs=8, enforce_eager=True, device=device)
    assert_same_outputs(eager.generate(prompts, _params(stops)), got)


def test_a_batch_with_a_row_the_greedy_pick_cannot_serve_runs_one_step_at_a_time(cpu_engines):
    one, ahead, calls = cpu_engines
    prompts = _prompts()[:3]
    for odd_one_out in (SamplingParams(temperature=0.8, seed=7, max_tokens=8),
                        SamplingParams(temperature=0.0, max_tokens=8, logprobs=2),
                        SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3),
                        SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)):  # stop tokens banned to the end
        params = [SamplingParams(temperature=0.0, max_tokens=8), odd_one_out, SamplingParams(temperature=0.0, max_tokens=8)]
        calls.clear()
        got = ahead.generate(prompts, params)
        assert_same_outputs(one.generate(prompts, params), got)
        assert calls == [], f"a batch with {odd_one_out} ran steps ahead"
        assert all(len(out.token_ids) == 8 for out in got)


@pytest.mark.parametrize("device", DEVICES)
def test_steps_ahead_on_a_depth_model_with_mixed_depth(tmp_path, smollm_tokenizer, device):
    """SGT with each request at its own loop count (one graph per level cap, rows kept by their own
    knobs) runs steps ahead with the eager engine's tokens, stops and depth reports."""
    path = make_tiny("sgt", tmp_path / "sgt", seed=1, num_kv_heads=2, tokenizer=smollm_tokenizer)
    ahead = tiny_llm(path, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, enforce_eager=False,
                     num_scheduler_steps=STEPS, max_loops=1, device=device)
    calls = _count_steps_ahead(ahead)
    prompts = _prompts()
    depth = [depth_params(d) for d in ({"loops": 0}, {"loops": 1}, None, {"loops": {1: 0, 2: 1}}, {"loops": 1},
                                       {"loops": 0}, {"loops": {2: 0}})]
    eager = tiny_llm(path, max_model_len=64, max_num_seqs=8, enforce_eager=True, max_loops=1, device=device)
    free_run = eager.generate(prompts, _params([[]] * len(prompts)), depth)
    stops = [[out.token_ids[3]] if i % 3 == 0 and len(out.token_ids) > 3 else [] for i, out in enumerate(free_run)]
    got = ahead.generate(prompts, _params(stops), depth)
    assert_same_outputs(eager.generate(prompts, _params(stops), depth), got)
    assert any(steps > 1 for steps in calls)
    assert ahead.engine.block_manager.num_used_pages == 0


def test_the_default_steps_ahead_and_their_bounds():
    assert EngineArgs().scheduler_steps(cuda_graphs=True) == 8
    assert EngineArgs().scheduler_steps(cuda_graphs=False) == 1
    assert EngineArgs(num_scheduler_steps=3).scheduler_steps(cuda_graphs=True) == 3
    for bad in (0, 257):
        with pytest.raises(ConfigurationError, match="num_scheduler_steps"):
            EngineArgs(num_scheduler_steps=bad).validate()
