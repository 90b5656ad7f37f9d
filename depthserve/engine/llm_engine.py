"""The engine: requests in, one `step()` at a time (schedule -> run -> postprocess), outputs out."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from depthserve.archs.base import DepthModel
from depthserve.config import EngineArgs
from depthserve.depth import DepthParams, DepthPlan, KnobSpec
from depthserve.detokenizer import IncrementalDetokenizer
from depthserve.engine.block_manager import BlockManager
from depthserve.engine.depth_policy import make_policy, replay_recorded_levels, token_levels
from depthserve.engine.model_runner import ModelRunner, SeqStepOutput, request_state
from depthserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from depthserve.engine.sequence import Sequence, SequenceStatus
from depthserve.errors import (
    CacheCapacityError,
    ConfigurationError,
    EmptyPromptError,
    InvalidRequestError,
    PromptTooLongError,
    UnadmittableRequestError,
)
from depthserve.kernels.dispatch import Kernels
from depthserve.loading.model_loader import load_model
from depthserve.loading.quantization import cpu_features, resolve_dtype
from depthserve.loading.registry import resolve_model
from depthserve.loading.tokenizer import load_tokenizer
from depthserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from depthserve.sampler import Sampler
from depthserve.sampling_params import SamplingParams

logger = logging.getLogger("depthserve.engine")

_GIB = 1 << 30


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None  # set when a fault traced to this request failed it

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _cpu_features(device: torch.device) -> str:
    return f" ({cpu_features()})" if device.type == "cpu" else ""


def _policy_summary(args: EngineArgs) -> str:
    """The depth policy and its settings, as the start-up line names them."""
    settings = []
    if args.tpot_slo_ms is not None and args.depth_policy == "slo":
        settings.append(f"TPOT target {args.tpot_slo_ms:g} ms")
    if args.confidence_threshold is not None:
        settings.append(f"exit at top-1 probability {args.confidence_threshold:g}")
    return args.depth_policy + (f" ({', '.join(settings)})" if settings else "")


class LLMEngine:
    def __init__(self, args: EngineArgs):
        args.validate()
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)  # asked for explicitly: torch's threads are per process
        self.device = _resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        args = self.args = replace(args, max_num_batched_tokens=args.step_token_budget(self.device.type))
        kernels = Kernels(args.kernel_backend)
        source = resolve_model(args.model)
        self.model_name = source.name
        self.tokenizer = load_tokenizer(source)
        loaded = load_model(source, self.dtype, self.device, args.max_model_len, args.load_progress,
                            max_loops=args.max_loops, quantization=args.quantization)
        self.model: DepthModel = loaded.model
        self.hf_config = loaded.hf_config
        self.max_model_len = loaded.max_model_len
        self.vocab_size = loaded.vocab_size
        self.quantization = loaded.quantization
        self.eos_token_ids = self._eos_ids()

        page_bytes = ModelRunner.page_bytes(args.block_size, self.model.head_dim, self.dtype)
        # Caches that live only during a step (Dreamer's per-token depth cache) take their worst
        # case for a full step out of the cache memory first; the pages get the rest.
        self.step_cache_reserved_bytes = self.model.step_cache_bytes_bound(args.max_num_batched_tokens)
        num_pages = int(max(self._kv_cache_bytes() - self.step_cache_reserved_bytes, 0) // page_bytes)
        if num_pages < 1:
            raise CacheCapacityError(
                f"the cache memory ({self._kv_cache_bytes() / _GIB:.3f} GiB) leaves no KV pages after the "
                f"{self.step_cache_reserved_bytes / _GIB:.3f} GiB a step's depth cache may need; raise "
                "kv_cache_memory_gib or lower max_num_batched_tokens"
            )
        self.block_manager = BlockManager(num_pages, args.block_size, args.enable_prefix_caching, page_bytes)
        base_layout = self.model.plan(DepthParams().normalized(self.model.depth_knobs())).layout
        if not self.block_manager.fits_ever(base_layout, self.max_model_len):
            raise CacheCapacityError(
                f"the KV cache ({num_pages} pages) cannot hold one sequence of max_model_len="
                f"{self.max_model_len}; raise kv_cache_memory_gib or lower max_model_len"
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                enable_chunked_prefill=args.enable_chunked_prefill,
            ),
            self.block_manager,
        )
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < self.max_model_len:
            raise ConfigurationError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
        self.depth_policy = make_policy(args.depth_policy, args.tpot_slo_ms, args.confidence_threshold)
        if args.confidence_threshold is not None and not self.model.readout_every_level:
            raise ConfigurationError(
                f"the confidence depth policy needs a model with a readout at every depth level (Dreamer); "
                f"{args.model} has none")
        self.depth_levels_run: dict[int, int] = {}  # range-knob tokens computed, by the level they ran
        self.depth_shed_tokens = 0  # range-knob tokens run below their range's maximum
        # When the last step ended, if requests were left unfinished then (else None): the time from
        # there to the next step's end is what a decoding client waited for its token.
        self._busy_step_end: float | None = None
        sampler = Sampler(self.eos_token_ids, self.vocab_size, seed=args.seed)
        self.runner = ModelRunner(self.model, self.block_manager, sampler, self.dtype, self.device, kernels)
        static_spec = self.model.static_decode_spec()
        if static_spec is not None and self._compiles_decode(args):
            self.runner.enable_static_decode(static_spec, -(-self.max_model_len // args.block_size),
                                             args.max_num_seqs, args.cuda_graphs)
        self._requests: dict[str, _Request] = {}
        self.prompt_tokens_computed = 0  # since start (recomputation after preemption included)
        self.tokens_generated = 0
        capped = (f" (capped from {args.max_model_len}: the model's context)"
                  if args.max_model_len is not None and args.max_model_len > self.max_model_len else "")
        knobs = ", ".join(f"{name} {k.minimum}..{k.maximum}" for name, k in self.model.depth_knobs().items())
        logger.info(
            "engine ready: %s (%s) on %s/%s%s, %d KV pages (%.2f GiB), max_model_len=%d%s, depth knobs: %s, "
            "depth policy %s, decode steps %s; %s",
            self.model_name, (self.hf_config.get("depth") or {}).get("architecture", "llama"), self.device,
            str(self.dtype).removeprefix("torch."), _cpu_features(self.device), num_pages, num_pages * page_bytes / _GIB,
            self.max_model_len, capped, knobs or "none", _policy_summary(args), self._decode_mode(),
            self.quantization.summary(),
        )

    def _decode_mode(self) -> str:
        static = self.runner.static
        if static is None:
            return "eager"
        return "compiled, CUDA graphs" if static.cuda_graphs else "compiled"

    def _compiles_decode(self, args: EngineArgs) -> bool:
        """Decode steps compiled at static shapes: asked for (enforce_eager=False) or by default on
        CUDA (for models with a static decode spec), on every kernel backend: the torch ops take no
        host synchronisation, so their steps capture as CUDA graphs too (kernels/dispatch.py)."""
        return not args.enforce_eager if args.enforce_eager is not None else self.device.type == "cuda"

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.model_name, self.max_model_len, self.vocab_size, dict(self.model.depth_knobs()),
                         copy.deepcopy(self.tokenizer))

    def _kv_cache_bytes(self) -> float:
        if self.args.kv_cache_memory_gib is not None:
            return self.args.kv_cache_memory_gib * _GIB
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return 0.6 * free
        return 1.0 * _GIB

    def _eos_ids(self) -> set[int]:
        ids = set()
        for value in (self.hf_config.get("eos_token_id"), self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(value)
        return ids

    # ---- requests ----------------------------------------------------------------------------
    def check_request(
        self, prompt: str | list[int], sampling: SamplingParams, depth: DepthParams | None = None
    ) -> ValidatedRequest:
        """Validate a request without touching engine state; `add_validated` queues the result.

        Raises a typed `InvalidRequestError` subclass for anything wrong with it. The depth plan is
        made here, once per request.
        """
        depth = (depth or DepthParams()).normalized(self.model.depth_knobs())  # "this model": no path in errors
        plan = self.model.plan(depth)
        sampling.validate()
        sampling.check_vocab(self.vocab_size)
        prompt_text, token_ids = self._tokenize(prompt)
        if len(token_ids) > self.max_model_len or (len(token_ids) == self.max_model_len and sampling.max_tokens):
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens; this model's context is {self.max_model_len} tokens"
            )
        room = self.max_model_len - len(token_ids)
        max_tokens = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
        if not self.block_manager.fits_ever(plan.layout, len(token_ids) + max_tokens):
            raise UnadmittableRequestError(
                f"the KV cache ({self.block_manager.num_pages} pages) can never hold this request "
                f"({len(token_ids)} prompt tokens + {max_tokens} new); lower max_tokens")
        return ValidatedRequest(prompt_text, token_ids, sampling, plan, max_tokens)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling: SamplingParams,
        depth: DepthParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request. `arrival_time` (time.monotonic()) is when it reached the
        server, if earlier."""
        self.add_validated(request_id, self.check_request(prompt, sampling, depth), arrival_time)

    def add_validated(self, request_id: str, request: ValidatedRequest, arrival_time: float | None = None) -> None:
        """Queue a request that `check_request` accepted."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        sampling, token_ids = request.sampling, request.prompt_token_ids
        entry = _Request(request_id, request.prompt_text, token_ids, sampling)
        for index in range(sampling.n):
            seq = Sequence(request_id, index, list(token_ids), sampling, request.plan, request.max_tokens)
            if arrival_time is not None:
                seq.arrival_time = arrival_time
            seq.generator = _generator(sampling.seed, index)
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, token_ids,
                skip_special_tokens=sampling.skip_special_tokens,
                stop=sampling.stop,
                include_stop_str_in_output=sampling.include_stop_str_in_output,
            )
            seq.logprobs = [] if sampling.logprobs is not None else None
            seq.prompt_logprobs = [None] if sampling.prompt_logprobs is not None else None
            seq.depth_record = self.model.new_record(request.plan)
            entry.seqs.append(seq)
        self._requests[request_id] = entry
        for seq in entry.seqs:
            self.scheduler.add(seq)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise EmptyPromptError("the prompt must be a non-empty string or a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return None, list(prompt)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            self.scheduler.finish(seq, "abort")
        return self._output(request)

    def warm_up(self, prompt_tokens: int = 8, new_tokens: int = 2) -> None:
        """Run one short request to its end and forget it: kernels that compile on first use (Triton's
        JIT on a fresh GPU host takes seconds per kernel) compile here, not in the first client's
        request. Counters, the prefix cache and the depth policy start from zero afterwards."""
        request_id = "depthserve-warm-up"
        prompt = [token for token in range(self.vocab_size) if token not in self.eos_token_ids][:1] * prompt_tokens
        self.add_request(request_id, prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        while self.has_unfinished_requests():
            self.step()
        self.reset_prefix_cache()
        self.block_manager.prefix_queries = self.block_manager.prefix_hits = 0
        self.scheduler.num_preemptions = 0
        self.prompt_tokens_computed = self.tokens_generated = self.depth_shed_tokens = 0
        self.depth_levels_run = {}
        self._busy_step_end = None
        # the warm-up's steps paid for compilation: a latency policy must not learn from them
        self.depth_policy = make_policy(self.args.depth_policy, self.args.tpot_slo_ms, self.args.confidence_threshold)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block that no sequence holds (benchmarks start cold with it)."""
        self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def num_running_requests(self) -> int:
        """Requests with at least one sequence in the running batch (the rest are waiting)."""
        return sum(any(seq.status is SequenceStatus.RUNNING for seq in r.seqs) for r in self._requests.values())

    def stats(self) -> dict:
        """Counters and gauges for metrics and health pages."""
        bm = self.block_manager
        page_bytes = ModelRunner.page_bytes(self.args.block_size, self.model.head_dim, self.dtype)
        stats = {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_pages_total": bm.num_pages,
            "kv_pages_used": bm.num_used_pages,
            "kv_bytes_used_by_kind": {kind.value: n * page_bytes for kind, n in bm.used_pages_by_kind().items()},
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "tokens_generated": self.tokens_generated,
            # the running sequences' compute per token relative to the model at its default depth
            "mean_relative_compute": (sum(seq.plan.relative_compute_estimate for seq in self.scheduler.running)
                                      / len(self.scheduler.running)) if self.scheduler.running else 1.0,
        }
        stats["depth_policy"] = self.depth_policy.name
        stats["depth_policy_target"] = self.depth_policy.target
        stats["depth_levels_run"] = dict(self.depth_levels_run)
        stats["depth_shed_tokens"] = self.depth_shed_tokens
        if self.step_cache_reserved_bytes:
            # Caches that live only during one step, outside the page pool (Dreamer's per-token
            # depth cache, SlotKind.TOKEN_DEPTH): held now (0 between steps) and the last step's peak.
            now, last = self.model.step_cache_bytes()
            stats["step_cache_bytes_by_kind"] = {kind.value: n for kind, n in now.items()}
            stats["last_step_cache_bytes_by_kind"] = {kind.value: n for kind, n in last.items()}
            stats["step_cache_reserved_bytes"] = self.step_cache_reserved_bytes
        return stats

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> postprocess. Returns the outputs of requests that changed.

        A step that raises fails only the request it is traced to (finish_reason "error", its pages
        freed): a step of several sequences is re-run one sequence at a time (Scheduler.isolate),
        and a step of one sequence that raises fails that sequence's request. Only a fault no
        request can be blamed for (a device error, out of memory) propagates."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.empty:
            self._busy_step_end = None
            return []
        scheduled = replay_recorded_levels(self.depth_policy.assign(plan.scheduled))
        # A seeded sequence's draws must not depend on a failed attempt: its re-run draws again.
        seeded = [(g, g.get_state()) for item in scheduled if (g := item.seq.generator) is not None]
        try:
            results = self.runner.execute(scheduled)
        except Exception as exc:
            if _is_device_fault(exc):
                raise
            for generator, state in seeded:
                generator.set_state(state)
            return self._on_step_fault(plan.scheduled, exc)
        self.scheduler.step_succeeded(scheduled)
        ran = [result.scheduled for result in results]  # with the levels tokens ran (confidence exits)
        self._count_levels(scheduled, ran)
        for result in results:
            item = result.scheduled
            self.prompt_tokens_computed += max(0, min(item.end, item.seq.num_prompt_tokens) - item.start)
            self.tokens_generated += result.sampled is not None
        outputs = self._postprocess(results)
        end = time.perf_counter()
        # The policy learns what a decoding client waits per token: this step, and the time since the
        # last step ended when the engine had work all along (output handling, the server's turn).
        self.depth_policy.observe(ran, end - (start if self._busy_step_end is None else self._busy_step_end))
        self._busy_step_end = end if self.has_unfinished_requests() else None
        return outputs

    def _count_levels(self, assigned: list[ScheduledSeq], ran: list[ScheduledSeq]) -> None:
        """Tokens per level run, and tokens shed: held below their range's maximum by the policy's
        cap (a confident token that stopped below its cap was not shed)."""
        for item in ran:
            for level in token_levels(item) or ():
                self.depth_levels_run[level] = self.depth_levels_run.get(level, 0) + 1
        for item in assigned:
            if item.level is not None:
                self.depth_shed_tokens += item.num_tokens * (item.level < item.seq.plan.elastic.maximum)

    def _on_step_fault(self, scheduled: list[ScheduledSeq], exc: Exception) -> list[RequestOutput]:
        if len(scheduled) > 1:
            logger.warning("a step of %d sequences failed (%s: %s); re-running each alone to trace the fault",
                           len(scheduled), type(exc).__name__, exc)
            self.scheduler.isolate(scheduled)
            return []
        request_id = scheduled[0].seq.request_id
        logger.error("request %s failed", request_id, exc_info=exc)
        failed = self._fail_request(request_id, f"{type(exc).__name__}: {exc}")
        return [failed] if failed is not None else []

    def _fail_request(self, request_id: str, reason: str) -> RequestOutput | None:
        """End every sequence of the request with finish_reason "error" (pages freed at once)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        request.error = reason
        for seq in request.seqs:
            self.scheduler.finish(seq, "error")
        return self._output(request)

    def _postprocess(self, results: list[SeqStepOutput]) -> list[RequestOutput]:
        touched: dict[str, _Request] = {}
        failed: list[RequestOutput] = []
        for result in results:
            seq = result.scheduled.seq
            request = self._requests.get(seq.request_id)
            if request is None:
                continue  # a sibling sequence failed the request earlier in this loop
            try:
                self._postprocess_one(seq, result)
            except Exception as exc:  # noqa: BLE001 - a fault of this request's own output
                logger.error("request %s failed after its step", seq.request_id, exc_info=exc)
                result.fault = f"{type(exc).__name__}: {exc}"
            if result.fault is not None:
                touched.pop(seq.request_id, None)
                out = self._fail_request(seq.request_id, result.fault)
                if out is not None:
                    failed.append(out)
                continue
            touched[seq.request_id] = request
        outputs = failed
        for request_id, request in touched.items():
            outputs.append(self._output(request))
            if request.finished:
                del self._requests[request_id]
        return outputs

    def _postprocess_one(self, seq: Sequence, result: SeqStepOutput) -> None:
        seq.num_computed_tokens = result.scheduled.end
        levels = token_levels(result.scheduled)
        if levels is not None:
            seq.levels[result.scheduled.start:result.scheduled.end] = levels
        self.block_manager.commit_computed(seq, seq.plan.cache_key)
        self._record_prompt_logprobs(seq, result)
        if result.sampled is not None:
            if levels is not None:
                seq.output_levels.append(levels[-1])  # the level of the position it was read from
            self._append_token(seq, result.sampled)
        elif result.scheduled.samples and result.fault is None and len(seq.output_token_ids) >= seq.max_tokens:
            self.scheduler.finish(seq, "length")  # max_tokens == 0: prompt scoring only

    def _append_token(self, seq: Sequence, sampled) -> None:
        token = sampled.token_id
        seq.output_token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        seq.cumulative_logprob += sampled.logprob
        if seq.logprobs is not None:
            entry = {token: Logprob(sampled.logprob, sampled.rank, self._decode_one(token))}
            for rank, (alt, lp) in enumerate(sampled.top_logprobs, start=1):
                entry.setdefault(alt, Logprob(lp, rank, self._decode_one(alt)))
            seq.logprobs.append(entry)
        stop_string = seq.detokenizer.add_token(token)
        sampling = seq.sampling
        num_out = len(seq.output_token_ids)
        if stop_string is not None:
            self.scheduler.finish(seq, "stop", stop_string)
        elif not sampling.ignore_eos and token in self.eos_token_ids and num_out >= sampling.min_tokens:
            self.scheduler.finish(seq, "stop")
        elif token in sampling.stop_token_ids and num_out >= sampling.min_tokens:
            self.scheduler.finish(seq, "stop", token)
        elif num_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            self.scheduler.finish(seq, "length")

    def _record_prompt_logprobs(self, seq: Sequence, result: SeqStepOutput) -> None:
        collected = seq.prompt_logprobs
        for item in result.prompt_logprobs:
            if item.position != len(collected):
                continue  # already scored before a preemption
            token = seq.prompt_token_ids[item.position]
            entry = {token: Logprob(item.logprob, item.rank, self._decode_one(token))}
            for rank, (alt, lp) in enumerate(item.top, start=1):
                entry.setdefault(alt, Logprob(lp, rank, self._decode_one(alt)))
            collected.append(entry)

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _output(self, request: _Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            finished = seq.finish_reason is not None
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.detokenizer.text(finished),
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=seq.logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    token_depths=list(seq.output_levels) if seq.plan.elastic is not None else None,
                )
            )
        first = request.seqs[0]
        finished = request.finished and request.error is None
        depth = self.model.report(request_state(first)) if finished else None  # once, at the end (not every step)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=completions,
            finished=request.finished,
            num_cached_tokens=first.num_cached_tokens,
            depth=depth,
            metrics=RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time),
            error=request.error,
        )


@dataclass(frozen=True)
class ModelInfo:
    """What a server needs to know about the served model, fixed at start: it reads this, never the
    engine, from its own threads."""

    name: str
    max_model_len: int
    vocab_size: int
    depth_knobs: dict[str, KnobSpec]
    tokenizer: Any  # a copy of the engine's tokenizer, for the server's own encoding and decoding


@dataclass(frozen=True)
class ValidatedRequest:
    """A request `check_request` accepted: its tokens, its depth plan (normalized knobs and the
    cache layout they need) and max_tokens resolved against the context."""

    prompt_text: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    plan: DepthPlan
    max_tokens: int


def _is_device_fault(exc: Exception) -> bool:
    """Faults of the machine, not of a request: out of memory, or a CUDA error (after which the
    device's state cannot be trusted). The engine stops on these instead of failing a request."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and ("CUDA error" in str(exc) or "device-side assert" in str(exc))


def _generator(seed: int | None, index: int) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed * 0x9E3779B1 + index) % (1 << 63))
