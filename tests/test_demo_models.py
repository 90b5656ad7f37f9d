"""The demo depth models: `depthserve train-demo` end to end on a reduced recipe, and the built-in
checkpoints (`demo-put`, `demo-dreamer`, `demo-itt`): the engine equals the reference on them in a
mixed-depth batch, their depth knob visibly matters, and one answers over HTTP."""

from __future__ import annotations

import json

import pytest
import torch

from depthserve import LLM, DepthParams, SamplingParams
from depthserve.archs import demo_arches
from depthserve.demo.task import problems, solve
from depthserve.engine.model_runner import ModelRunner
from depthserve.loading.registry import resolve_model
from depthserve.loading.tokenizer import load_tokenizer
from depthserve.tools.cli import main as cli
from tests.depth_helpers import BLOCK_SIZE, cache_layout, tiny_llm
from tests.test_dreamer import check_against_reference as check_dreamer
from tests.test_sgt_itt_engine import check_against_reference as check_routed

DECODE = 4  # tokens generated per request (past the answer and its </s>: still compared)
DEMO_MODELS = {"put": "demo-put", "dreamer": "demo-dreamer", "itt": "demo-itt"}


def check(arch: str, path, prompts, depths, outputs) -> dict:
    """Engine = reference (decisions compared under the margin rule, then teacher-forced)."""
    if arch == "dreamer":
        return check_dreamer(path, prompts, depths, outputs)
    return check_routed(path, prompts, depths, outputs, routed=arch == "itt")


def mixed_batch_equals_reference(path, arch: str, tokenizer) -> dict:
    """Held-out problems at every setting of the model's knob, round robin, in one batch under a KV
    budget of one costliest request (admission waits, and decode may preempt), prefilled in chunks;
    every token's logprobs against the reference."""
    cfg = json.loads((path / "config.json").read_text())
    settings = demo_arches()[arch].settings(cfg)
    held_out = problems(7, max(6, len(settings)), "held_out", 4)
    prompts = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in held_out]
    depths = [DepthParams(**settings[i % len(settings)]) for i in range(len(prompts))]
    params = [SamplingParams(temperature=0.0, max_tokens=DECODE, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1 if i % 3 == 1 else None) for i in range(len(prompts))]
    longest = max(map(len, prompts)) + DECODE
    probe = tiny_llm(path, max_model_len=longest)
    bm, model = probe.engine.block_manager, probe.engine.model
    need = [bm.pages_for(cache_layout(model, d), len(p) + DECODE) for p, d in zip(prompts, depths)]
    costliest = max(bm.pages_for(cache_layout(model, d), longest) for d in depths)
    page_bytes = ModelRunner.page_bytes(BLOCK_SIZE, cfg["head_dim"], torch.float32)
    depth_cache = -(-model.step_cache_bytes_bound(16) // page_bytes)
    assert sum(need) > 2 * (costliest + 1)
    llm = tiny_llm(path, pages=costliest + 1 + depth_cache, max_model_len=longest, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, params, depths)
    stats = check(arch, path, prompts, depths, outputs)
    stats["preemptions"] = llm.engine.scheduler.num_preemptions
    assert llm.engine.block_manager.num_used_pages == 0
    return stats


@pytest.mark.parametrize("arch", sorted(demo_arches()))
@pytest.mark.slow
def test_train_demo_end_to_end_on_a_reduced_recipe(tmp_path, arch):
    out = tmp_path / arch
    rc = cli(["train-demo", "--arch", arch, "--out", str(out), "--steps", "60", "--eval-every", "20",
              "--batch-size", "16", "--hidden-size", "32", "--heads", "2", "--intermediate-size", "64",
              "--lr", "3e-3", "--threads", "1"])
    assert rc == 0
    meta = json.loads((out / "train_demo.json").read_text())
    curve = meta["curve"]
    assert [point["step"] for point in curve] == [20, 40, 60]
    assert curve[-1]["loss"] < curve[0]["loss"] - 0.25, curve  # down from ~ln(vocab), towards the digits
    assert meta["command"].startswith(f"depthserve train-demo --arch {arch} --steps 60")
    stats = mixed_batch_equals_reference(out, arch, load_tokenizer(resolve_model(str(out))))
    assert stats["tokens"] > 0


@pytest.mark.parametrize("arch", sorted(DEMO_MODELS))
@pytest.mark.slow
def test_builtin_demo_model_equals_its_reference_in_a_mixed_depth_batch(arch):
    source = resolve_model(DEMO_MODELS[arch])
    stats = mixed_batch_equals_reference(source.path, arch, load_tokenizer(source))
    assert stats["tokens"] > 0


@pytest.mark.parametrize("arch", sorted(DEMO_MODELS))
def test_builtin_demo_model_answers_more_with_more_depth(arch):
    """The shipped checkpoint is the trained one: on held-out problems its largest setting answers
    nearly all and its smallest far fewer, each answer followed by </s> (bench/depth_quality.py
    has the full table on 1000 problems, against the bars of 90% and 60%)."""
    source = resolve_model(DEMO_MODELS[arch])
    meta = json.loads((source.path / "train_demo.json").read_text())
    settings = demo_arches()[arch].settings(json.loads((source.path / "config.json").read_text()))
    held_out = problems(99, 100, "held_out", meta["max_hops"])
    llm = LLM(DEMO_MODELS[arch], device="cpu", dtype="float32", load_progress=False, max_model_len=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    accuracy = {}
    for setting in (settings[0], settings[-1]):
        outputs = llm.generate([p.prompt for p in held_out], greedy, DepthParams(**setting))
        right = [o.text.split()[:1] == [p.answer] for o, p in zip(outputs, held_out)]
        accuracy[json.dumps(setting)] = sum(right) / len(held_out)
        if setting is settings[-1]:  # the answer, then </s>
            assert sum(o.finish_reason == "stop" and len(o.token_ids) == 2 for o in outputs) >= 90
    smallest, largest = accuracy.values()
    assert largest >= 0.9 and smallest <= largest - 0.3, accuracy


def test_a_demo_model_answers_over_http():
    openai = pytest.importorskip("openai")
    from depthserve.config import EngineArgs
    from depthserve.engine.async_llm import AsyncLLM
    from depthserve.engine.llm_engine import LLMEngine
    from depthserve.server.app import build_app
    from tests.live_server import live_server

    engine = LLMEngine(EngineArgs(model="demo-dreamer", device="cpu", dtype="float32", load_progress=False,
                                  max_model_len=64))
    prompt = "k=3 c=7 p=k w=1 m=w d=p y=c t=y t?"
    assert solve(prompt) == "7"
    with live_server(build_app(AsyncLLM(engine))) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        answer = client.completions.create(model="demo-dreamer", prompt=prompt, max_tokens=4, temperature=0.0,
                                           extra_body={"depth": {"depth": 6}})
        shallow = client.completions.create(model="demo-dreamer", prompt=prompt, max_tokens=4, temperature=0.0,
                                            extra_body={"depth": {"depth": 1}})
    assert answer.choices[0].text.strip() == "7" and answer.choices[0].finish_reason == "stop"
    assert answer.usage.model_extra["depth"]["depth"] == 6
    assert shallow.usage.model_extra["depth"]["depth"] == 1
    assert shallow.usage.model_extra["depth"]["relative_compute"] < answer.usage.model_extra["depth"]["relative_compute"]
