"""The offline Python API: `LLM.generate` and `LLM.score`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC
from dataclasses import fields

from tqdm.auto import tqdm

from depthserve.config import EngineArgs
from depthserve.depth import DepthParams
from depthserve.engine.llm_engine import LLMEngine
from depthserve.errors import InvalidRequestError
from depthserve.outputs import RequestOutput
from depthserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Load a model and run batches of prompts through the engine.

    `LLM(model="smollm2-135m-instruct" | path | "org/name", revision=None, dtype=..., device=...,
    **engine_args)`; any `EngineArgs` field may be passed by name. A Hugging Face Hub id (`org/name`)
    is served from the local Hub cache, downloaded first where it is not there; `revision` (a branch,
    tag or commit of it) picks another snapshot than main (docs/checkpoint-format.md).
    """

    def __init__(self, model: str = EngineArgs.model, revision: str | None = None, **kwargs):
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {unknown}")
        self.engine = LLMEngine(EngineArgs(model=model, revision=revision, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        depth: DepthParams | SequenceABC[DepthParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string or a list of token ids. `sampling_params` and `depth` are one
        object for all prompts or one per prompt. A max_tokens past the model's context is cut to
        the rest of it (ContextOverflow.CLAMP, depthserve/engine/context_length.py).
        """
        prompt_list = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        depths = _per_prompt(depth or DepthParams(), len(prompt_list), "depth")
        request_ids = []
        try:
            for prompt, p, d in zip(prompt_list, params, depths):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, p, d)
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise

    def score(self, prompts: Prompt | SequenceABC[Prompt], depth: DepthParams | None = None) -> list[list[float | None]]:
        """Log-probability of each prompt token given its prefix.

        One list per prompt, aligned with its tokens: element 0 is None (the first token has
        no prefix), element i is log p(token_i | tokens_0..i-1).
        """
        params = SamplingParams(max_tokens=0, prompt_logprobs=0, temperature=0.0)
        outputs = self.generate(prompts, params, depth)
        scores = []
        for out in outputs:
            row: list[float | None] = [None]
            for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
                row.append(entry[token].logprob)
            scores.append(row)
        return scores

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None,
             depth: DepthParams | None = None) -> RequestOutput:
        """Apply the model's chat template to one conversation and generate the reply."""
        ids = self.apply_chat_template(messages)
        return self.generate([ids], sampling_params, depth)[0]

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt prefixes (e.g. between benchmark runs over the same prompts)."""
        self.engine.reset_prefix_cache()

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise InvalidRequestError("this model has no chat template")
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm)
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
                    bar.update(1)
        bar.close()
        return [final[r] for r in request_ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequestError("prompts must be a string, a list of token ids, or a non-empty list of those")
    return list(prompts)


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
