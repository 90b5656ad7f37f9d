"""POST /v1/completions: prompts (text, token ids, or lists of either) to completions, whole or
streamed as SSE; `echo` + `logprobs` + `max_tokens: 0` scores prompts (lm-evaluation-harness)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from depthserve.outputs import RequestOutput, TokenLogprobs
from depthserve.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from depthserve.server.structured_request import request_constraint
from depthserve.server.serving_engine import ADMITTED, Job, OpenAIServing, Prepared, new_depths, sse, usage

TokenEntry = tuple[int, TokenLogprobs | None]  # a token id and its logprobs entry


class OpenAIServingCompletion(OpenAIServing):
    async def prepare(self, req: CompletionRequest) -> Prepared:
        scoring = req.echo and req.logprobs is not None
        found = request_constraint(req)
        params = self.sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs=req.logprobs if scoring else None,
                                      constraint=None if found is None else found.constraint)
        jobs = await self.tokenizer_worker.run(self._encode_prompts, _prompt_list(req.prompt))
        return Prepared(jobs, params, self.depth_params(req), constraint_field=None if found is None else found.field)

    def _encode_prompts(self, prompts: list[str | list[int]]) -> list[Job]:
        """On the tokenizer worker: text prompts to token ids (id prompts are checked by the engine)."""
        return [Job(p, self.tokenizer_worker.encode(p) if p else [], p) if isinstance(p, str) else Job(p, list(p), None)
                for p in prompts]

    async def complete(self, req: CompletionRequest, request_id: str) -> CompletionResponse:
        prepared = await self.prepare(req)
        outputs = await self.collect(prepared, request_id)
        jobs = prepared.jobs
        choices = []
        for i, (job, out) in enumerate(zip(jobs, outputs)):
            for comp in out.outputs:
                prompt_text = self._prompt_text(job) if req.echo else ""
                logprobs = None
                if req.logprobs is not None:
                    pairs = self._prompt_pairs(job, out) if req.echo else []
                    pairs += list(zip(comp.token_ids, comp.logprobs or [None] * len(comp.token_ids)))
                    position = 0 if req.echo else len(self._prompt_text(job))
                    logprobs = self._logprobs(pairs, position, req.logprobs)
                choices.append(CompletionChoice(index=i * req.n + comp.index, text=prompt_text + comp.text,
                                                logprobs=logprobs, finish_reason=comp.finish_reason,
                                                stop_reason=comp.stop_reason, token_depths=comp.token_depths))
        return CompletionResponse(id=request_id, created=int(time.time()), model=req.model, choices=choices,
                                  usage=usage(jobs, outputs))

    async def stream(self, req: CompletionRequest, request_id: str, prepared: Prepared) -> AsyncIterator[str]:
        """SSE chunks. The first item is ADMITTED, yielded once every prompt is admitted (see admit)."""
        streams = await self.admit(prepared, request_id)
        jobs = prepared.jobs
        yield ADMITTED
        created = int(time.time())
        sent_text: dict[tuple[int, int], int] = {}
        sent_tokens: dict[tuple[int, int], int] = {}
        offsets: dict[tuple[int, int], int] = {}
        finals: list[RequestOutput | None] = [None] * len(jobs)

        def chunk(choices: list[CompletionChoice], with_usage: bool = False) -> str:
            return sse(CompletionResponse(id=request_id, created=created, model=req.model, choices=choices,
                                          usage=usage(jobs, finals) if with_usage else None))

        async for i, out in self.run(jobs, streams):
            if req.echo and finals[i] is None and _prompt_done(out):
                # The prompt goes first, once its logprobs (when asked for) are complete.
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._logprobs(self._prompt_pairs(jobs[i], out), 0, req.logprobs)
                yield chunk([CompletionChoice(index=i * req.n + j, text=self._prompt_text(jobs[i]), logprobs=logprobs)
                             for j in range(req.n)])
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
                    logprobs = self._logprobs(pairs, offsets[key], req.logprobs)
                    offsets[key] += sum(len(t) for t in logprobs.tokens)
                depths = new_depths(comp, sent_tokens.get(key, 0))
                sent_tokens[key] = len(comp.token_ids)
                yield chunk([CompletionChoice(index=i * req.n + comp.index, text=delta, logprobs=logprobs,
                                              finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                                              token_depths=depths)])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], with_usage=True)
        yield sse("[DONE]")

    def _prompt_text(self, job: Job) -> str:
        return job.prompt_text if job.prompt_text is not None else self.tokenizer_worker.decode(job.token_ids)

    @staticmethod
    def _prompt_pairs(job: Job, out: RequestOutput) -> list[TokenEntry]:
        return list(zip(job.token_ids, out.prompt_logprobs or [None] * len(job.token_ids)))

    def _logprobs(self, pairs: list[TokenEntry], position: int, top_n: int) -> CompletionLogprobs:
        """The legacy completions logprobs of (token id, logprobs entry) pairs, with text offsets
        counted from `position`."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in pairs:
            text = self.token_text(token_id, entry)
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
            top_logprobs.append({self.token_text(tid, entry): lp.logprob for tid, lp in top} if top_n else None)
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                                  text_offset=offsets)


def _prompt_done(out: RequestOutput) -> bool:
    """The prompt has been processed (its logprobs, if asked for, are complete)."""
    return out.finished or any(comp.token_ids for comp in out.outputs)


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)
