"""Hostile input against a live server: every bad request gets an OpenAI-style 4xx (never a 5xx,
never a dead engine), and after each one a normal request and /health still answer and no
cache page is left behind. Also: a fault inside one request's step fails that request alone,
and the event loop stays responsive while huge bodies and long prompts are refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("uvicorn")

from depthserve.config import EngineArgs  # noqa: E402
from depthserve.engine.async_llm import AsyncLLM  # noqa: E402
from depthserve.engine.llm_engine import LLMEngine  # noqa: E402
from depthserve.server.app import build_app  # noqa: E402
from depthserve.server.serving_engine import OpenAIServing  # noqa: E402
from depthserve.lab.make_tiny import make_tiny  # noqa: E402
from tests.live_server import live_server, metric_value, wait_idle  # noqa: E402

API_KEY = "k"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ENGINE = dict(device="cpu", dtype="float32", load_progress=False, block_size=8, kv_cache_memory_gib=0.02,
              max_num_seqs=2)
MAX_WAITING = 2  # with max_num_seqs=2, the server holds at most 4 requests at once


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm_tokenizer):
    return make_tiny("llama", tmp_path_factory.mktemp("hardening") / "llama", seed=3, tokenizer=smollm_tokenizer)


def _engine(path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(path), **{**ENGINE, **kwargs}))


@pytest.fixture(scope="module")
def server(tiny_llama):
    llm = AsyncLLM(_engine(tiny_llama), max_waiting_requests=MAX_WAITING)
    with live_server(build_app(llm, served_model_name="tiny", api_key=API_KEY)) as base:
        yield base, llm


def _completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 4, **fields}


def _chat(content) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


SURROGATE_PROMPT = b'{"model": "tiny", "prompt": "ab\\ud800cd", "max_tokens": 4}'
SURROGATE_CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": "ab\\ud800cd"}], "max_tokens": 4}'
SURROGATE_TOKENIZE = b'{"prompt": "ab\\udfffcd"}'
JSON = {"Content-Type": "application/json"}

# (name, method, path, body: dict | bytes | None, extra headers, status, error type, words in the message)
BAD_REQUESTS = [
    ("repetition penalty that overflows", "POST", "/v1/completions",
     _completion(temperature=0.7, repetition_penalty=1e-40), None, 400, "invalid_request_error", "repetition_penalty"),
    ("repetition penalty too large", "POST", "/v1/completions", _completion(repetition_penalty=1e9), None, 400,
     "invalid_request_error", "repetition_penalty"),
    ("lone surrogate in a prompt", "POST", "/v1/completions", SURROGATE_PROMPT, JSON, 400, "invalid_request_error",
     "surrogate"),
    ("lone surrogate in a chat message", "POST", "/v1/chat/completions", SURROGATE_CHAT, JSON, 400,
     "invalid_request_error", "surrogate"),
    ("lone surrogate on /tokenize", "POST", "/tokenize", SURROGATE_TOKENIZE, JSON, 400, "invalid_request_error",
     "surrogate"),
    ("more prompts than the queue holds", "POST", "/v1/completions", _completion(prompt=["x"] * 300), None, 400,
     "invalid_request_error", "never be admitted"),
    ("one prompt more than the queue holds", "POST", "/v1/completions", _completion(prompt=["x"] * 5), None, 400,
     "invalid_request_error", "never be admitted"),
    ("max_tokens beyond the context", "POST", "/v1/completions", _completion(max_tokens=10**9), None, 400,
     "invalid_request_error", "maximum context length"),
    ("max_tokens of 2**64", "POST", "/v1/completions", _completion(max_tokens=2**64), None, 400,
     "invalid_request_error", "maximum context length"),
    ("chat max_tokens beyond the context", "POST", "/v1/chat/completions", {**_chat("hi"), "max_tokens": 5000},
     None, 400, "invalid_request_error", "maximum context length"),
    ("negative top_k", "POST", "/v1/completions", _completion(top_k=-5), None, 400, "invalid_request_error", "top_k"),
    ("seed beyond 64 bits", "POST", "/v1/completions", _completion(seed=2**70), None, 400, "invalid_request_error",
     "seed"),
    ("invalid JSON", "POST", "/v1/completions", b'{"model": "tiny", "prompt": ', JSON, 400, "invalid_request_error",
     "JSON"),
    ("a body that is not UTF-8", "POST", "/v1/completions", b'\xff\xfe{"model"}', JSON, 400,
     "invalid_request_error", "body"),
    ("a JSON array body", "POST", "/v1/completions", b"[1, 2]", JSON, 400, "invalid_request_error", ""),
    ("an empty body", "POST", "/v1/completions", b"", JSON, 400, "invalid_request_error", ""),
    ("NaN temperature", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', JSON,
     400, "invalid_request_error", "temperature"),
    ("infinite top_p", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', JSON, 400,
     "invalid_request_error", "top_p"),
    ("a string for an integer", "POST", "/v1/completions", _completion(max_tokens="4"), None, 400,
     "invalid_request_error", "max_tokens"),
    ("a depth knob the model lacks", "POST", "/v1/completions", _completion(depth={"loops": 2}), None, 400,
     "invalid_request_error", "loops"),
    ("a depth object of the wrong shape", "POST", "/v1/completions", _completion(depth=[1]), None, 400,
     "invalid_request_error", "depth"),
    ("an empty prompt", "POST", "/v1/completions", _completion(prompt=""), None, 400, "invalid_request_error",
     "prompt"),
    ("an empty prompt list", "POST", "/v1/completions", _completion(prompt=[]), None, 400, "invalid_request_error",
     "prompt"),
    ("a huge id list", "POST", "/v1/completions", _completion(prompt=[1] * 200_000), None, 400,
     "invalid_request_error", "context"),
    ("token ids outside the vocabulary", "POST", "/v1/completions", _completion(prompt=[1, 10**9]), None, 400,
     "invalid_request_error", "token ids"),
    ("an unknown model", "POST", "/v1/completions", _completion(model="nope"), None, 404, "not_found_error", "nope"),
    ("an unknown path", "GET", "/v2/everything", None, None, 404, "not_found_error", "not found"),
    ("a wrong method", "GET", "/v1/completions", None, None, 405, "invalid_request_error", "method"),
    ("/tokenize without the API key", "POST", "/tokenize", {"prompt": "x"}, {"Authorization": ""}, 401,
     "authentication_error", "API key"),
    ("/detokenize without the API key", "POST", "/detokenize", {"tokens": [1]}, {"Authorization": ""}, 401,
     "authentication_error", "API key"),
    ("a body over the limit", "POST", "/v1/completions", b"x" * (5 << 20), JSON, 413, "request_too_large", "limit"),
    ("a tool without a function", "POST", "/v1/chat/completions", {**_chat("hi"), "tools": [{"type": "function"}]},
     None, 400, "invalid_request_error", "tools[0]"),
    ("a tool message without its call id", "POST", "/v1/chat/completions",
     {**_chat("hi"), "messages": [{"role": "tool", "content": "42"}]}, None, 400, "invalid_request_error",
     "tool_call_id"),
    ("a named tool that is not offered", "POST", "/v1/chat/completions",
     {**_chat("hi"), "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, None, 400, "invalid_request_error",
     "tool_choice.function.name"),
    ("tool parameters that are not a schema", "POST", "/v1/chat/completions",
     {**_chat("hi"), "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     None, 400, "invalid_request_error", "tools[0]"),
    ("an unknown response_format", "POST", "/v1/chat/completions", {**_chat("hi"), "response_format": {"type": "xml"}},
     None, 400, "invalid_request_error", "response_format.type"),
    ("an invalid JSON schema", "POST", "/v1/completions",
     {**_completion(), "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     None, 400, "invalid_request_error", "response_format.json_schema.schema"),
    ("an unsupported JSON schema feature", "POST", "/v1/completions",
     {**_completion(), "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
     None, 400, "invalid_request_error", "response_format.json_schema.schema"),
    ("a regex that does not compile", "POST", "/v1/completions", {**_completion(), "structured_outputs": {"regex": "(a"}},
     None, 400, "invalid_request_error", "structured_outputs.regex"),
    ("a grammar that does not compile", "POST", "/v1/completions", {**_completion(), "guided_grammar": "start: nope"},
     None, 400, "invalid_request_error", "guided_grammar"),
    ("two constraints", "POST", "/v1/completions",
     {**_completion(), "guided_regex": "a", "response_format": {"type": "json_object"}}, None, 400,
     "invalid_request_error", "one way only"),
    ("a misspelt field", "POST", "/v1/completions", {**_completion(), "max_token": 4}, None, 400,
     "invalid_request_error", "unknown field 'max_token'"),
    ("a raw NUL in the body", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "a\x00b"}', JSON, 400,
     "invalid_request_error", "not valid JSON: Invalid control character at character 30"),
    ("a truncated body", "POST", "/v1/completions", b'{"model": "tiny", "prom', JSON, 400,
     "invalid_request_error", "not valid JSON"),
    ("an empty body", "POST", "/v1/completions", b"", JSON, 400, "invalid_request_error",
     "the body must be a JSON object (it is empty)"),
    ("a text/plain body", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "x"}',
     {"Content-Type": "text/plain"}, 400, "invalid_request_error", "sent as application/json, not text/plain"),
]

# OpenAI fields that do not change the output: accepted and ignored, on both endpoints.
IGNORED = {"store": True, "metadata": {"run": "7"}, "service_tier": "auto", "user": "u-1",
           "prompt_cache_key": "k", "safety_identifier": "s", "response_format": {"type": "text"}}


def _send(base: str, method: str, path: str, body, headers: dict | None) -> httpx.Response:
    sent = {**AUTH, **(headers or {})}
    if isinstance(body, dict):
        return httpx.request(method, f"{base}{path}", json=body, headers=sent, timeout=60)
    return httpx.request(method, f"{base}{path}", content=body, headers=sent, timeout=60)


def _assert_still_serving(base: str, llm: AsyncLLM) -> None:
    ok = httpx.post(f"{base}/v1/completions", json=_completion(), headers=AUTH, timeout=60)
    assert ok.status_code == 200, ok.text
    assert httpx.get(f"{base}/health").status_code == 200
    wait_idle(llm)
    assert llm.engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize("name, method, path, body, headers, status, err_type, words", BAD_REQUESTS,
                         ids=[row[0] for row in BAD_REQUESTS])
def test_bad_request_gets_a_clean_4xx_and_the_server_keeps_serving(server, name, method, path, body, headers, status,
                                                                   err_type, words):
    base, llm = server
    response = _send(base, method, path, body, headers)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == err_type and error["code"] == status
    assert words.lower() in error["message"].lower(), error["message"]
    assert error["param"] is None or not error["param"].isdigit()  # a parameter's name, never a body offset
    _assert_still_serving(base, llm)


# (the headers as sent; httpx sends a bytes value's bytes as they are)
ODD_AUTHORIZATION = [
    ("a non-ASCII byte as the token", [("Authorization", b"Bearer \xe9")], 401, "authentication_error", "API key"),
    ("the key and a non-ASCII byte", [("Authorization", f"Bearer {API_KEY}".encode() + b"\xe9")], 401,
     "authentication_error", "API key"),
    ("the key, then a wrong one", [("Authorization", f"Bearer {API_KEY}"), ("Authorization", "Bearer wrong")], 400,
     "invalid_request_error", "2 Authorization headers"),
    ("a wrong key, then the key", [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {API_KEY}")], 400,
     "invalid_request_error", "2 Authorization headers"),
]


@pytest.mark.parametrize("name, headers, status, err_type, words", ODD_AUTHORIZATION,
                         ids=[row[0] for row in ODD_AUTHORIZATION])
def test_odd_authorization_headers_get_a_json_4xx(server, name, headers, status, err_type, words):
    base, llm = server
    response = httpx.post(f"{base}/v1/completions", json=_completion(), headers=headers, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == err_type and error["code"] == status and words in error["message"]
    _assert_still_serving(base, llm)


def test_a_non_ascii_api_key_matches_its_utf8_bytes():
    from depthserve.server.app import _authorized

    sent = "Bearer clé".encode().decode("latin-1")  # what the server's header dict holds
    assert _authorized({"authorization": sent}, "clé")
    assert not _authorized({"authorization": sent}, "cle")


@pytest.mark.parametrize("path, body", [("/v1/completions", _completion(temperature=0.0)),
                                        ("/v1/chat/completions", {**_chat("hi"), "temperature": 0.0})])
def test_openai_fields_that_do_not_change_the_output_are_accepted_and_ignored(server, path, body):
    base, _ = server
    plain = httpx.post(f"{base}{path}", json=body, headers=AUTH, timeout=60)
    extra = httpx.post(f"{base}{path}", json={**body, **IGNORED}, headers=AUTH, timeout=60)
    assert plain.status_code == extra.status_code == 200, extra.text
    text = lambda r: [c.get("text") or c["message"]["content"] for c in r.json()["choices"]]  # noqa: E731
    assert text(extra) == text(plain)


def test_refused_generation_requests_are_counted_in_the_metrics(server):
    base, _ = server
    invalid = lambda: metric_value(base, "depthserve_requests_total", outcome="invalid")  # noqa: E731
    before = invalid()
    for body in (_completion(top_k=-5), _completion(model="nope"), {**_completion(), "max_token": 4}):
        assert _send(base, "POST", "/v1/completions", body, None).status_code in (400, 404)
    assert _send(base, "POST", "/v1/chat/completions", {**_chat("hi"), "tools": [{}]}, None).status_code == 400
    assert invalid() == before + 4


def test_the_queue_holds_exactly_running_plus_waiting_requests(server):
    base, llm = server
    four = httpx.post(f"{base}/v1/completions", json=_completion(prompt=["a", "b", "c", "d"]), headers=AUTH,
                      timeout=60)
    assert four.status_code == 200, four.text
    assert len(four.json()["choices"]) == 4
    _assert_still_serving(base, llm)


def test_openapi_documents_the_statuses_the_server_sends(server):
    base, _ = server
    schema = httpx.get(f"{base}/openapi.json").json()
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "401", "404", "413", "500", "503"} <= set(completions)
    assert completions["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "text/event-stream" in completions["200"]["content"]
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    metrics = httpx.get(f"{base}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")


def test_python_dash_m_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "depthserve", "models"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "smollm2-135m-instruct" in result.stdout


# ---- the event loop stays free ----------------------------------------------------------------
def _health_times_while(base: str, work: threading.Thread) -> tuple[list[float], float]:
    """Time /health calls (each alone) while `work` runs on another thread; also how long `work` took."""
    times = []
    with httpx.Client(timeout=30) as http:
        start_work = time.perf_counter()
        work.start()
        while work.is_alive() or not times:
            start = time.perf_counter()
            assert http.get(f"{base}/health").status_code == 200
            times.append(time.perf_counter() - start)
            time.sleep(0.01)
    work.join()
    return times, time.perf_counter() - start_work


def _assert_the_loop_kept_answering(times: list[float], work_seconds: float) -> None:
    """Work done on the event loop would hold one /health for about all of it. Every /health
    answered within a quarter of the work's time (and more than one was answered) shows the loop
    stayed free. Relative, not a fixed 100 ms: on 2 cores shared with another test worker an unblocked
    /health has taken 120 ms (GIL hand-offs with the tokenizer thread), while the work takes 0.6-2 s."""
    assert len(times) > 2, f"only {len(times)} /health answers during {work_seconds:.2f} s of work"
    assert max(times) < work_seconds / 4, (
        f"slowest /health: {max(times) * 1000:.0f} ms while the work took {work_seconds * 1000:.0f} ms")


def test_health_answers_within_100_ms_while_a_20_mb_body_is_refused(server):
    base, _ = server
    statuses = []

    def upload():
        body = b'{"model": "tiny", "prompt": "' + b"x" * (20 << 20) + b'"}'
        statuses.append(httpx.post(f"{base}/v1/completions", content=body, headers={**AUTH, **JSON},
                                   timeout=60).status_code)

    times, _ = _health_times_while(base, threading.Thread(target=upload))
    assert statuses == [413]
    assert max(times) < 0.1, f"slowest /health: {max(times) * 1000:.0f} ms"


def test_a_long_prompt_is_tokenized_off_the_event_loop(smollm_tokenizer, tmp_path):
    """SmolLM2's 8192-token context: prompts up to 8192 x 81 characters are tokenized (about a
    second for 600k characters), on the tokenizer thread while /health keeps answering."""
    path = make_tiny("llama", tmp_path / "long", seed=3, tokenizer=smollm_tokenizer)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    llm = AsyncLLM(_engine(path, max_model_len=8192))
    with live_server(build_app(llm, served_model_name="x")) as base:
        statuses = []
        text = "the quick brown fox jumps over the lazy dog " * 14000  # 630k characters, 126k tokens

        def send():
            statuses.append(httpx.post(f"{base}/v1/completions", json={"model": "x", "prompt": text},
                                       timeout=60).json()["error"]["message"])

        times, seconds = _health_times_while(base, threading.Thread(target=send))
        assert "maximum context length is 8192 tokens" in statuses[0], statuses
        _assert_the_loop_kept_answering(times, seconds)
        refused = httpx.post(f"{base}/tokenize", json={"prompt": "y" * 700_000}, timeout=60)
        assert refused.status_code == 400 and "more than 8192 tokens" in refused.json()["error"]["message"]


# ---- fault isolation ----------------------------------------------------------------------------
def _prompts(count: int) -> list[list[int]]:
    generator = random.Random(0)
    return [[generator.randrange(100, 4000) for _ in range(generator.randrange(5, 40))] for _ in range(count)]


@contextlib.contextmanager
def _fault_in_layer_1_for(llm: AsyncLLM, poisoned_prefix: str, error: Exception) -> Iterator[None]:
    """A hook on the model's second layer raises `error` in any step whose batch holds a request
    whose id starts with `poisoned_prefix` (the first layer has already written its cache then)."""
    runner = llm.engine.runner
    in_step: list[str] = []
    real_execute = runner.execute

    def execute(scheduled):
        in_step[:] = [item.seq.request_id for item in scheduled]
        return real_execute(scheduled)

    def hook(_module, _args):
        if any(request_id.startswith(poisoned_prefix) for request_id in in_step):
            raise error

    runner.execute = execute
    handle = runner.model.layers[1].register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        runner.execute = real_execute


async def _stream_text(http: httpx.AsyncClient, base: str, body: dict,
                       headers: dict | None = None) -> tuple[int, str, list[dict]]:
    """(status, concatenated text, error events) of one streamed completion."""
    text, errors = [], []
    async with http.stream("POST", f"{base}/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            return response.status_code, "", [json.loads(await response.aread())]
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
            elif chunk["choices"]:
                text.append(chunk["choices"][0]["text"])
    return 200, "".join(text), errors


def _run_streams(base: str, requests: list[tuple[dict, dict | None]]) -> list[tuple[int, str, list[dict]]]:
    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*[_stream_text(http, base, body, headers) for body, headers in requests])

    return asyncio.run(main())


def test_a_fault_in_one_requests_step_fails_only_that_request(tiny_llama):
    """The step that holds the poisoned request raises (in its second layer, after the first has
    written its cache): its sequences are re-run one by one, the poisoned request fails with the
    error, and the 16 others (greedy and seeded sampling) stream the same text as without the fault."""
    llm = AsyncLLM(_engine(tiny_llama, max_num_seqs=32, kv_cache_memory_gib=0.05))
    prompts = _prompts(17)
    bodies = [({"model": "x", "prompt": p, "max_tokens": 24, "ignore_eos": True, "stream": True,
                **({"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0.0})}, None)
              for i, p in enumerate(prompts)]
    poisoned_index = 8
    bodies[poisoned_index] = (bodies[poisoned_index][0], {"X-Request-Id": "poison"})
    with live_server(build_app(llm, served_model_name="x")) as base:
        expected = _run_streams(base, bodies)
        assert all(status == 200 and not errors for status, _, errors in expected)
        with _fault_in_layer_1_for(llm, "cmpl-poison", RuntimeError("poisoned request in the batch")):
            results = _run_streams(base, bodies)
        failed = results.pop(poisoned_index)
        expected.pop(poisoned_index)
        assert failed[0] == 200 and len(failed[2]) == 1, failed  # admitted, then one error event
        assert "poisoned request in the batch" in failed[2][0]["message"] and failed[2][0]["code"] == 500
        assert [text for _, text, _ in results] == [text for _, text, _ in expected]
        assert all(status == 200 and not errors for status, _, errors in results)
        wait_idle(llm)
        assert llm.engine.block_manager.num_used_pages == 0
        assert llm.engine.scheduler.num_preemptions >= 2  # the failed step's sequences were re-run
        assert httpx.get(f"{base}/health").status_code == 200
        again = httpx.post(f"{base}/v1/completions", json={**bodies[0][0], "stream": False}, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected[0][1]


def test_a_fault_in_a_non_streamed_request_is_a_500_with_the_reason(server):
    base, llm = server
    with _fault_in_layer_1_for(llm, "cmpl-bad", ValueError("bad row")):
        response = httpx.post(f"{base}/v1/completions", json=_completion(), headers={**AUTH, "X-Request-Id": "bad"},
                              timeout=60)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_error" and "ValueError: bad row" in error["message"]
    _assert_still_serving(base, llm)


def test_an_unhandled_exception_is_a_500_error_body_not_a_dropped_connection(server, monkeypatch):
    base, llm = server
    monkeypatch.setattr(OpenAIServing, "list_models", lambda self: 1 / 0)
    with httpx.Client(timeout=30) as http:
        response = http.get(f"{base}/v1/models", headers=AUTH)
        assert response.status_code == 500 and response.json()["error"]["type"] == "internal_error"
        assert http.get(f"{base}/health").status_code == 200  # on the same keep-alive connection
    monkeypatch.undo()
    _assert_still_serving(base, llm)
