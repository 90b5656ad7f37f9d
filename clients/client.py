"""A small client for depthserve's OpenAI-compatible API, sync and async, with streaming and the
depth knobs as typed keyword arguments.

    client = DepthServeClient("http://127.0.0.1:8000")
    for piece in client.chat([{"role": "user", "content": "Hi"}], stream=True, loops=2):
        print(piece, end="")
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx


class DepthServeAPIError(RuntimeError):
    def __init__(self, status: int, body: dict | str):
        self.status = status
        self.body = body
        message = body.get("error", {}).get("message", body) if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {message}")


def depth_settings(loops: int | dict[int, int] | None = None, selection_ratios: list[float] | None = None,
                   thinking_steps: int | None = None, depth: int | None = None) -> dict[str, Any] | None:
    """The request's `depth` object from typed knobs (None when no knob is set)."""
    knobs = {"loops": loops, "selection_ratios": selection_ratios, "thinking_steps": thinking_steps, "depth": depth}
    knobs = {k: v for k, v in knobs.items() if v is not None}
    return knobs or None


def _body(model: str | None, default_model: str, depth: dict | None, **fields: Any) -> dict[str, Any]:
    body = {"model": model or default_model, **{k: v for k, v in fields.items() if v is not None}}
    if depth:
        body["depth"] = depth
    return body


def _check(response: httpx.Response) -> None:
    if response.status_code >= 400:
        try:
            body = response.json()
        except ValueError:
            body = response.text
        raise DepthServeAPIError(response.status_code, body)


def _sse_payloads(lines: Iterator[str]) -> Iterator[dict]:
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data.strip() == "[DONE]":
            return
        yield json.loads(data)


def _delta_text(chunk: dict) -> str:
    pieces = []
    for choice in chunk.get("choices", []):
        pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


def _finish_reason(chunk: dict) -> str | None:
    return next((c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")), None)


class DepthServeClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 model: str | None = None, timeout: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)
        self.model = model or self.models()[0]["id"]
        self.last_finish_reason: str | None = None  # of the last streamed reply: "stop", "length", ...

    def close(self) -> None:
        self._http.close()

    def models(self) -> list[dict]:
        response = self._http.get("/v1/models")
        _check(response)
        return response.json()["data"]

    def complete(self, prompt: str | list[int], *, stream: bool = False, model: str | None = None,
                 max_tokens: int = 16, temperature: float | None = None, loops=None, selection_ratios=None,
                 thinking_steps=None, depth=None, **extra: Any):
        """The completion's text, or with stream=True an iterator over text pieces."""
        body = _body(model, self.model, depth_settings(loops, selection_ratios, thinking_steps, depth),
                     prompt=prompt, max_tokens=max_tokens, temperature=temperature, stream=stream, **extra)
        return self._stream("/v1/completions", body) if stream else self._post("/v1/completions", body)["choices"][0]["text"]

    def chat(self, messages: list[dict[str, str]], *, stream: bool = False, model: str | None = None,
             max_tokens: int | None = None, temperature: float | None = None, loops=None, selection_ratios=None,
             thinking_steps=None, depth=None, **extra: Any):
        """The reply's text, or with stream=True an iterator over text pieces."""
        body = _body(model, self.model, depth_settings(loops, selection_ratios, thinking_steps, depth),
                     messages=messages, max_tokens=max_tokens, temperature=temperature, stream=stream, **extra)
        if stream:
            return self._stream("/v1/chat/completions", body)
        return self._post("/v1/chat/completions", body)["choices"][0]["message"]["content"]

    def _post(self, path: str, body: dict) -> dict:
        response = self._http.post(path, json=body)
        _check(response)
        return response.json()

    def _stream(self, path: str, body: dict) -> Iterator[str]:
        with self._http.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                response.read()
                _check(response)
            self.last_finish_reason = None
            for chunk in _sse_payloads(response.iter_lines()):
                self.last_finish_reason = _finish_reason(chunk) or self.last_finish_reason
                text = _delta_text(chunk)
                if text:
                    yield text


class AsyncDepthServeClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 model: str | None = None, timeout: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout)
        self.model = model

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _model(self, model: str | None) -> str:
        if model or self.model:
            return model or self.model
        response = await self._http.get("/v1/models")
        _check(response)
        self.model = response.json()["data"][0]["id"]
        return self.model

    async def chat(self, messages: list[dict[str, str]], *, model: str | None = None, max_tokens: int | None = None,
                   temperature: float | None = None, loops=None, selection_ratios=None, thinking_steps=None,
                   depth=None, **extra: Any) -> str:
        body = _body(await self._model(model), "", depth_settings(loops, selection_ratios, thinking_steps, depth),
                     messages=messages, max_tokens=max_tokens, temperature=temperature, **extra)
        response = await self._http.post("/v1/chat/completions", json=body)
        _check(response)
        return response.json()["choices"][0]["message"]["content"]

    async def chat_stream(self, messages: list[dict[str, str]], *, model: str | None = None,
                          max_tokens: int | None = None, temperature: float | None = None, loops=None,
                          selection_ratios=None, thinking_steps=None, depth=None, **extra: Any) -> AsyncIterator[str]:
        body = _body(await self._model(model), "", depth_settings(loops, selection_ratios, thinking_steps, depth),
                     messages=messages, max_tokens=max_tokens, temperature=temperature, stream=True, **extra)
        async with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code >= 400:
                await response.aread()
                _check(response)
            async for line in response.aiter_lines():
                for chunk in _sse_payloads(iter([line])):
                    text = _delta_text(chunk)
                    if text:
                        yield text
                if line.strip() == "data: [DONE]":
                    return
