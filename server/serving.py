"""Serving logic: request bodies -> engine requests -> OpenAI response bodies and SSE chunks.

Routes (app.py) stay thin; everything about building SamplingParams/DepthParams, running the
prompts of one request concurrently, streaming deltas and shaping responses lives here.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from depthserve.depth import DepthParams
from depthserve.engine.async_llm import AsyncLLM, RequestStream
from depthserve.errors import EngineDeadError, InvalidRequestError, ModelNotFoundError, QueueFullError
from depthserve.outputs import RequestOutput, TokenLogprobs
from depthserve.sampling_params import SamplingParams
from depthserve.server.metrics import RequestTimer, ServerMetrics
from depthserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from depthserve.server.tokenization import TokenizerWorker

@dataclass
class _Job:
    """One engine request: one prompt of an HTTP request."""

    prompt: str | list[int]
    token_ids: list[int]
    prompt_text: str | None


# First item of every SSE generator here: all its prompts were admitted. The route consumes it
# before the response starts, so a refusal (queue full, engine dead) is an HTTP error, not an
# empty 200 stream.
ADMITTED = ""


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_name: str, depth_presets: dict[str, dict] | None,
                 metrics: ServerMetrics):
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.engine.tokenizer
        self.model_name = served_model_name
        self.depth_presets = dict(depth_presets or {})
        self.metrics = metrics
        self.max_model_len = llm.engine.max_model_len
        self.vocab_size = llm.engine.vocab_size
        self.tokenizer_worker = TokenizerWorker(self.tokenizer, self.max_model_len)

    # ---- models --------------------------------------------------------------------------------
    def model_ids(self) -> list[str]:
        return [self.model_name] + [f"{self.model_name}:{name}" for name in self.depth_presets]

    def preset_depth(self, model: str | None) -> dict:
        if model is None or model == self.model_name:
            return {}
        base, _, preset = model.partition(":")
        if base == self.model_name and preset in self.depth_presets:
            return dict(self.depth_presets[preset])
        raise ModelNotFoundError(f"the model '{model}' does not exist; this server serves {self.model_ids()}")

    def list_models(self) -> dict:
        knobs = {name: spec.as_dict() for name, spec in self.engine.model.depth_knobs().items()}
        created = int(time.time())
        data = []
        for model_id in self.model_ids():
            data.append({
                "id": model_id, "object": "model", "created": created, "owned_by": "depthserve",
                "max_model_len": self.engine.max_model_len, "depth_knobs": knobs,
                "depth_preset": self.preset_depth(model_id) or None,
            })
        return {"object": "list", "data": data}

    # ---- tokenizer endpoints (tokenizing runs on the tokenizer worker's thread) -----------------
    async def chat_prompt_ids(self, messages) -> list[int]:
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        return await self.tokenizer_worker.run(self.tokenizer_worker.encode_chat, conversation)

    async def tokenize(self, prompt: str | None, messages, add_special_tokens: bool) -> dict:
        if messages is not None:
            ids = await self.chat_prompt_ids(messages)
        else:
            ids = await self.tokenizer_worker.run(self.tokenizer_worker.encode, prompt, add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize(self, tokens: list[int]) -> dict:
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return {"prompt": await self.tokenizer_worker.run(self.tokenizer_worker.decode, tokens)}

    # ---- request building ---------------------------------------------------------------------------
    def depth_params(self, req: SamplingFields) -> DepthParams:
        merged = {**self.preset_depth(req.model), **(req.depth.knobs() if req.depth else {})}
        return DepthParams.from_dict(merged)

    @staticmethod
    def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )

    def _encode_prompts(self, prompts: list[str | list[int]]) -> list[_Job]:
        """On the tokenizer worker: text prompts to token ids (id prompts are checked by the engine)."""
        jobs = []
        for prompt in prompts:
            if isinstance(prompt, str):
                jobs.append(_Job(prompt, self.tokenizer_worker.encode(prompt) if prompt else [], prompt))
            else:
                jobs.append(_Job(prompt, list(prompt), None))
        return jobs

    def _check_context(self, jobs: list[_Job], max_tokens: int | None) -> None:
        """A prompt plus max_tokens beyond the context is a 400 naming the limit (as OpenAI's and
        vLLM's servers answer), not a silent cut. max_tokens None means the rest of the context."""
        for job in jobs:
            prompt_tokens = len(job.token_ids)
            if max_tokens is not None and prompt_tokens + max_tokens > self.max_model_len:
                raise InvalidRequestError(
                    f"this model's maximum context length is {self.max_model_len} tokens; the request asks "
                    f"for {prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} for the "
                    "completion): lower max_tokens or shorten the prompt")

    async def admit(self, jobs: list[_Job], params: SamplingParams, depth: DepthParams,
                    request_id: str) -> list[RequestStream]:
        """Admit every prompt of one HTTP request, or none (validated and queued on the engine
        thread): a refusal raises before any response has started."""
        ids = [request_id] if len(jobs) == 1 else [f"{request_id}-{i}" for i in range(len(jobs))]
        try:
            return await self.llm.add_requests([job.token_ids for job in jobs], params, depth, ids)
        except (QueueFullError, EngineDeadError):
            self.metrics.requests.labels(outcome="rejected").inc()
            raise

    async def _run(self, jobs: list[_Job], streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (job index, cumulative output) as the admitted streams produce them.
        Closing this generator early (client gone) aborts every job that is still running."""
        queue: asyncio.Queue = asyncio.Queue()
        timers = [RequestTimer(self.metrics) for _ in jobs]
        generated = [0] * len(jobs)

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, exc))
                return
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
        outcome = "aborted"
        try:
            remaining = len(jobs)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    outcome = "error"
                    raise item
                total = sum(len(o.token_ids) for o in item.outputs)
                timers[i].on_output(total - generated[i], item.metrics)
                generated[i] = total
                if item.finished:
                    self.metrics.record_depth(item.depth)
                yield i, item
            outcome = "success"
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:
                stream.close()
            for i, timer in enumerate(timers):
                timer.finish(outcome, len(jobs[i].token_ids), generated[i])

    async def _collect(self, jobs, params, depth, request_id) -> list[RequestOutput]:
        streams = await self.admit(jobs, params, depth, request_id)
        final: list[RequestOutput | None] = [None] * len(jobs)
        async for i, out in self._run(jobs, streams):
            final[i] = out
        return final  # type: ignore[return-value]

    # ---- completions ------------------------------------------------------------------------------
    async def completion_jobs(self, req: CompletionRequest) -> tuple[list[_Job], SamplingParams, DepthParams]:
        prompts = _prompt_list(req.prompt)
        scoring = req.echo and req.logprobs is not None
        params = self.sampling_params(req, req.max_tokens, req.logprobs,
                                      prompt_logprobs=req.logprobs if scoring else None)
        depth = self.depth_params(req)
        jobs = await self.tokenizer_worker.run(self._encode_prompts, prompts)
        self._check_context(jobs, params.max_tokens)
        return jobs, params, depth

    async def completion(self, req: CompletionRequest, request_id: str) -> dict:
        jobs, params, depth = await self.completion_jobs(req)
        outputs = await self._collect(jobs, params, depth, request_id)
        choices = []
        for i, (job, out) in enumerate(zip(jobs, outputs)):
            for comp in out.outputs:
                prompt_text = self._prompt_text(job) if req.echo else ""
                choice = {"index": i * req.n + comp.index, "text": prompt_text + comp.text,
                          "logprobs": None, "finish_reason": comp.finish_reason,
                          "stop_reason": comp.stop_reason}
                if req.logprobs is not None:
                    pairs = self._prompt_pairs(job, out) if req.echo else []
                    pairs += list(zip(comp.token_ids, comp.logprobs or [None] * len(comp.token_ids)))
                    position = 0 if req.echo else len(self._prompt_text(job))
                    choice["logprobs"] = self._completion_logprobs(pairs, position, req.logprobs)
                choices.append(choice)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": req.model, "choices": choices, "usage": _usage(jobs, outputs)}

    async def completion_stream(self, req: CompletionRequest, request_id: str, jobs, params, depth) -> AsyncIterator[str]:
        """SSE chunks. The first item is ADMITTED, yielded once every prompt is admitted (see admit)."""
        streams = await self.admit(jobs, params, depth, request_id)
        yield ADMITTED
        created = int(time.time())
        sent_text: dict[tuple[int, int], int] = {}
        sent_tokens: dict[tuple[int, int], int] = {}
        offsets: dict[tuple[int, int], int] = {}
        finals: list[RequestOutput | None] = [None] * len(jobs)

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            return _chunk(request_id, "text_completion", created, req.model, choices, usage)

        async for i, out in self._run(jobs, streams):
            if req.echo and finals[i] is None and _prompt_done(out):
                # The prompt goes first, once its logprobs (when asked for) are complete.
                prompt_text = self._prompt_text(jobs[i])
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._completion_logprobs(self._prompt_pairs(jobs[i], out), 0, req.logprobs)
                yield chunk([{"index": i * req.n + j, "text": prompt_text, "logprobs": logprobs,
                              "finish_reason": None} for j in range(req.n)])
            if req.echo and not _prompt_done(out):
                continue
            finals[i] = out
            for comp in out.outputs:
                key = (i, comp.index)
                delta = comp.text[sent_text.get(key, 0):]
                if not delta and not comp.finished:
                    continue
                sent_text[key] = len(comp.text)
                logprobs = None
                if req.logprobs is not None:
                    start = sent_tokens.get(key, 0)
                    pairs = list(zip(comp.token_ids[start:], (comp.logprobs or [])[start:]))
                    # Offsets count from the start of prompt + completion, as in a non-streamed response.
                    if key not in offsets:  # decode a token-id prompt once, not on every chunk
                        offsets[key] = len(self._prompt_text(jobs[i]))
                    position = offsets[key]
                    logprobs = self._completion_logprobs(pairs, position, req.logprobs)
                    offsets[key] = position + sum(len(t) for t in logprobs["tokens"])
                sent_tokens[key] = len(comp.token_ids)
                yield chunk([{"index": i * req.n + comp.index, "text": delta, "logprobs": logprobs,
                              "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], _usage(jobs, finals))
        yield sse("[DONE]")

    def _prompt_text(self, job: _Job) -> str:
        return job.prompt_text if job.prompt_text is not None else self.tokenizer.decode(job.token_ids)

    def _token_text(self, token_id: int, entry: TokenLogprobs | None = None) -> str:
        if entry is not None and token_id in entry and entry[token_id].decoded_token is not None:
            return entry[token_id].decoded_token
        return self.tokenizer.decode([token_id])

    def _prompt_pairs(self, job: _Job, out: RequestOutput) -> list[tuple[int, TokenLogprobs | None]]:
        return list(zip(job.token_ids, out.prompt_logprobs or [None] * len(job.token_ids)))

    def _completion_logprobs(self, pairs: list[tuple[int, TokenLogprobs | None]], position: int, top_n: int) -> dict:
        """The legacy completions logprobs object (what lm-evaluation-harness reads) for (token id,
        logprobs entry) pairs, with text offsets counted from `position`."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in pairs:
            text = self._token_text(token_id, entry)
            tokens.append(text)
            offsets.append(position)
            position += len(text)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(entry[token_id].logprob)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            top = [(tid, lp) for tid, lp in ranked if lp.rank <= top_n] if top_n else []
            top_logprobs.append({self._token_text(tid, entry): lp.logprob for tid, lp in top} if top_n else None)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    # ---- chat ---------------------------------------------------------------------------------------
    async def chat_jobs(self, req: ChatCompletionRequest) -> tuple[list[_Job], SamplingParams, DepthParams]:
        max_tokens = req.max_completion_tokens or req.max_tokens  # None: the rest of the context
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs)
        depth = self.depth_params(req)
        jobs = [_Job(None, await self.chat_prompt_ids(req.messages), None)]
        self._check_context(jobs, max_tokens)
        return jobs, params, depth

    async def chat(self, req: ChatCompletionRequest, request_id: str) -> dict:
        jobs, params, depth = await self.chat_jobs(req)
        (out,) = await self._collect(jobs, params, depth, request_id)
        choices = [{
            "index": comp.index,
            "message": {"role": "assistant", "content": comp.text},
            "logprobs": self._chat_logprobs(comp, req.top_logprobs or 0) if req.logprobs else None,
            "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason,
        } for comp in out.outputs]
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": req.model,
                "choices": choices, "usage": _usage(jobs, [out])}

    async def chat_stream(self, req: ChatCompletionRequest, request_id: str, jobs, params, depth) -> AsyncIterator[str]:
        """SSE chunks. The first item is ADMITTED, yielded once the request is admitted (see admit)."""
        streams = await self.admit(jobs, params, depth, request_id)
        yield ADMITTED
        created = int(time.time())
        sent: dict[int, int] = {}
        logprobs_sent: dict[int, int] = {}
        final: list[RequestOutput | None] = [None]

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            return _chunk(request_id, "chat.completion.chunk", created, req.model, choices, usage)

        yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for j in range(req.n)])
        async for _, out in self._run(jobs, streams):
            final[0] = out
            for comp in out.outputs:
                delta = comp.text[sent.get(comp.index, 0):]
                if not delta and not comp.finished:
                    continue
                sent[comp.index] = len(comp.text)
                logprobs = None
                if req.logprobs:
                    start = logprobs_sent.get(comp.index, 0)
                    logprobs = self._chat_logprobs(comp, req.top_logprobs or 0, start)
                    logprobs_sent[comp.index] = len(comp.token_ids)
                yield chunk([{"index": comp.index, "delta": {"content": delta} if delta else {},
                              "logprobs": logprobs, "finish_reason": comp.finish_reason}])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], _usage(jobs, final))
        yield sse("[DONE]")

    def _chat_logprobs(self, comp, top_n: int, start: int = 0) -> dict:
        content = []
        for token_id, entry in zip(comp.token_ids[start:], (comp.logprobs or [])[start:]):
            text = self._token_text(token_id, entry)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            content.append({
                "token": text, "logprob": entry[token_id].logprob, "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": self._token_text(tid, entry), "logprob": lp.logprob,
                     "bytes": list(self._token_text(tid, entry).encode())}
                    for tid, lp in ranked if lp.rank <= top_n
                ],
            })
        return {"content": content}


def _chunk(request_id: str, obj: str, created: int, model: str, choices: list[dict], usage: dict | None) -> str:
    body: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return sse(body)


def _prompt_done(out: RequestOutput) -> bool:
    """The prompt has been processed (its logprobs, if asked for, are complete)."""
    return out.finished or any(comp.token_ids for comp in out.outputs)


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def _usage(jobs: list[_Job], outputs: list[RequestOutput | None]) -> dict[str, Any]:
    prompt_tokens = sum(len(job.token_ids) for job in jobs)
    completion_tokens = sum(len(c.token_ids) for out in outputs if out is not None for c in out.outputs)
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    reports = [out.depth for out in outputs if out is not None and out.depth]
    if reports:
        usage["depth"] = reports[0] if len(reports) == 1 else combined_depth(reports)
    return usage


_SUMMED = ("tokens", "flops", "plain_flops")
_SUMMED_MAPS = ("loop_iterations", "selected_tokens")


def combined_depth(reports: list[dict]) -> dict[str, Any]:
    """One depth report for a request of several prompts: counts summed, `relative_compute` as
    total FLOPs over total plain FLOPs, settings kept where the prompts agree, and each
    prompt's own report under `per_prompt`."""
    total: dict[str, Any] = {}
    for key in reports[0]:
        values = [r.get(key) for r in reports]
        if key in _SUMMED:
            total[key] = sum(values)
        elif key in _SUMMED_MAPS:
            merged: dict = {}
            for value in values:
                for name, count in (value or {}).items():
                    merged[name] = merged.get(name, 0) + count
            total[key] = merged
        elif key == "extrapolated":
            total[key] = sorted({layer for value in values for layer in value})
        elif all(v == values[0] for v in values):
            total[key] = values[0]
    if all("flops" in r and "plain_flops" in r for r in reports):
        total["relative_compute"] = total["flops"] / total["plain_flops"] if total["plain_flops"] else 1.0
    else:
        total.pop("relative_compute", None)
    total["per_prompt"] = reports
    return total
