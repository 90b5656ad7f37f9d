"""POST /v1/chat/completions: messages rendered with the model's chat template, one reply (n
choices), whole or streamed as SSE in OpenAI's chunk format."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from depthserve.depth import DepthParams
from depthserve.outputs import CompletionOutput, RequestOutput
from depthserve.sampling_params import SamplingParams
from depthserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    TokenLogprob,
    TopLogprob,
)
from depthserve.server.serving_engine import ADMITTED, Job, OpenAIServing, new_depths, sse, usage


class OpenAIServingChat(OpenAIServing):
    async def jobs(self, req: ChatCompletionRequest) -> tuple[list[Job], SamplingParams, DepthParams]:
        max_tokens = req.max_completion_tokens or req.max_tokens  # None: the rest of the context
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs)
        depth = self.depth_params(req)
        jobs = [Job(None, await self.chat_prompt_ids(req.messages), None)]
        return jobs, params, depth

    async def complete(self, req: ChatCompletionRequest, request_id: str) -> ChatCompletionResponse:
        jobs, params, depth = await self.jobs(req)
        (out,) = await self.collect(jobs, params, depth, request_id)
        choices = [ChatChoice(index=comp.index, message=ChatMessageOut(content=comp.text),
                              logprobs=self._logprobs(comp, req.top_logprobs or 0) if req.logprobs else None,
                              finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                              token_depths=comp.token_depths)
                   for comp in out.outputs]
        return ChatCompletionResponse(id=request_id, created=int(time.time()), model=req.model, choices=choices,
                                      usage=usage(jobs, [out]))

    async def stream(self, req: ChatCompletionRequest, request_id: str, jobs: list[Job], params: SamplingParams,
                     depth: DepthParams) -> AsyncIterator[str]:
        """SSE chunks. The first item is ADMITTED, yielded once the request is admitted (see admit)."""
        streams = await self.admit(jobs, params, depth, request_id)
        yield ADMITTED
        created = int(time.time())
        sent: dict[int, int] = {}
        logprobs_sent: dict[int, int] = {}
        tokens_sent: dict[int, int] = {}
        final: list[RequestOutput | None] = [None]

        def chunk(choices: list[ChatChunkChoice], with_usage: bool = False) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=req.model, choices=choices,
                                           usage=usage(jobs, final) if with_usage else None))

        yield chunk([ChatChunkChoice(index=j, delta=ChatDelta(role="assistant", content="")) for j in range(req.n)])
        async for _, out in self.run(jobs, streams):
            final[0] = out
            for comp in out.outputs:
                delta = comp.text[sent.get(comp.index, 0):]
                if not delta and not comp.finished:
                    continue
                sent[comp.index] = len(comp.text)
                logprobs = None
                if req.logprobs:
                    logprobs = self._logprobs(comp, req.top_logprobs or 0, logprobs_sent.get(comp.index, 0))
                    logprobs_sent[comp.index] = len(comp.token_ids)
                depths = new_depths(comp, tokens_sent.get(comp.index, 0))
                tokens_sent[comp.index] = len(comp.token_ids)
                yield chunk([ChatChunkChoice(index=comp.index, delta=ChatDelta(content=delta or None),
                                             logprobs=logprobs, finish_reason=comp.finish_reason,
                                             token_depths=depths)])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], with_usage=True)
        yield sse("[DONE]")

    def _logprobs(self, comp: CompletionOutput, top_n: int, start: int = 0) -> ChatLogprobs:
        content = []
        for token_id, entry in zip(comp.token_ids[start:], (comp.logprobs or [])[start:]):
            text = self.token_text(token_id, entry)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            top = [TopLogprob(token=alt, logprob=lp.logprob, bytes=list(alt.encode()))
                   for alt, lp in ((self.token_text(tid, entry), lp) for tid, lp in ranked if lp.rank <= top_n)]
            content.append(TokenLogprob(token=text, logprob=entry[token_id].logprob, bytes=list(text.encode()),
                                        top_logprobs=top))
        return ChatLogprobs(content=content)
