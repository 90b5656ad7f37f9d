"""The server reaches the engine only through the engine thread: validation (`check_request`) and the
depth plan (`DepthModel.plan`) run once per prompt, on that thread, never on the event loop; the
server reads only the ModelInfo published at start."""

from __future__ import annotations

import threading
from collections import Counter

import httpx
import pytest

pytest.importorskip("uvicorn")

from depthserve.config import EngineArgs  # noqa: E402
from depthserve.engine.async_llm import AsyncLLM  # noqa: E402
from depthserve.engine.llm_engine import LLMEngine  # noqa: E402
from depthserve.server.app import build_app  # noqa: E402
from depthserve.lab.make_tiny import make_tiny  # noqa: E402
from tests.live_server import live_server, wait_idle  # noqa: E402


def test_check_request_and_plan_run_once_per_prompt_on_the_engine_thread(tmp_path, smollm_tokenizer):
    path = make_tiny("itt", tmp_path / "itt", seed=2, tokenizer=smollm_tokenizer)
    engine = LLMEngine(EngineArgs(model=str(path), device="cpu", dtype="float32", load_progress=False,
                                  block_size=8, kv_cache_memory_gib=0.02))
    calls: Counter = Counter()
    threads: set[str] = set()

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            threads.add(threading.current_thread().name)
            return fn(*args, **kwargs)
        return call

    engine.check_request = counted("check_request", engine.check_request)
    engine.model.plan = counted("plan", engine.model.plan)
    llm = AsyncLLM(engine)
    with live_server(build_app(llm, served_model_name="itt")) as base:
        depth = {"selection_ratios": [0.5, 0.25]}
        bodies = [
            {"model": "itt", "prompt": ["one", "two", "three"], "max_tokens": 3, "depth": depth},
            {"model": "itt", "prompt": "four", "max_tokens": 3, "stream": True, "n": 2},
            {"model": "itt", "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2, "stream": True},
        ]
        for body in bodies:
            assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        chat = {"model": "itt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "depth": depth}
        assert httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60).status_code == 200
        bad = {"model": "itt", "prompt": "x", "depth": {"thinking_steps": 9}}
        assert httpx.post(f"{base}/v1/completions", json=bad, timeout=60).status_code == 400
        assert httpx.get(f"{base}/v1/models").status_code == 200
        assert httpx.post(f"{base}/tokenize", json={"prompt": "five six"}).status_code == 200
        wait_idle(llm)
    # 3 + 1 + 2 prompts, one chat, one refused request: each checked and planned exactly once
    # (n=2 shares its prompt's plan); the refused one is checked but fails before its plan.
    assert calls == {"check_request": 8, "plan": 7}
    assert threads == {"depthserve-engine"}


def test_a_slow_reader_of_newest_outputs_gets_the_same_request_in_fewer_items(tmp_path, smollm_tokenizer):
    """RequestStream.newest() (what a Ray Serve engine replica sends on): a reader slower than the engine
    skips to the newest cumulative output and ends with the same final output as a reader of every
    output."""
    import asyncio

    from depthserve.engine.context_length import ContextOverflow
    from depthserve.sampling_params import SamplingParams

    path = make_tiny("llama", tmp_path / "llama", seed=3, tokenizer=smollm_tokenizer)
    llm = AsyncLLM(LLMEngine(EngineArgs(model=str(path), device="cpu", dtype="float32", load_progress=False,
                                        kv_cache_memory_gib=0.02)))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def read(request_id: str, slow: bool) -> list:
        [stream] = await llm.add_requests([[5, 6, 7, 8]], params, None, [request_id], ContextOverflow.REFUSE)
        items = []
        async for out in (stream.newest() if slow else stream):
            items.append(out)
            if slow:
                await asyncio.sleep(0.05)
        return items

    async def main():
        every = await read("every", slow=False)
        newest = await read("newest", slow=True)
        await llm.shutdown()
        return every, newest

    every, newest = asyncio.run(main())
    assert len(every) == 24 and newest[-1].finished and len(newest) < len(every)
    assert newest[-1].outputs[0].token_ids == every[-1].outputs[0].token_ids
    assert newest[-1].outputs[0].text == every[-1].outputs[0].text
    counts = [len(out.outputs[0].token_ids) for out in newest]
    assert counts == sorted(counts)
