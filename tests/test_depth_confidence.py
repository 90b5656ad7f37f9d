"""The confidence depth policy (early exit; docs/depth-semantics.md section 6): a token of a request with
a depth range whose readout is sampled (each generated token and the prompt's last) stops at the
first level of its range whose readout's top-1 probability reaches the threshold; the other
prompt tokens run the range's maximum. On the trained demos whose every level has a readout (Dreamer:
the LM head on any depth's state; PUT without suffix layers: the head on any core pass's output):
the engine's exits follow that rule on the reference's readouts (where no readout is within a hair
of the threshold), the engine equals the reference on the schedule it reports, in a mixed batch
with chunked prefill and preemption, and the readouts are paid for in the report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from depthserve import LLM, DepthParams, SamplingParams
from depthserve.archs.dreamer import format as dreamer_format
from depthserve.oracles import dreamer as dreamer_reference
from depthserve.archs.put import format as put_format
from depthserve.oracles import put as put_reference
from depthserve.config import EngineArgs
from depthserve.demo.task import problems
from depthserve.errors import ConfigurationError
from depthserve.loading.registry import resolve_model
from depthserve.loading.tokenizer import load_tokenizer
from depthserve.lab.make_tiny import make_tiny
from tests.depth_helpers import costliest_pages, tiny_llm
from tests.test_depth_elastic_put import check_against_reference as put_check_against_reference
from tests.test_dreamer import check_against_reference as dreamer_check_against_reference

THRESHOLD = 0.9999
# A readout this close to the threshold may fall on either side (the engine's fp32 against the
# reference's float64: probabilities agree to ~1e-6). The demo models are very sure of most answers:
# the threshold sits where their readouts still differ.
MARGIN = 1e-5


def _dreamer_readouts(path, ids: torch.Tensor, maximum: int, per_token: list[int]) -> list[torch.Tensor]:
    cfg, spec, weights = dreamer_reference.load(path)
    readouts, _ = dreamer_reference.run(cfg, spec, weights, ids, maximum, every_depth=True,
                                        token_depths=torch.tensor([per_token]))
    return readouts


def _put_readouts(path, ids: torch.Tensor, maximum: int, per_token: list[int]) -> list[torch.Tensor]:
    return put_reference.run_each_loop(put_reference.load_put(path), ids, maximum, token_loops=torch.tensor([per_token]))


def _dreamer_schedule_flops(model, per_token: list[int], generated: int) -> float:
    return dreamer_format.schedule_flops(model.config, model.spec, np.array(per_token), generated)


def _put_schedule_flops(model, per_token: list[int], generated: int) -> float:
    return put_format.schedule_flops(model.config, model.spec, np.array(per_token), generated)


@dataclass(frozen=True)
class Demo:
    """A trained demo with a readout at every level: its knob, the reference's readouts (level l's
    logits [1, n, V] at index l - 1, each token on its own schedule), the engine = reference check
    and the FLOPs of a request's tokens on a schedule (model, levels per token, LM head rows)."""

    name: str
    knob: str
    readouts: Callable[[object, torch.Tensor, int, list[int]], list[torch.Tensor]]
    check_against_reference: Callable[..., dict]
    schedule_flops: Callable[[object, list[int], int], float]

    def knobs(self) -> list[dict]:
        return [{self.knob: {"min": 2, "max": 6}}, {self.knob: "auto"}, {self.knob: 6}, {self.knob: {"min": 1, "max": 4}}]


DEMOS = {"dreamer": Demo("demo-dreamer", "depth", _dreamer_readouts, dreamer_check_against_reference,
                          _dreamer_schedule_flops),
         "put": Demo("demo-put", "loops", _put_readouts, put_check_against_reference, _put_schedule_flops)}


def _exit_rule(readouts: list[torch.Tensor], position: int, lowest: int, highest: int) -> tuple[int, bool]:
    """The level the rule stops the token at from the reference's readouts (level l: readouts[l - 1]),
    and whether every readout it looked at is clear of the threshold by MARGIN."""
    clear = True
    for level in range(lowest, highest):
        top = float(torch.softmax(readouts[level - 1][0, position], dim=-1).max())
        clear &= abs(top - THRESHOLD) > MARGIN
        if top >= THRESHOLD:
            return level, clear
    return highest, clear


@dataclass
class Run:
    """A mixed-depth batch of held-out problems served under a depth policy, with chunked prefill and
    forced preemption, already checked against the reference on the schedules it reports."""

    llm: LLM
    path: object
    prompts: list[list[int]]
    knobs: list[dict]
    depths: list[DepthParams]
    outputs: list


def _run_against_reference(demo: Demo, max_tokens: int, **policy) -> Run:
    source = resolve_model(demo.name)
    tokenizer = load_tokenizer(source)
    prompts = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in problems(5, 8, "held_out", 6)]
    knobs = [demo.knobs()[i % 4] for i in range(len(prompts))]
    depths = [DepthParams.from_dict(knob) for knob in knobs]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    longest = max(map(len, prompts)) + max_tokens
    llm = tiny_llm(source.path, pages=costliest_pages(source.path, depths, longest), max_model_len=longest,
                   max_num_batched_tokens=16, **policy)
    outputs = llm.generate(prompts, params, depths)
    assert llm.engine.scheduler.num_preemptions > 0
    assert demo.check_against_reference(source.path, prompts, depths, outputs)["tokens"] > 0
    return Run(llm, source.path, prompts, knobs, depths, outputs)


@pytest.mark.slow
@pytest.mark.parametrize("demo", list(DEMOS))
def test_confident_tokens_stop_early_and_the_engine_equals_the_reference(demo):
    demo = DEMOS[demo]
    run = _run_against_reference(demo, 6, depth_policy="confidence", confidence_threshold=THRESHOLD)
    llm = run.llm
    early = full = sampled = 0
    for prompt, depth, out in zip(run.prompts, run.depths, run.outputs):
        per_token = out.depth.per_token
        if per_token is None:
            continue
        span = depth.normalized(llm.engine.model.depth_knobs())[demo.knob]
        tokens = prompt + out.token_ids[:-1]
        readouts = demo.readouts(run.path, torch.tensor([tokens]), span.maximum, per_token)
        assert per_token[: len(prompt) - 1] == [span.maximum] * (len(prompt) - 1)  # nobody samples there
        for position in range(len(prompt) - 1, len(tokens)):  # the positions whose readout was sampled
            ran = per_token[position]
            expected, clear = _exit_rule(readouts, position, span.minimum, span.maximum)
            sampled += 1
            if clear:
                assert ran == expected, f"position {position}: ran {ran}, the rule says {expected}"
                early += ran < span.maximum
                full += ran == span.maximum
        assert out.outputs[0].token_depths == per_token[len(prompt) - 1 : len(tokens)]
        readouts = out.depth.to_dict()["exit_readouts"]
        assert readouts > 0  # each paid for: the schedule's FLOPs and one LM head row per readout
        cfg = llm.engine.model.config
        assert out.depth.flops == pytest.approx(demo.schedule_flops(llm.engine.model, per_token, len(out.token_ids))
                                                + readouts * 2 * cfg.hidden_size * cfg.vocab_size)
    assert early and full, "the threshold was meant to stop some tokens early and not others"
    assert early + full >= 0.8 * sampled, "most decisions were meant to be clear of the threshold"
    assert llm.engine.block_manager.num_used_pages == 0


# The demo model was trained on answers only: its readouts give a prompt's next assignment at most
# ~0.5% probability at any depth (every prompt token is an unpredictable `x=y`), so prompt tokens by
# need are tested at a threshold some of them reach.
PROMPT_THRESHOLD = 0.001


def _teacher_rule(readouts: list[torch.Tensor], position: int, next_token: int, lowest: int, highest: int
                  ) -> tuple[int, bool]:
    """Prompt tokens by need: the level the rule stops a prompt token at from the reference's
    readouts (the probability of the prompt's known next token), and whether every readout it looked
    at is clear of the threshold by MARGIN (relative: these probabilities are small)."""
    clear = True
    for level in range(lowest, highest):
        chance = float(torch.softmax(readouts[level - 1][0, position], dim=-1)[next_token])
        clear &= abs(chance - PROMPT_THRESHOLD) > MARGIN * PROMPT_THRESHOLD * 10
        if chance >= PROMPT_THRESHOLD:
            return level, clear
    return highest, clear


@pytest.mark.slow
@pytest.mark.parametrize("demo", list(DEMOS))
def test_prompt_tokens_by_need_stop_on_their_known_next_token_and_equal_the_reference(demo):
    """With prompt_exit, a prompt token whose next token is in the prompt stops at the first level of
    its range whose readout gives that token the threshold's probability; later tokens read only the
    levels it ran. Mixed batch, chunked prefill, preemption: the engine equals the reference on the
    schedule it reports, the schedule follows the rule on the reference's readouts, and a request
    with a fixed knob is untouched."""
    demo = DEMOS[demo]
    run = _run_against_reference(demo, 4, depth_policy="confidence", confidence_threshold=PROMPT_THRESHOLD,
                                 prompt_exit=True)
    llm = run.llm
    early = full = checked = 0
    for prompt, knob, depth, out in zip(run.prompts, run.knobs, run.depths, run.outputs):
        per_token = out.depth.per_token
        if per_token is None:
            assert knob == {demo.knob: 6}  # the fixed knob: no schedule of its own
            continue
        span = depth.normalized(llm.engine.model.depth_knobs())[demo.knob]
        readouts = demo.readouts(run.path, torch.tensor([prompt]), span.maximum, per_token[: len(prompt)])
        for position in range(len(prompt) - 1):
            expected, clear = _teacher_rule(readouts, position, prompt[position + 1], span.minimum, span.maximum)
            if clear:
                checked += 1
                assert per_token[position] == expected, f"position {position}: ran {per_token[position]}, rule {expected}"
                early += expected < span.maximum
                full += expected == span.maximum
    assert early and full, "some prompt tokens were meant to stop early and others not"
    assert checked >= 0.8 * sum(len(p) - 1 for p, knob in zip(run.prompts, run.knobs) if knob != {demo.knob: 6})
    assert llm.engine.block_manager.num_used_pages == 0


@pytest.mark.slow
@pytest.mark.parametrize("demo", list(DEMOS))
def test_the_need_policy_schedule_equals_the_reference(demo):
    """The need policy (slo with the exit, its cap priced by each sequence's exits) under a TPOT
    target that binds: decode steps run shed, steps of prompts alone deep, sure tokens stop below
    the cap, in a mixed batch with chunked prefill and preemption; whatever schedule the load gave,
    the engine equals the reference on the schedule it reports, and frees every page."""
    demo = DEMOS[demo]
    run = _run_against_reference(demo, 6, depth_policy="need", tpot_slo_ms=2.0, confidence_threshold=0.99)
    llm = run.llm
    ranged = [(depth.normalized(llm.engine.model.depth_knobs())[demo.knob], out.depth.per_token)
              for depth, out in zip(run.depths, run.outputs) if out.depth.per_token is not None]
    assert any(min(levels) < span.maximum for span, levels in ranged), "the target was meant to shed depth"
    assert any(max(levels) == span.maximum for span, levels in ranged), "prompt-only steps were meant to run deep"
    assert all(span.minimum <= level <= span.maximum for span, levels in ranged for level in levels)
    assert llm.engine.block_manager.num_used_pages == 0


def test_the_threshold_is_checked(tmp_path, smollm_tokenizer):
    for kwargs, message in ((dict(depth_policy="confidence"), "needs confidence_threshold"),
                            (dict(depth_policy="fixed", confidence_threshold=0.5), "not fixed"),
                            (dict(depth_policy="confidence", confidence_threshold=1.5), "must lie in"),
                            (dict(depth_policy="need", tpot_slo_ms=20.0), "needs confidence_threshold"),
                            (dict(depth_policy="need", confidence_threshold=0.9), "positive tpot_slo_ms"),
                            (dict(depth_policy="confidence", prompt_exit=True), "needs confidence_threshold"),
                            (dict(depth_policy="slo", tpot_slo_ms=20.0, prompt_exit=True), "prompt_exit needs")):
        with pytest.raises(ConfigurationError, match=message):
            EngineArgs(model="demo-dreamer", **kwargs).validate()
    put = make_tiny("put", tmp_path / "put", seed=1, num_kv_heads=2, tokenizer=smollm_tokenizer)
    with pytest.raises(ConfigurationError, match="readout at every depth level"):
        LLM(str(put), device="cpu", dtype="float32", load_progress=False, max_model_len=32,
            depth_policy="confidence", confidence_threshold=0.5)


def test_exit_counts_are_in_the_metrics():
    """Tokens that stopped early count at the level they ran, and are not counted as shed."""
    llm = LLM("demo-dreamer", device="cpu", dtype="float32", load_progress=False, max_model_len=64,
              depth_policy="confidence", confidence_threshold=THRESHOLD)
    source = resolve_model("demo-dreamer")
    prompt = load_tokenizer(source).encode(problems(4, 1, "held_out", 1)[0].prompt, add_special_tokens=False)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), DepthParams(depth="auto"))[0]
    levels = np.bincount(out.depth.per_token, minlength=7)
    assert llm.engine.stats()["depth_levels_run"] == {level: int(n) for level, n in enumerate(levels) if n}
    assert llm.engine.stats()["depth_shed_tokens"] == 0
