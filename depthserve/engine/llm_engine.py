"""The engine: requests in, one `step()` at a time (schedule -> run -> postprocess), outputs out.

The pieces around the step are their own modules: `requests` (validation, the engine's record of
a request), `context_length` (how many tokens a request may generate), `capacity` (the KV pages),
`output_processor` (logprobs, text, stops, `RequestOutput`s), `depth_accounting` (depth counters
and reports) and `step_clock` (the wait per token a latency depth policy learns from)."""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from depthserve.archs.base import DepthModel
from depthserve.config import EngineArgs
from depthserve.depth import DepthParams, KnobSpec
from depthserve.engine.capacity import kv_usage, new_block_manager, size_kv_cache
from depthserve.engine.context_length import ContextOverflow
from depthserve.engine.depth_accounting import DepthAccounting
from depthserve.engine.depth_policy import DepthPolicy, make_policy, replay_recorded_levels
from depthserve.engine.model_runner import ModelRunner, SeqStepOutput
from depthserve.engine.output_processor import OutputProcessor, eos_token_ids
from depthserve.engine.requests import Request, RequestValidator, ValidatedRequest, new_request
from depthserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from depthserve.engine.sequence import SequenceStatus
from depthserve.engine.step_clock import DecodeWaitClock
from depthserve.engine.structured_output import StructuredOutputs
from depthserve.errors import ConfigurationError, InvalidRequestError
from depthserve.kernels.dispatch import Kernels
from depthserve.engine.model_loader import load_model
from depthserve.loading.quantization import cpu_features, resolve_dtype
from depthserve.loading.registry import resolve_model, weight_bytes
from depthserve.loading.tokenizer import load_tokenizer
from depthserve.outputs import RequestOutput
from depthserve.sampler import Sampler
from depthserve.sampling_params import SamplingParams

logger = logging.getLogger("depthserve.engine")


class LLMEngine:
    def __init__(self, args: EngineArgs):
        args.validate()
        if args.num_threads:
            torch.set_num_threads(args.num_threads)  # asked for explicitly: torch's threads are per process
        self.device = _resolve_device(args.device)
        source = resolve_model(args.model, args.revision)
        self.dtype = resolve_dtype(args.dtype, self.device, weight_bytes(source))
        self.args = args = args.on_device(self.device.type)
        kernels = Kernels(args.kernel_backend, native_cpu=self.device.type == "cpu")
        self.model_name, self.tokenizer = source.name, load_tokenizer(source)
        loaded = load_model(source, self.dtype, self.device, args.max_model_len, args.load_progress,
                            max_loops=args.max_loops, quantization=args.quantization)
        self.model: DepthModel = loaded.model
        self.hf_config, self.max_model_len, self.vocab_size = loaded.hf_config, loaded.max_model_len, loaded.vocab_size
        self.quantization = loaded.quantization
        self.eos_token_ids = eos_token_ids(self.hf_config, self.tokenizer)
        self.capacity = size_kv_cache(self.model, args, self.device, self.dtype)
        self.block_manager = new_block_manager(self.capacity, args, self.model, self.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig.from_engine_args(args, self.max_model_len), self.block_manager)
        self.depth_policy = _depth_policy(args, self.model)
        self.depth_accounting = DepthAccounting(self.model, self.capacity.step_cache_reserved_bytes)
        self.structured = StructuredOutputs(self.tokenizer, self.eos_token_ids, _core_to_spare(self.device),
                                            native_apply=kernels.apply_token_bitmask)
        self.validator = RequestValidator(self.model, self.tokenizer, self.vocab_size, self.max_model_len, self.block_manager,
                                          self.structured)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        sampler = Sampler(self.eos_token_ids, self.vocab_size, args.seed, kernels.greedy_pick)  # None off the CPU
        self.runner = ModelRunner(self.model, self.block_manager, sampler, self.dtype, self.device, kernels, self.structured)
        _compile_decode_steps(self.runner, self.model, args, self.device, self.max_model_len)
        self._requests: dict[str, Request] = {}
        self.prompt_tokens_computed = self.tokens_generated = 0  # since start (recomputed prompts count again)
        self.decode_wait = DecodeWaitClock()
        _log_ready(self)

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.model_name, self.max_model_len, self.vocab_size, dict(self.model.depth_knobs()),
                         copy.deepcopy(self.tokenizer))

    # ---- requests ----------------------------------------------------------------------------
    def check_request(self, prompt: str | list[int], sampling: SamplingParams, depth: DepthParams | None = None,
                      overflow: ContextOverflow = ContextOverflow.CLAMP, grammar: Any = None) -> ValidatedRequest:
        """Validate a request (typed `InvalidRequestError`s) without touching engine state; `add_validated` queues
        it. `overflow`: context_length.py; `grammar`: its constraint compiled already (`self.structured.compile`)."""
        return self.validator.check(prompt, sampling, depth, overflow, grammar)

    def add_request(self, request_id: str, prompt: str | list[int], sampling: SamplingParams,
                    depth: DepthParams | None = None, arrival_time: float | None = None) -> None:
        """Validate and queue a request (max_tokens past the context is clamped). `arrival_time`
        (time.monotonic()) is when it reached the server, if earlier."""
        self.add_validated(request_id, self.check_request(prompt, sampling, depth), arrival_time)

    def add_validated(self, request_id: str, request: ValidatedRequest, arrival_time: float | None = None) -> None:
        """Queue a request that `check_request` accepted."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        entry = new_request(request_id, request, arrival_time)
        for seq in entry.seqs:
            self.output_processor.start(seq)
            seq.depth_record = self.depth_accounting.new_record(seq.plan)
        self._requests[request_id] = entry
        for seq in entry.seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self._requests.pop(request_id, None)
        return None if request is None else self._finish(request, "abort")

    def warm_up(self, prompt_tokens: int = 8, new_tokens: int = 2) -> None:
        """Run one short request to its end and forget it: kernels that compile on first use (Triton's
        JIT on a fresh GPU host takes seconds per kernel) compile here, not in the first client's
        request. Counters, the prefix cache and the depth policy start from zero afterwards."""
        prompt = [token for token in range(self.vocab_size) if token not in self.eos_token_ids][:1] * prompt_tokens
        self.add_request("depthserve-warm-up", prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        while self.has_unfinished_requests():
            self.step()
        self.reset_prefix_cache()
        self.block_manager.prefix_queries = self.block_manager.prefix_hits = 0
        self.scheduler.num_preemptions = self.prompt_tokens_computed = self.tokens_generated = 0
        self.depth_accounting.reset()
        self.decode_wait = DecodeWaitClock()
        # the warm-up's steps paid for compilation: a latency policy must not learn from them
        self.depth_policy = _depth_policy(self.args, self.model)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block that no sequence holds (benchmarks start cold with it)."""
        self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> dict:
        """Counters and gauges for metrics and health pages."""
        return {
            **self.scheduler.queue_stats(), **kv_usage(self.block_manager, self.capacity.page_bytes),
            "prompt_tokens_computed": self.prompt_tokens_computed, "tokens_generated": self.tokens_generated,
            "mean_relative_compute": self.scheduler.mean_relative_compute(),
            "depth_policy": self.depth_policy.name, "depth_policy_target": self.depth_policy.target,
            **self.depth_accounting.stats(),
        }

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> run -> postprocess. Returns the outputs of requests that changed.

        A step that raises fails only the request it is traced to (finish_reason "error", its pages
        freed): a step of several sequences is re-run one sequence at a time (Scheduler.isolate),
        and a step of one sequence that raises fails that sequence's request. Only a fault no
        request can be blamed for (a device error, out of memory) propagates."""
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.empty:
            self.decode_wait.idle()
            return []
        scheduled = replay_recorded_levels(self.depth_policy.assign(scheduler_output.scheduled))
        steps = self.scheduler.look_ahead(scheduled, self.runner.max_steps_ahead(scheduled))
        rewind_generators = _generator_rewinder(scheduled)
        try:
            per_step = self.runner.execute_ahead(scheduled, steps) if steps > 1 else [self.runner.execute(scheduled)]
        except Exception as exc:
            if _is_device_fault(exc):
                raise
            rewind_generators()
            return self._on_step_fault(scheduler_output.scheduled, exc)
        self.scheduler.step_succeeded(scheduled)
        touched: dict[str, Request] = {}  # requests with new output, built once at the end (outputs are cumulative)
        failed: list[RequestOutput] = []
        for results in per_step:
            # Steps ahead: a sequence that finished at an earlier step drops the tokens computed past its end.
            results = [result for result in results if result.scheduled.seq.status is SequenceStatus.RUNNING]
            ran = [result.scheduled for result in results]  # with the levels tokens ran (confidence exits)
            self.depth_accounting.count_step(scheduled, ran)  # steps ahead: no item has a level to shed
            self.prompt_tokens_computed += sum(max(0, min(i.end, i.seq.num_prompt_tokens) - i.start) for i in ran)
            self.tokens_generated += sum(result.sampled is not None for result in results)
            failed += self._postprocess(results, touched)
        wait = self.decode_wait.lap(start, work_left=self.has_unfinished_requests())
        self.depth_policy.observe(ran, wait / len(per_step))
        return failed + [self._output(request) for request in touched.values()]

    def _on_step_fault(self, scheduled: list[ScheduledSeq], exc: Exception) -> list[RequestOutput]:
        if len(scheduled) > 1:
            logger.warning("a step of %d sequences failed (%s: %s); re-running each alone to trace the fault",
                           len(scheduled), type(exc).__name__, exc)
            self.scheduler.isolate(scheduled)
            return []
        if (request := self._requests.pop(scheduled[0].seq.request_id, None)) is None:
            return []
        logger.error("request %s failed", request.request_id, exc_info=exc)
        return [self._finish(request, "error", f"{type(exc).__name__}: {exc}")]

    def _finish(self, request: Request, reason: str, error: str | None = None) -> RequestOutput:
        """End a request taken off the engine: each sequence ("abort", or "error" with why), pages freed."""
        request.error = error
        for seq in request.seqs:
            self.scheduler.finish(seq, reason)
        return self._output(request)

    def _postprocess(self, results: list[SeqStepOutput], touched: dict[str, Request]) -> list[RequestOutput]:
        """Take in one decode step's results: the requests with new output join `touched`; returns the
        outputs of the requests that failed (taken out of `touched`)."""
        failed: list[RequestOutput] = []
        for result in results:
            request_id = result.scheduled.seq.request_id
            if request_id not in self._requests:
                continue  # a sibling sequence failed the request earlier in this loop
            fault = self._postprocess_one(result)
            if fault is None:
                touched[request_id] = self._requests[request_id]
            else:
                touched.pop(request_id, None)
                failed.append(self._finish(self._requests.pop(request_id), "error", fault))
        for request_id, request in touched.items():
            if request.finished:
                self._requests.pop(request_id, None)
        return failed

    def _postprocess_one(self, result: SeqStepOutput) -> str | None:
        """Advance the sequence past its step and take in what it sampled; returns the fault that
        fails its request (the sampler's, or one raised here), else None."""
        seq = result.scheduled.seq
        try:
            seq.num_computed_tokens = result.scheduled.end
            self.depth_accounting.record_levels(result)
            self.block_manager.commit_computed(seq, seq.plan.cache_key)
            finish = self.output_processor.process(seq, result)
            if finish is not None:
                self.scheduler.finish(seq, finish.reason, finish.stop_reason)
        except Exception as exc:  # noqa: BLE001 - a fault of this request's own output
            logger.error("request %s failed after its step", seq.request_id, exc_info=exc)
            return f"{type(exc).__name__}: {exc}"
        return result.fault

    def _output(self, request: Request) -> RequestOutput:
        return self.output_processor.build(request, self.depth_accounting.final_report(request))


@dataclass(frozen=True)
class ModelInfo:
    """What a server needs to know about the served model, fixed at start: it reads this, never the
    engine, from its own threads."""

    name: str
    max_model_len: int
    vocab_size: int
    depth_knobs: dict[str, KnobSpec]
    tokenizer: Any  # a copy of the engine's tokenizer, for the server's own encoding and decoding


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _core_to_spare(device: torch.device) -> bool:
    """Whether a thread beside the model's can run without taking a core from it."""
    return device.type != "cpu" or torch.get_num_threads() < (os.cpu_count() or 1)


def _compile_decode_steps(runner: ModelRunner, model: DepthModel, args: EngineArgs, device: torch.device,
                          max_model_len: int) -> None:
    """Decode steps compiled at static shapes, for models with a static decode spec: where asked for
    (enforce_eager=False) or by default on CUDA, on every kernel backend: the torch ops take no host
    synchronisation, so their steps capture as CUDA graphs too (kernels/dispatch.py)."""
    spec = model.static_decode_spec()
    compiles = not args.enforce_eager if args.enforce_eager is not None else device.type == "cuda"
    if spec is not None and compiles:
        graphs = args.cuda_graphs and device.type == "cuda"
        runner.enable_static_decode(spec, -(-max_model_len // args.block_size), args.max_num_seqs, args.cuda_graphs,
                                    args.scheduler_steps(graphs))


def _depth_policy(args: EngineArgs, model: DepthModel) -> DepthPolicy:
    if args.confidence_threshold is not None and not model.readout_every_level:
        raise ConfigurationError(
            f"the confidence depth policy needs a model with a readout at every depth level; "
            f"{args.model} has none")
    return make_policy(args.depth_policy, args.tpot_slo_ms, args.confidence_threshold, args.prompt_exit)


def _policy_summary(args: EngineArgs) -> str:
    """The depth policy and its settings, as the start-up line names them."""
    settings = []
    if args.tpot_slo_ms is not None and args.depth_policy in ("slo", "need"):
        settings.append(f"TPOT target {args.tpot_slo_ms:g} ms")
    if args.confidence_threshold is not None:
        settings.append(f"exit at top-1 probability {args.confidence_threshold:g}")
    if args.prompt_exit:
        settings.append("prompt tokens by need")
    return args.depth_policy + (f" ({', '.join(settings)})" if settings else "")


def _log_ready(engine: LLMEngine) -> None:
    """The start-up line: model, device, KV capacity, context, depth knobs and policy, decode steps."""
    args, capacity = engine.args, engine.capacity
    capped = (f" (capped from {args.max_model_len}: the model's context)"
              if args.max_model_len is not None and args.max_model_len > engine.max_model_len else "")
    knobs = ", ".join(f"{name} {k.minimum}..{k.maximum}" for name, k in engine.model.depth_knobs().items())
    static = engine.runner.static
    decode = "eager" if static is None else "compiled, CUDA graphs" if static.cuda_graphs else "compiled"
    features = f" ({cpu_features()})" if engine.device.type == "cpu" else ""
    logger.info(
        "engine ready: %s (%s) on %s/%s%s, %d KV pages (%.2f GiB), max_model_len=%d%s, depth knobs: %s, "
        "depth policy %s, decode steps %s; %s",
        engine.model_name, (engine.hf_config.get("depth") or {}).get("architecture", "llama"), engine.device,
        str(engine.dtype).removeprefix("torch."), features, capacity.num_pages, capacity.pages_gib,
        engine.max_model_len, capped, knobs or "none", _policy_summary(args), decode, engine.quantization.summary(),
    )


def _generator_rewinder(scheduled: list[ScheduledSeq]) -> Callable[[], None]:
    """Puts the step's seeded generators back as they are now: a seeded sequence's draws must not
    depend on a failed attempt (its re-run draws again)."""
    states = [(g, g.get_state()) for item in scheduled if (g := item.seq.generator) is not None]

    def rewind() -> None:
        for generator, state in states:
            generator.set_state(state)
    return rewind


def _is_device_fault(exc: Exception) -> bool:
    """Faults of the machine, not of a request: out of memory, or a CUDA error (after which the
    device's state cannot be trusted). The engine stops on these instead of failing a request."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and ("CUDA error" in str(exc) or "device-side assert" in str(exc))

