"""What the public looped models' HTTP tests share: a tiny checkpoint served by the real app, whose
completions, chat and streams must equal offline generation at two settings of its `loops` knob,
with the knob changing the tokens and the bill (usage.depth), and out-of-range values refused."""

from __future__ import annotations

from pathlib import Path

import pytest

PROMPTS = ["The meaning of depth is", "Once upon a time there was a loop"]


def check_loops_served_with_the_openai_sdk(path: Path, settings: tuple[int, int], knob_range: tuple[int, int],
                                           default: int | None = None) -> None:
    """Serve the checkpoint at `path` and check each of two `loops` settings over HTTP; `default`:
    also check GET /v1/models lists the knob's range and this default."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import httpx

    from depthserve import LLM, DepthParams, SamplingParams
    from depthserve.config import EngineArgs
    from depthserve.engine.async_llm import AsyncLLM
    from depthserve.engine.llm_engine import LLMEngine
    from depthserve.server.app import build_app
    from tests.live_server import live_server, wait_idle

    engine_args = dict(device="cpu", dtype="float32", load_progress=False, max_model_len=256, block_size=8)
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(path), **engine_args)))
    offline = LLM(str(path), **engine_args)
    model = llm.engine.model_name
    low, high = knob_range
    with live_server(build_app(llm)) as base:
        if default is not None:
            knob = httpx.get(f"{base}/v1/models").json()["data"][0]["depth_knobs"]["loops"]
            assert (knob["minimum"], knob["maximum"], knob["default"]) == (low, high, default)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        texts, flops = {}, {}
        for loops in settings:
            depth = DepthParams(loops=loops)
            expected = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), depth)
            got = client.completions.create(model=model, prompt=PROMPTS, max_tokens=8, temperature=0.0,
                                            extra_body={"depth": {"loops": loops}, "ignore_eos": True})
            texts[loops] = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
            assert texts[loops] == [e.text for e in expected]
            usage = got.usage.model_extra["depth"]
            assert [p["loops"] for p in usage["per_prompt"]] == [loops, loops]
            flops[loops] = usage["flops"]
            assert flops[loops] == pytest.approx(sum(e.depth.flops for e in expected))
            streamed = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0.0,
                                                 stream=True, extra_body={"depth": {"loops": loops}, "ignore_eos": True})
            assert "".join(c.choices[0].text for c in streamed if c.choices) == expected[1].text
            messages = [{"role": "user", "content": "Loop again."}]
            chat_expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=6), depth)
            chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0.0,
                                                  extra_body={"depth": {"loops": loops}})
            assert chat.choices[0].message.content == chat_expected.text
        fewer, more = settings
        assert texts[fewer] != texts[more] and flops[more] > flops[fewer]
        for bad in ({"loops": low - 1}, {"loops": high + 1}):
            response = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "x", "depth": bad})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and f"{low}..{high}" in error["message"], error
        wait_idle(llm)
        assert llm.engine.block_manager.num_used_pages == 0
