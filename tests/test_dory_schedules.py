"""Per-token loops for Dory (docs/depth-semantics.md section 6 and "Public looped models: Dory"): a
request whose `loops` is a range runs each step's tokens at the depth policy's level. The schedule
reference (depthserve/archs/dory/reference.py, float64 from the checkpoint's weights) equals
transformers' DoryForCausalLM at every constant schedule, in both cache modes; the engine equals
that reference on the schedule it reports: random levels going down and up in mixed batches of
fixed and range requests, with chunked prefill (last_loop: the fixed prompt chunks), preemption
and sliding windows shorter than the prompts (per_loop: routed pass slots whose keys' positions
have holes). Tiny checkpoints saved by transformers itself."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from depthserve import DepthParams, SamplingParams
from depthserve.archs.dory import format as dory_format
from depthserve.archs.dory import reference as dory_reference
from depthserve.archs.dory.tiny import make_tiny
from depthserve.errors import InvalidDepthError
from tests.depth_helpers import check_logprobs, costliest_pages, tiny_llm
from tests.test_depth_elastic import RandomLevels

TOL = 1e-4  # tests/test_dory.py
NEAR_TIE = 0.0  # greedy tokens must be the reference's argmax
WINDOW = 8  # every prompt below is longer
VOCAB = 257  # the byte tokenizer's
MAX_LEN = 40  # the longest prompt and its 8 tokens
LENGTHS = [21, 9, 30, 14, 26, 11]
KNOBS = [{"loops": {"min": 1, "max": 3}}, {"loops": 2}, {"loops": {"min": 2, "max": 4}}, {"loops": {"min": 1, "max": 4}},
         {"loops": 1}, {"loops": {"min": 1, "max": 2}}]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["per_loop", "last_loop"])
def path(request, tmp_path_factory):
    """A tiny Dory (2 prelude, 2 recurrent, 2 coda layers, sliding and full in each; trained loops 2,
    max_loops 8) in each cache mode."""
    return make_tiny(tmp_path_factory.mktemp("dory-schedules") / request.param, seed=11, loops=2,
                     cache_mode=request.param, sliding_window=WINDOW)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _chunk(path) -> int | None:
    """The prompt chunk the engine runs last_loop prompts in (None: per_loop, any split)."""
    cfg = dory_reference.load_weights(str(path)).cfg
    return dory_format.LAST_LOOP_PREFILL_CHUNK if cfg.recurrent_kv_cache_mode == "last_loop" else None


# ---- the reference -------------------------------------------------------------------------------------
def test_a_constant_schedule_equals_transformers(path):
    ids = _ids(45, seed=0)
    options = dict(prompt_len=40, prefill_chunk=16)  # last_loop: three prompt forwards, then one token each
    for loops in (1, 2, 4):
        hf = dory_reference.forward(path, ids, {"loops": loops}, **options)
        ours = dory_reference.forward(path, ids, schedule=[{"loops": loops}] * len(ids), **options)
        torch.testing.assert_close(ours, hf, rtol=0, atol=1e-4)


def test_a_token_depends_only_on_its_prefix_and_their_loops(path):
    ids = _ids(30, seed=1)
    rng = random.Random(2)
    schedule = [{"loops": rng.randint(1, 4)} for _ in ids]
    full = dory_reference.forward(path, ids, schedule=schedule, prompt_len=20, prefill_chunk=8)
    prefix = dory_reference.forward(path, ids[:24], schedule=schedule[:24], prompt_len=20, prefill_chunk=8)
    torch.testing.assert_close(prefix, full[:24], rtol=0, atol=1e-10)
    other = list(schedule)
    other[25] = {"loops": 5 - schedule[25]["loops"] if schedule[25]["loops"] != 2.5 else 1}
    changed = dory_reference.forward(path, ids, schedule=other, prompt_len=20, prefill_chunk=8)
    torch.testing.assert_close(changed[:25], full[:25], rtol=0, atol=1e-10)
    assert (changed[25] - full[25]).abs().max() > 1e-6


def test_a_shallow_token_changes_what_later_tokens_read(path):
    """Token 12 (a decode forward) runs one pass where the others run three. per_loop: it is
    missing from the pass-2 and pass-3 slots; last_loop: the later tokens read its pass-1 keys. Either
    way nothing before it changes, and the later tokens within the window change."""
    ids = _ids(20, seed=3)
    deep = [{"loops": 3}] * len(ids)
    shallow = list(deep)
    shallow[12] = {"loops": 1}
    base = dory_reference.forward(path, ids, schedule=deep, prompt_len=10, prefill_chunk=8)
    changed = dory_reference.forward(path, ids, schedule=shallow, prompt_len=10, prefill_chunk=8)
    torch.testing.assert_close(changed[:12], base[:12], rtol=0, atol=1e-10)
    assert (changed[13:13 + WINDOW - 1] - base[13:13 + WINDOW - 1]).abs().max(dim=-1).values.min() > 1e-8


# ---- the engine ----------------------------------------------------------------------------------------
def _check_against_reference(path, prompts, knobs, outputs) -> dict:
    stats = {"tokens": 0, "max_err": 0.0}
    for prompt, knob, out in zip(prompts, knobs, outputs):
        tokens = prompt + out.token_ids[:-1]
        per_token = out.depth.per_token
        if per_token is None:
            schedule = [{"loops": knob["loops"]}] * len(tokens)
        else:
            assert len(per_token) == len(tokens)
            schedule = [{"loops": n} for n in per_token]
        logits = dory_reference.forward(path, tokens, schedule=schedule, prompt_len=len(prompt),
                                        prefill_chunk=_chunk(path))
        check_logprobs(torch.log_softmax(logits, dim=-1), len(prompt), out.outputs[0], stats, tol=TOL,
                       near_tie=NEAR_TIE, prompt_logprobs=out.prompt_logprobs)
    return stats


def test_random_levels_in_a_mixed_batch_equal_the_reference(path):
    prompts = [_ids(n, seed=40 + i) for i, n in enumerate(LENGTHS)]
    depths = [DepthParams.from_dict(k) for k in KNOBS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    # pages for one sequence of MAX_LEN tokens at the costliest knob, and a few: the
    # six sequences are preempted in turn and recompute their recorded levels
    llm = tiny_llm(path, pages=costliest_pages(path, depths, MAX_LEN) + 4, max_model_len=MAX_LEN,
                   max_num_batched_tokens=16)
    llm.engine.depth_policy = RandomLevels(0)
    preempted = []
    preempt = llm.engine.scheduler._preempt

    def spy(seq):
        preempted.append((seq.plan.elastic is not None, set(seq.levels[: seq.num_computed_tokens])))
        preempt(seq)

    llm.engine.scheduler._preempt = spy
    outputs = llm.generate(prompts, params, depths)
    stats = _check_against_reference(path, prompts, KNOBS, outputs)
    assert stats["tokens"] == 8 * len(prompts) and stats["prompt_positions"] > 0
    turns = 0
    knob = llm.engine.model.depth_knobs()["loops"]
    for depth, out in zip(depths, outputs):
        loops = knob.check(depth["loops"])
        per_token = out.depth.per_token
        if per_token is None:
            assert isinstance(loops, int) and out.depth.settings["loops"] == loops
            continue
        assert all(loops.minimum <= n <= loops.maximum for n in per_token)
        assert out.outputs[0].token_depths == per_token[len(out.prompt_token_ids) - 1:]
        assert out.depth.settings["loops"] == loops.as_json()
        assert out.depth.settings["mean_depth"] == pytest.approx(np.mean(per_token), abs=1e-4)
        assert out.depth.counters["recurrent_layer_passes"] == sum(per_token) * 2
        steps = np.diff(per_token)
        turns += bool((steps < 0).any() and (steps > 0).any())
    assert turns >= 2
    print("dory schedules: preemptions", preempted, stats)
    assert any(ranged and len(levels) > 1 for ranged, levels in preempted), preempted
    assert llm.engine.block_manager.num_used_pages == 0
