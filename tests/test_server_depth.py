"""The server on tiny SGT and ITT checkpoints: per-request depth over HTTP equals offline
generation, usage and /metrics report the depth spent; admission refusals (queue full, dead
engine) are 503s before any stream starts; disconnected non-streaming requests are aborted."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from depthserve import LLM, DepthParams, SamplingParams  # noqa: E402
from depthserve.engine.async_llm import AsyncLLM  # noqa: E402
from depthserve.engine.llm_engine import LLMEngine  # noqa: E402
from depthserve.server.app import build_app  # noqa: E402
from depthserve.lab.make_tiny import make_tiny  # noqa: E402
from tests.live_server import live_server, metric_value, wait_idle  # noqa: E402

ENGINE = dict(device="cpu", dtype="float32", load_progress=False, max_model_len=512, block_size=8,
              kv_cache_memory_gib=0.02)
PROMPTS = ["The meaning of depth is", "Once upon a time there", "A B C D E F G"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smollm_tokenizer):
    root = tmp_path_factory.mktemp("tiny-server")
    return {arch: make_tiny(arch, root / arch, seed=5, tokenizer=smollm_tokenizer)
            for arch in ("sgt", "itt", "llama")}


def _serve(path, presets=None, max_waiting_requests=256, **engine_kwargs):
    from depthserve.config import EngineArgs

    engine = LLMEngine(EngineArgs(model=str(path), **{**ENGINE, **engine_kwargs}))
    llm = AsyncLLM(engine, max_waiting_requests=max_waiting_requests)
    return llm, build_app(llm, depth_presets=presets)


@pytest.fixture(scope="module", params=["sgt", "itt"])
def depth_server(request, ckpts):
    arch = request.param
    presets = {"deep": {"loops": 3}} if arch == "sgt" else {"lean": {"selection_ratios": [0.3, 0.3]}}
    llm, app = _serve(ckpts[arch], presets)
    offline = LLM(str(ckpts[arch]), **ENGINE)
    with live_server(app) as base:
        yield arch, base, llm, offline


DEPTHS = {
    "sgt": [{"loops": 0}, {"loops": 2}, {"loops": {"1": 3, "2": 0}}],
    "itt": [{"selection_ratios": [0.0, 0.7]}, {"selection_ratios": [1.0, 0.3]}, {"thinking_steps": 1}],
}
COUNTERS = {"sgt": "loop_iterations", "itt": "selected_tokens"}  # depthserve_depth_counter{name=...}


def _depth_samples(base: str, arch: str) -> dict[str, float]:
    """The architecture's counter on /metrics by its labels, as usage.depth keys its counts (SGT: the
    layer; ITT: "layer:step")."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics").text
    return {":".join(v for k, v in sorted(s.labels.items()) if k not in ("model", "name")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "depthserve_depth_counter_total" and s.labels.get("name") == COUNTERS[arch]}


def _depth_counter(base: str, arch: str) -> float:
    return sum(_depth_samples(base, arch).values())


def test_depth_over_http_equals_offline_generate(depth_server):
    arch, base, llm, offline = depth_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
    model = llm.engine.model_name
    for depth in DEPTHS[arch]:
        expected = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                                    DepthParams.from_dict(depth))
        got = client.completions.create(model=model, prompt=PROMPTS, max_tokens=10, temperature=0.0,
                                        extra_body={"depth": depth, "ignore_eos": True})
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [e.text for e in expected]
        streamed = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=10, temperature=0.0,
                                             stream=True, extra_body={"depth": depth, "ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected[1].text
    messages = [{"role": "user", "content": "Think deeply."}]
    depth = DEPTHS[arch][1]
    expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=8), DepthParams.from_dict(depth))
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.0,
                                          extra_body={"depth": depth})
    assert chat.choices[0].message.content == expected.text
    assert chat.usage.model_extra["depth"]["relative_compute"] == pytest.approx(expected.depth.relative_compute)


def test_usage_reports_depth_and_metrics_counters_move(depth_server):
    arch, base, llm, offline = depth_server
    model = llm.engine.model_name
    depth = DEPTHS[arch][1]
    before = _depth_counter(base, arch)
    body = {"model": model, "prompt": PROMPTS, "max_tokens": 4, "temperature": 0.0, "depth": depth}
    usage = httpx.post(f"{base}/v1/completions", json=body).json()["usage"]["depth"]
    singles = [o.depth.to_dict() for o in offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4),
                                                           DepthParams.from_dict(depth))]
    # Several prompts: counts add up, relative compute is total FLOPs over total plain FLOPs.
    assert usage["per_prompt"] == [json.loads(json.dumps(s)) for s in singles]
    assert usage["tokens"] == sum(s["tokens"] for s in singles)
    assert usage["relative_compute"] == pytest.approx(sum(s["flops"] for s in singles)
                                                      / sum(s["plain_flops"] for s in singles))
    key = "loop_iterations" if arch == "sgt" else "selected_tokens"
    spent = sum(sum(s[key].values()) for s in singles)
    assert spent > 0 and sum(usage[key].values()) == spent
    assert _depth_counter(base, arch) - before == spent
    assert {str(counted) for counted in usage[key]} <= set(_depth_samples(base, arch))  # labelled by layer (and step)
    wait_idle(llm)
    assert llm.engine.block_manager.num_used_pages == 0


def test_models_list_knobs_and_presets_choose_depth(depth_server):
    arch, base, llm, offline = depth_server
    model = llm.engine.model_name
    listed = {m["id"]: m for m in httpx.get(f"{base}/v1/models").json()["data"]}
    preset, knobs = ("deep", {"loops": 3}) if arch == "sgt" else ("lean", {"selection_ratios": [0.3, 0.3]})
    assert set(listed) == {model, f"{model}:{preset}"}
    assert listed[f"{model}:{preset}"]["depth_preset"] == knobs
    for name, spec in llm.engine.model.depth_knobs().items():
        assert listed[model]["depth_knobs"][name]["maximum"] == spec.maximum
    expected = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                DepthParams.from_dict(knobs))[0]
    body = {"model": f"{model}:{preset}", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True}
    assert httpx.post(f"{base}/v1/completions", json=body).json()["choices"][0]["text"] == expected.text


BAD_DEPTH = {
    "sgt": [({"loops": 99}, "loops"), ({"loops": -1}, "loops"), ({"loops": {"0": 1}}, "layers"),
            ({"loops": "2"}, "depth knob 'loops' of this model must be an integer or a map from layer to integer"),
            ({"selection_ratios": [0.5, 0.5]}, "selection_ratios")],
    "itt": [({"selection_ratios": [1.5, 0.2]}, "selection_ratios"), ({"selection_ratios": [0.5]}, "exactly 2"),
            ({"thinking_steps": 3}, "thinking_steps"), ({"selection_ratios": 0.5}, "selection_ratios"),
            ({"loops": 1}, "loops")],
}


def test_bad_depth_settings_are_400s_and_leave_no_pages(depth_server):
    arch, base, llm, _ = depth_server
    for depth, words in BAD_DEPTH[arch]:
        for stream in (False, True):
            body = {"model": llm.engine.model_name, "prompt": "x", "depth": depth, "stream": stream}
            response = httpx.post(f"{base}/v1/completions", json=body)
            assert response.status_code == 400, (depth, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and words in error["message"], (depth, error)
    wait_idle(llm)
    assert llm.engine.block_manager.num_used_pages == 0


def test_streamed_logprobs_equal_non_streamed(depth_server):
    arch, base, llm, _ = depth_server
    body = {"model": llm.engine.model_name, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0,
            "logprobs": 2, "depth": DEPTHS[arch][1], "ignore_eos": True}
    whole = httpx.post(f"{base}/v1/completions", json=body).json()["choices"][0]["logprobs"]
    pieces = _sse_chunks(base, {**body, "stream": True})
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in pieces:
        for choice in chunk["choices"]:
            for key in streamed:
                streamed[key] += choice["logprobs"][key]
    assert streamed == whole
    # echo: the prompt's logprobs come first, in the same format
    scored = httpx.post(f"{base}/v1/completions", json={**body, "echo": True, "max_tokens": 1}).json()
    echoed = [c for c in _sse_chunks(base, {**body, "echo": True, "max_tokens": 1, "stream": True}) if c["choices"]]
    first = echoed[0]["choices"][0]
    assert first["text"] == PROMPTS[0]
    n_prompt = len(first["logprobs"]["tokens"])
    assert first["logprobs"]["token_logprobs"] == scored["choices"][0]["logprobs"]["token_logprobs"][:n_prompt]


def _sse_chunks(base: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


# ---- admission refusals, dead engine, disconnects ------------------------------------------------
def test_full_queue_is_a_503_with_retry_after_for_streams_too(ckpts):
    # One running sequence at a time and room for one waiting request: A runs, B waits, C is refused.
    llm, app = _serve(ckpts["llama"], max_waiting_requests=1, max_num_seqs=1)
    with live_server(app) as base:
        long = {"model": llm.engine.model_name, "prompt": "a b c", "max_tokens": 400, "ignore_eos": True,
                "stream": True}

        async def main():
            async with httpx.AsyncClient(timeout=60) as http:
                async with http.stream("POST", f"{base}/v1/completions", json=long) as a:
                    assert a.status_code == 200
                    lines = a.aiter_lines()
                    while not (await anext(lines)).startswith("data: "):
                        pass  # A is running (its first token is out)
                    async with http.stream("POST", f"{base}/v1/completions", json=long) as b:
                        assert b.status_code == 200  # admitted, waiting behind A
                        refused = []
                        for stream in (True, False):
                            r = await http.post(f"{base}/v1/completions", json={**long, "stream": stream})
                            refused.append((r.status_code, r.headers.get("retry-after"), r.json()["error"]["type"]))
                        return refused

        refused = asyncio.run(main())
        assert refused == [(503, "1", "server_overloaded")] * 2
        wait_idle(llm)
        assert llm.engine.block_manager.num_used_pages == 0
        assert metric_value(base, "depthserve_requests_total", outcome="aborted") == 2
        assert metric_value(base, "depthserve_requests_total", outcome="rejected") == 2


def test_dead_engine_fails_requests_at_once_and_health_turns_503(ckpts):
    llm, app = _serve(ckpts["llama"])
    with live_server(app) as base:
        body = {"model": llm.engine.model_name, "prompt": "a b c", "max_tokens": 400, "ignore_eos": True}
        assert httpx.get(f"{base}/health").status_code == 200
        real_step = llm.engine.step
        calls = []

        def failing_step():
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("simulated device failure")
            return real_step()

        llm.engine.step = failing_step
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=30) as running:
            assert running.status_code == 200
            text = "".join(running.iter_text())  # ends (with an error event) instead of hanging
        assert "[DONE]" not in text and "error" in text
        assert httpx.get(f"{base}/health").status_code == 503
        for stream in (True, False):
            r = httpx.post(f"{base}/v1/completions", json={**body, "stream": stream}, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


def test_reset_prefix_cache_fails_instead_of_waiting_when_the_loop_goes(ckpts):
    """A reset queued behind a step that kills the engine loop, or behind a shutdown, raises
    EngineDeadError; one that the loop runs returns, and an error inside it reaches the caller only."""
    from depthserve.errors import EngineDeadError

    async def main():
        llm, _ = _serve(ckpts["llama"])
        await llm.reset_prefix_cache()  # a live loop runs it

        real_reset = llm.engine.reset_prefix_cache
        llm.engine.reset_prefix_cache = lambda: (_ for _ in ()).throw(ValueError("bad reset"))
        with pytest.raises(ValueError, match="bad reset"):
            await llm.reset_prefix_cache()
        assert llm.is_healthy
        llm.engine.reset_prefix_cache = real_reset

        in_step, fail = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()

        def dying_step():
            loop.call_soon_threadsafe(in_step.set)
            asyncio.run_coroutine_threadsafe(fail.wait(), loop).result(timeout=30)
            raise RuntimeError("simulated device failure")

        llm.engine.step = dying_step
        stream = await llm.add_request("a b c", SamplingParams(max_tokens=8), None, "r0")
        await asyncio.wait_for(in_step.wait(), 30)
        reset = asyncio.ensure_future(llm.reset_prefix_cache())  # queued while the step runs
        await asyncio.sleep(0.05)
        fail.set()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(reset, 30)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):  # after the loop is gone: at once
            await asyncio.wait_for(llm.reset_prefix_cache(), 30)

        llm, _ = _serve(ckpts["llama"])
        llm._commands.put(("stop",))  # a stop ahead of the reset in the queue
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(llm.reset_prefix_cache(), 30)

        class LoopKiller(BaseException):
            pass

        llm, _ = _serve(ckpts["llama"])
        llm.engine.reset_prefix_cache = lambda: (_ for _ in ()).throw(LoopKiller())  # kills the loop itself
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(llm.reset_prefix_cache(), 30)
        assert not llm.is_healthy

    asyncio.run(main())


def test_disconnected_non_streaming_request_is_aborted(ckpts):
    llm, app = _serve(ckpts["llama"], max_model_len=1024)
    with live_server(app) as base:
        body = {"model": llm.engine.model_name, "prompt": "a b c", "max_tokens": 1000, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json=body, timeout=0.5)
        wait_idle(llm, timeout=10)
        assert llm.engine.block_manager.num_used_pages == 0
        assert metric_value(base, "depthserve_requests_total", outcome="aborted") == 1


@pytest.mark.parametrize("arch, knob", [("dreamer", "depth"), ("put", "loops")])
def test_dreamer_and_put_over_http_equal_offline_and_feed_the_metrics(tmp_path, smollm_tokenizer, arch, knob):
    path = make_tiny(arch, tmp_path / arch, seed=3, tokenizer=smollm_tokenizer)
    llm, app = _serve(path)
    offline = LLM(str(path), **ENGINE)
    model = llm.engine.model_name
    with live_server(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        spent = plain = 0.0
        for value in (1, 2):
            expected = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                        DepthParams.from_dict({knob: value}))
            got = client.completions.create(model=model, prompt=PROMPTS, max_tokens=6, temperature=0.0,
                                            extra_body={"depth": {knob: value}, "ignore_eos": True})
            assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [e.text for e in expected]
            usage = got.usage.model_extra["depth"]
            assert [p[knob] for p in usage["per_prompt"]] == [value] * len(PROMPTS)
            assert usage["flops"] == pytest.approx(sum(e.depth.flops for e in expected))
            spent += usage["flops"]
            plain += usage["plain_flops"]
            assert metric_value(base, "depthserve_depth_requests_by_setting_total",
                                knob=knob, value=str(value)) == len(PROMPTS)
        assert metric_value(base, "depthserve_depth_flops_total", kind="spent") == pytest.approx(spent)
        assert metric_value(base, "depthserve_depth_flops_total", kind="plain") == pytest.approx(plain)
        if arch == "dreamer":  # the step-lived depth cache: its last peak within what was set aside
            reserved = metric_value(base, "depthserve_step_cache_reserved_bytes")
            assert 0 < metric_value(base, "depthserve_step_cache_bytes", kind="token_depth") <= reserved
        wait_idle(llm)
        assert llm.engine.block_manager.num_used_pages == 0
