"""POST /v1/chat/completions: messages rendered with the model's chat template, one reply (n
choices), whole or streamed as SSE in OpenAI's chunk format. With tools offered, each choice's text
is parsed into content and `tool_calls` (server/tool_calls/), whole or as streamed deltas."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from depthserve.outputs import CompletionOutput, RequestOutput
from depthserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    FunctionCallOut,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
)
from depthserve.server.serving_engine import ADMITTED, Job, OpenAIServing, Prepared, new_depths, sse, usage
from depthserve.server.structured_request import RequestConstraint, request_constraint
from depthserve.server.tool_calls import (
    ContentDelta,
    ParsedToolCall,
    StreamDelta,
    ToolCallStreamParser,
    parse_tool_calls,
    tool_setup,
)


class OpenAIServingChat(OpenAIServing):
    async def prepare(self, req: ChatCompletionRequest) -> Prepared:
        max_tokens = req.max_completion_tokens or req.max_tokens  # None: the rest of the context
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        tools = tool_setup(req.tools, req.tool_choice, req.parallel_tool_calls)
        tool_constraint = tools.constraint()
        found = request_constraint(req, None if tool_constraint is None else RequestConstraint(tool_constraint, "tools"))
        params = self.sampling_params(req, max_tokens, logprobs, constraint=None if found is None else found.constraint)
        jobs = [Job(None, await self.chat_prompt_ids(req.messages, tools), None)]
        return Prepared(jobs, params, self.depth_params(req), tools, None if found is None else found.field)

    async def complete(self, req: ChatCompletionRequest, request_id: str) -> ChatCompletionResponse:
        prepared = await self.prepare(req)
        (out,) = await self.collect(prepared, request_id)
        parse = prepared.tools.offered
        choices = []
        for comp in out.outputs:
            content, calls = parse_tool_calls(comp.text) if parse else (comp.text, [])
            message = ChatMessageOut(content=content, tool_calls=[_call_out(call) for call in calls] or None)
            choices.append(ChatChoice(index=comp.index, message=message,
                                      logprobs=self._logprobs(comp, req.top_logprobs or 0) if req.logprobs else None,
                                      finish_reason=_finish_reason(comp.finish_reason, bool(calls)),
                                      stop_reason=comp.stop_reason, token_depths=comp.token_depths))
        return ChatCompletionResponse(id=request_id, created=int(time.time()), model=req.model, choices=choices,
                                      usage=usage(prepared.jobs, [out]))

    async def stream(self, req: ChatCompletionRequest, request_id: str, prepared: Prepared) -> AsyncIterator[str]:
        """SSE chunks. The first item is ADMITTED, yielded once the request is admitted (see admit)."""
        streams = await self.admit(prepared, request_id)
        jobs = prepared.jobs
        yield ADMITTED
        created = int(time.time())
        sent: dict[int, int] = {}
        logprobs_sent: dict[int, int] = {}
        tokens_sent: dict[int, int] = {}
        parsers = {j: ToolCallStreamParser() for j in range(req.n)} if prepared.tools.offered else {}
        final: list[RequestOutput | None] = [None]

        def chunk(choices: list[ChatChunkChoice], with_usage: bool = False) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=req.model, choices=choices,
                                           usage=usage(jobs, final) if with_usage else None))

        yield chunk([ChatChunkChoice(index=j, delta=ChatDelta(role="assistant", content="")) for j in range(req.n)])
        async for _, out in self.run(jobs, streams):
            final[0] = out
            for comp in out.outputs:
                text = comp.text[sent.get(comp.index, 0):]
                if not text and not comp.finished:
                    continue
                sent[comp.index] = len(comp.text)
                logprobs = None
                if req.logprobs:
                    logprobs = self._logprobs(comp, req.top_logprobs or 0, logprobs_sent.get(comp.index, 0))
                    logprobs_sent[comp.index] = len(comp.token_ids)
                depths = new_depths(comp, tokens_sent.get(comp.index, 0))
                tokens_sent[comp.index] = len(comp.token_ids)
                deltas, finish = _deltas(parsers.get(comp.index), text, comp.finish_reason)
                if not deltas and finish is None and logprobs is None and not depths:
                    continue  # the parser holds the text back (a tag not yet complete)
                deltas = deltas or [ChatDelta()]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    yield chunk([ChatChunkChoice(index=comp.index, delta=delta, logprobs=logprobs if last else None,
                                                 finish_reason=finish if last else None,
                                                 token_depths=depths if last else None)])

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


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended by itself with calls in it."""
    return "tool_calls" if called and reason == "stop" else reason


def _call_out(call: ParsedToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments_json))


def _deltas(parser: ToolCallStreamParser | None, text: str, finish_reason: str | None) -> tuple[list[ChatDelta], str | None]:
    """A choice's new text as chunk deltas (content, or tool-call pieces when tools are offered; none
    while the parser holds text back), and its finish reason."""
    if parser is None:
        return [ChatDelta(content=text or None)], finish_reason
    pieces = parser.feed(text)
    called = False
    if finish_reason is not None:
        end = parser.finish()
        pieces += end.deltas
        called = end.tool_called
    return [ChatDelta(**piece.openai_delta()) for piece in _merged(pieces)], _finish_reason(finish_reason, called)


def _merged(pieces: list[StreamDelta]) -> list[StreamDelta]:
    """Neighbouring content pieces as one."""
    out: list[StreamDelta] = []
    for piece in pieces:
        if out and isinstance(piece, ContentDelta) and isinstance(out[-1], ContentDelta):
            out[-1] = ContentDelta(out[-1].text + piece.text)
        else:
            out.append(piece)
    return out
