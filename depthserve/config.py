"""Engine arguments: one object, defaults that fit a small CPU machine."""

from __future__ import annotations

from dataclasses import dataclass, replace

from depthserve.errors import ConfigurationError
from depthserve.loading.registry import DEFAULT_MODEL

DEPTH_POLICIES = ("fixed", "slo", "confidence", "need")  # depthserve/engine/depth_policy.py


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    revision: str | None = None  # of a Hugging Face Hub model id: a branch, tag or commit (None: main)
    # auto: bfloat16 on CUDA and on CPUs with AVX-512 BF16 or AMX, float32 on other CPUs
    dtype: str = "auto"
    # Weight-only quantization on CPU (loading/quantization.py, vLLM's name): auto serves a GGUF in its
    # own format when activations are bf16; gguf: a GGUF's own format whatever the dtype; none:
    # dequantized weights; int8 / int4: quantized at load.
    quantization: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # default: the model's context length
    kv_cache_memory_gib: float | None = None  # default: 1 GiB on CPU, 60% of free GPU memory on CUDA
    block_size: int = 16
    # Per-step token budget (prefill chunks + decodes); None: 512 on CPU (a step's time tracks its tokens),
    # 8192 on CUDA (a step's launches cost the same for 16 tokens or 8192: prefill in few, large steps).
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    # Long prompts beside short ones (docs/server.md, "Scheduling"): a sequence prefilling more tokens
    # than this is long. None: 128 on CPU, 2048 on CUDA; 0: none is, and a chunk has no cap but the
    # step budget (a long prompt then delays every request that arrives after it until its prefill is done).
    long_prefill_token_threshold: int | None = None
    # A long prefill's chunk at context 0, in tokens: a step that runs it costs little more than a short
    # request's own step. None: 32 on CPU, the threshold on CUDA.
    long_prefill_chunk_tokens: int | None = None
    # The context (cached positions) at which a chunk's attention costs as much as its weights: a long
    # prefill's chunk at context c is capped at long_prefill_chunk_tokens / (1 + c / this). None: 1024
    # on CPU (measured, bench/prefill_chunks.py), 0 on CUDA (no shrinking).
    long_prefill_context_scale: int | None = None
    # Long prompts that may be mid-prefill at once; a long prompt beyond them waits while shorter ones
    # behind it are admitted.
    max_long_partial_prefills: int = 1
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; default: torch's choice
    seed: int = 0  # for unseeded sampling
    max_loops: int | None = None  # ceiling of a loop-count knob (BuildOptions.max_loops); default: the checkpoint's own
    load_progress: bool = True
    # auto: Triton kernels for tensors on CUDA (when triton imports), torch otherwise; torch: always
    # torch; triton: Triton on any device (on CPU under TRITON_INTERPRET=1, set before triton is imported)
    kernel_backend: str = "auto"
    # Decode-only steps padded to batch buckets and run through torch.compile (models with
    # static_decode). None: compiled on CUDA, eager on CPU; True: always eager; False: compiled.
    enforce_eager: bool | None = None
    # On CUDA, each batch bucket's compiled decode step captured as a CUDA graph at start-up and
    # replayed (one launch a step); False: the compiled step launches its kernels one by one.
    cuda_graphs: bool = True
    # Decode steps run back to back per engine step, each one's greedy token fed to the next on the
    # device (vLLM's multi-step scheduling; engine/static_decode.py "Steps ahead"): for compiled
    # decode-only batches of greedy rows with nothing to apply, when no request is waiting. None: 8
    # where decode steps are captured as CUDA graphs (the host's per-step work is then most of a
    # step), else 1.
    num_scheduler_steps: int | None = None
    # How deep the tokens of requests with a range knob run (depthserve/engine/depth_policy.py):
    # "fixed" (each range at its maximum), "slo" (as deep as keeps each step within tpot_slo_ms) or
    # "confidence" (each token until its readout is confident, confidence_threshold).
    depth_policy: str = "fixed"
    tpot_slo_ms: float | None = None
    # "confidence" (or "slo" with this set): a token of a range request whose readout is sampled stops
    # deepening at the first level of its range whose top-1 probability reaches this (models with a
    # readout per level).
    confidence_threshold: float | None = None
    # Prompt tokens by need: with a confidence threshold, a prompt token whose next token is in the
    # prompt stops at the first level of its range whose readout gives that token at least the
    # threshold's probability (teacher-forced; depthserve/engine/depth_policy.py). Off: prompt tokens
    # run the policy's level.
    prompt_exit: bool = False

    def step_token_budget(self, device_type: str) -> int:
        """max_num_batched_tokens, or its default on this kind of device."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if device_type == "cuda" else 512

    def long_prefill_caps(self, device_type: str) -> tuple[int, int]:
        """(long_prefill_token_threshold, long_prefill_context_scale), or their defaults on this kind
        of device: on CPU a step's time tracks its tokens and, at long context, its attention; on
        CUDA a step of a few thousand tokens costs little more than one of a few."""
        threshold = self.long_prefill_token_threshold
        scale = self.long_prefill_context_scale
        if threshold is None:
            threshold = 2048 if device_type == "cuda" else 128
        if scale is None:
            scale = 0 if device_type == "cuda" else 1024
        return threshold, scale

    def long_prefill_chunk(self, device_type: str) -> int:
        """long_prefill_chunk_tokens, or its default on this kind of device (0: the threshold)."""
        if self.long_prefill_chunk_tokens is not None:
            return self.long_prefill_chunk_tokens
        return 0 if device_type == "cuda" else 32

    def on_device(self, device_type: str) -> EngineArgs:
        """These arguments with the step token budget and the long-prefill caps resolved for this
        kind of device (their None defaults replaced)."""
        threshold, scale = self.long_prefill_caps(device_type)
        return replace(self, max_num_batched_tokens=self.step_token_budget(device_type),
                       long_prefill_token_threshold=threshold, long_prefill_context_scale=scale,
                       long_prefill_chunk_tokens=self.long_prefill_chunk(device_type))

    def scheduler_steps(self, cuda_graphs: bool) -> int:
        """num_scheduler_steps, or its default for a decode step captured as CUDA graphs or not."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        return 8 if cuda_graphs else 1

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigurationError(f"block_size must be a power of two, got {self.block_size}")
        if (self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1) or self.max_num_seqs < 1:
            raise ConfigurationError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.max_long_partial_prefills < 1:
            raise ConfigurationError(f"max_long_partial_prefills must be positive, got {self.max_long_partial_prefills}")
        for name in ("long_prefill_token_threshold", "long_prefill_chunk_tokens", "long_prefill_context_scale"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigurationError(f"{name} must be 0 (off) or positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigurationError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigurationError(f"num_threads must be positive, got {self.num_threads}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ConfigurationError("kv_cache_memory_gib must be positive")
        if self.num_scheduler_steps is not None and not 1 <= self.num_scheduler_steps <= 256:
            raise ConfigurationError(f"num_scheduler_steps must lie in 1..256, got {self.num_scheduler_steps}")
        if self.kernel_backend not in ("auto", "torch", "triton"):
            raise ConfigurationError(f"kernel_backend must be auto, torch or triton, got {self.kernel_backend!r}")
        if self.depth_policy not in DEPTH_POLICIES:
            raise ConfigurationError(f"depth_policy must be one of {', '.join(DEPTH_POLICIES)}, got {self.depth_policy!r}")
        if self.depth_policy in ("slo", "need") and not (self.tpot_slo_ms or 0) > 0:
            raise ConfigurationError(f"depth_policy {self.depth_policy} needs a positive tpot_slo_ms (the time per "
                                     "output token to keep)")
        if self.depth_policy in ("confidence", "need") and self.confidence_threshold is None:
            raise ConfigurationError(f"depth_policy {self.depth_policy} needs confidence_threshold (a top-1 "
                                     "probability in (0, 1])")
        if self.prompt_exit and self.confidence_threshold is None:
            raise ConfigurationError("prompt_exit needs confidence_threshold (the probability of the prompt's next token "
                                     "at which a prompt token stops)")
        if self.confidence_threshold is not None:
            if self.depth_policy == "fixed":
                raise ConfigurationError("confidence_threshold applies with depth_policy confidence, slo or need, not fixed")
            if not 0 < self.confidence_threshold <= 1:
                raise ConfigurationError(f"confidence_threshold must lie in (0, 1], got {self.confidence_threshold}")
        if self.quantization not in ("auto", "none", "gguf", "int8", "int4"):
            raise ConfigurationError(f"quantization must be auto, none, gguf, int8 or int4, got {self.quantization!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigurationError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
