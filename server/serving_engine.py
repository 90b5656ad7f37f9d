"""What the OpenAI endpoints share: model ids and depth presets, request bodies to SamplingParams /
DepthParams, tokenizing on the tokenizer worker, admission through the engine thread, running the
prompts of one request concurrently, usage, and the tokenizer and model-list endpoints.

The server reaches the engine only through an `EngineClient` (depthserve/engine/client.py: the
engine thread's queue in `AsyncLLM`, or engine replicas on Ray Serve) and reads only the immutable
`ModelInfo` the engine published at start; it never touches engine or model state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from depthserve.depth import DepthParams, combine_reports
from depthserve.engine.client import EngineClient, OutputStream
from depthserve.engine.context_length import ContextOverflow
from depthserve.errors import EngineDeadError, InvalidRequestError, ModelNotFoundError, QueueFullError
from depthserve.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from depthserve.sampling_params import SamplingParams
from depthserve.server.metrics import RequestTimer, ServerMetrics
from depthserve.server.protocol import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ResponseModel,
    SamplingFields,
    TokenizeResponse,
    UsageInfo,
)
from depthserve.server.tokenization import TokenizerWorker
from depthserve.server.tool_calls import NO_TOOLS, ToolSetup
from depthserve.structured import Constraint, StructuredOutputError

# First item of every SSE generator: all its prompts were admitted. The route consumes it before
# the response starts, so a refusal (queue full, engine dead) is an HTTP error, not an empty stream.
ADMITTED = ""

logger = logging.getLogger("depthserve.server")


def sse(payload: ResponseModel | dict | str) -> str:
    if isinstance(payload, ResponseModel):
        data = payload.model_dump_json()
    else:
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


@dataclass
class Job:
    """One engine request: one prompt of an HTTP request."""

    prompt: str | list[int] | None
    token_ids: list[int]
    prompt_text: str | None


@dataclass(frozen=True)
class Prepared:
    """One HTTP request made ready for the engine: its prompts, sampling and depth settings, the tools
    it offers (chat), and the request field its structured-output constraint came from (an error
    compiling the constraint names that field)."""

    jobs: list[Job]
    params: SamplingParams
    depth: DepthParams
    tools: ToolSetup = NO_TOOLS
    constraint_field: str | None = None


class OpenAIServing:
    def __init__(self, llm: EngineClient, served_model_name: str, depth_presets: dict[str, dict] | None,
                 metrics: ServerMetrics, tokenizer_worker: TokenizerWorker):
        self.llm = llm
        self.info = llm.model_info
        self.model_name = served_model_name
        self.depth_presets = dict(depth_presets or {})
        self.metrics = metrics
        self.tokenizer_worker = tokenizer_worker
        self.max_model_len = self.info.max_model_len

    # ---- models ------------------------------------------------------------------------------------
    def model_ids(self) -> list[str]:
        return [self.model_name] + [f"{self.model_name}:{name}" for name in self.depth_presets]

    def preset_depth(self, model: str | None) -> dict:
        if model is None or model == self.model_name:
            return {}
        base, _, preset = model.partition(":")
        if base == self.model_name and preset in self.depth_presets:
            return dict(self.depth_presets[preset])
        shown = model if len(model) <= 100 else f"{model[:100]}... ({len(model)} characters)"
        raise ModelNotFoundError(f"the model '{shown}' does not exist; this server serves {self.model_ids()}")

    def list_models(self) -> ModelList:
        knobs = {name: spec.as_dict() for name, spec in self.info.depth_knobs.items()}
        created = int(time.time())
        chat = self.tokenizer_worker.tokenizer.chat_template is not None
        return ModelList(data=[ModelCard(id=model_id, created=created, max_model_len=self.max_model_len,
                                         depth_knobs=knobs, depth_preset=self.preset_depth(model_id) or None,
                                         supports_chat=chat)
                               for model_id in self.model_ids()])

    def retrieve_model(self, model_id: str) -> ModelCard:
        self.preset_depth(model_id)  # ModelNotFoundError (404) for an id this server does not serve
        return next(card for card in self.list_models().data if card.id == model_id)

    # ---- tokenizer endpoints (tokenizing runs on the tokenizer worker's thread) -----------------
    async def chat_prompt_ids(self, messages, tools: ToolSetup = NO_TOOLS) -> list[int]:
        """The chat prompt's token ids: the messages (and the tools offered) through the chat template."""
        conversation = [message.as_dict() for message in messages]
        return await self.tokenizer_worker.run(self.tokenizer_worker.encode_chat, conversation, tools)

    async def tokenize(self, prompt: str | None, messages, add_special_tokens: bool) -> TokenizeResponse:
        if messages is not None:
            ids = await self.chat_prompt_ids(messages)
        else:
            ids = await self.tokenizer_worker.run(self.tokenizer_worker.encode, prompt, add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len)

    async def detokenize(self, tokens: list[int]) -> DetokenizeResponse:
        vocab = self.info.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        return DetokenizeResponse(prompt=await self.tokenizer_worker.run(self.tokenizer_worker.decode, tokens))

    # ---- request building ---------------------------------------------------------------------------
    def depth_params(self, req: SamplingFields) -> DepthParams:
        merged = {**self.preset_depth(req.model), **(req.depth.knobs() if req.depth else {})}
        return DepthParams.from_dict(merged)

    @staticmethod
    def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, constraint: Constraint | None = None) -> SamplingParams:
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
            structured_outputs=constraint,
        )

    # ---- running requests ----------------------------------------------------------------------------
    async def admit(self, prepared: Prepared, request_id: str) -> list[OutputStream]:
        """Admit every prompt of one HTTP request, or none (validated and queued on the engine
        thread): a refusal raises before any response has started. A prompt plus max_tokens beyond
        the context is refused (a 400 naming the limit, as OpenAI's and vLLM's servers answer), not
        cut; a structured-output constraint that cannot be enforced is a 400 naming its field."""
        jobs = prepared.jobs
        ids = [request_id] if len(jobs) == 1 else [f"{request_id}-{i}" for i in range(len(jobs))]
        try:
            streams = await self.llm.add_requests([job.token_ids for job in jobs], prepared.params, prepared.depth, ids,
                                                  overflow=ContextOverflow.REFUSE)
            return list(streams)
        except StructuredOutputError as exc:
            raise (exc if exc.field else exc.located(prepared.constraint_field)) from None
        except (QueueFullError, EngineDeadError):
            self.metrics.requests.labels(outcome="rejected").inc()
            raise

    async def run(self, jobs: list[Job], streams: list[OutputStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (job index, cumulative output) as the admitted streams produce them.
        Closing this generator early (client gone) aborts every job that is still running."""
        queue: asyncio.Queue = asyncio.Queue()
        timers = [RequestTimer(self.metrics) for _ in jobs]
        generated = [0] * len(jobs)

        async def pump(i: int, stream: OutputStream) -> None:
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
            if streams:
                first = min((t.first for t in timers if t.first is not None), default=None)
                logger.info("%s %s: %d prompt + %d generated tokens%s, %.0f ms", streams[0].request_id.rsplit("-", 1)[0]
                            if len(streams) > 1 else streams[0].request_id, outcome,
                            sum(len(job.token_ids) for job in jobs), sum(generated),
                            "" if first is None else f", first token at {1000 * (first - timers[0].arrival):.0f} ms",
                            1000 * (time.monotonic() - timers[0].arrival))

    async def collect(self, prepared: Prepared, request_id: str) -> list[RequestOutput]:
        streams = await self.admit(prepared, request_id)
        final: list[RequestOutput | None] = [None] * len(prepared.jobs)
        async for i, out in self.run(prepared.jobs, streams):
            final[i] = out
        return final  # type: ignore[return-value]

    # ---- shared response pieces -------------------------------------------------------------------
    def token_text(self, token_id: int, entry: TokenLogprobs | None = None) -> str:
        """The token's text as the engine decoded it (else decoded here, on the server's tokenizer)."""
        if entry is not None and token_id in entry and entry[token_id].decoded_token is not None:
            return entry[token_id].decoded_token
        return self.tokenizer_worker.decode([token_id])


def new_depths(comp: CompletionOutput, sent: int) -> list[int] | None:
    """The per-token depths of the tokens a streamed chunk adds (None for a fixed knob)."""
    return None if comp.token_depths is None else comp.token_depths[sent:]


def usage(jobs: list[Job], outputs: list[RequestOutput | None]) -> UsageInfo:
    prompt_tokens = sum(len(job.token_ids) for job in jobs)
    completion_tokens = sum(len(c.token_ids) for out in outputs if out is not None for c in out.outputs)
    reports = [out.depth for out in outputs if out is not None and out.depth is not None]
    cached = sum(out.num_cached_tokens for out in outputs if out is not None)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                     depth=combine_reports(reports) if reports else None)
