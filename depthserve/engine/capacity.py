"""How much KV cache the engine gets: its memory, less what step-lived caches may need, in pages."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from depthserve.archs.base import DepthModel
from depthserve.config import EngineArgs
from depthserve.depth import DepthParams
from depthserve.engine.block_manager import BlockManager
from depthserve.engine.model_runner import ModelRunner
from depthserve.errors import CacheCapacityError, ConfigurationError

GIB = 1 << 30
CPU_CACHE_BYTES = 1 * GIB  # the cache memory on CPU when kv_cache_memory_gib is not set ...
CPU_CACHE_ENV = "DEPTHSERVE_CPU_KVCACHE_SPACE"  # ... unless this names it in GiB (vLLM: VLLM_CPU_KVCACHE_SPACE)
CUDA_FREE_FRACTION = 0.6  # ... and on CUDA: this share of the memory free at start


@dataclass(frozen=True)
class KVCapacity:
    num_pages: int
    page_bytes: int
    # The worst case of the caches that live only during a step (Dreamer's per-token depth cache)
    # for a full step, taken out of the cache memory before the pages get the rest.
    step_cache_reserved_bytes: int

    @property
    def pages_gib(self) -> float:
        return self.num_pages * self.page_bytes / GIB


def cache_memory_bytes(kv_cache_memory_gib: float | None, device: torch.device) -> float:
    """The memory for KV pages and step-lived caches together."""
    if kv_cache_memory_gib is not None:
        return kv_cache_memory_gib * GIB
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return CUDA_FREE_FRACTION * free
    return cpu_cache_default_bytes()


def cpu_cache_default_bytes() -> float:
    """The CPU's cache memory when an engine sets none: $DEPTHSERVE_CPU_KVCACHE_SPACE GiB, else 1 GiB
    (every page is committed at start-up: layers/huge_pages.py)."""
    named = os.environ.get(CPU_CACHE_ENV, "").strip()
    if not named:
        return CPU_CACHE_BYTES
    try:
        gib = float(named)
    except ValueError:
        gib = -1.0
    if not 0 < gib < float("inf"):
        raise ConfigurationError(f"{CPU_CACHE_ENV}={named!r}: the CPU's default KV cache memory must be a "
                                 "positive number of GiB")
    return gib * GIB


def size_kv_cache(model: DepthModel, args: EngineArgs, device: torch.device, dtype: torch.dtype) -> KVCapacity:
    """Pages of `args.block_size` tokens that fit the cache memory; CacheCapacityError if none do."""
    page_bytes = ModelRunner.page_bytes(args.block_size, model.head_dim, dtype)
    reserved = model.step_cache_bytes_bound(args.max_num_batched_tokens)
    memory = cache_memory_bytes(args.kv_cache_memory_gib, device)
    num_pages = int(max(memory - reserved, 0) // page_bytes)
    if num_pages < 1:
        raise CacheCapacityError(
            f"the cache memory ({memory / GIB:.3f} GiB) leaves no KV pages after the {reserved / GIB:.3f} GiB "
            "a step's depth cache may need; raise kv_cache_memory_gib or lower max_num_batched_tokens")
    return KVCapacity(num_pages, page_bytes, reserved)


def new_block_manager(capacity: KVCapacity, args: EngineArgs, model: DepthModel, max_model_len: int) -> BlockManager:
    """The page pool's bookkeeping. CacheCapacityError if it cannot hold one sequence of
    `max_model_len` tokens at the model's default depth."""
    manager = BlockManager(capacity.num_pages, args.block_size, args.enable_prefix_caching, capacity.page_bytes)
    default_layout = model.plan(DepthParams().normalized(model.depth_knobs())).layout
    if not manager.fits_ever(default_layout, max_model_len):
        raise CacheCapacityError(
            f"the KV cache ({capacity.num_pages} pages) cannot hold one sequence of max_model_len="
            f"{max_model_len}; raise kv_cache_memory_gib or lower max_model_len")
    return manager


def kv_usage(block_manager: BlockManager, page_bytes: int) -> dict:
    """The page pool's use now, and the prefix cache's queries and hits since start."""
    return {
        "kv_pages_total": block_manager.num_pages,
        "kv_pages_used": block_manager.num_used_pages,
        "kv_bytes_used_by_kind": {kind.value: n * page_bytes for kind, n in block_manager.used_pages_by_kind().items()},
        "prefix_cache_queries": block_manager.prefix_queries,
        "prefix_cache_hits": block_manager.prefix_hits,
    }
