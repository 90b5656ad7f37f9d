"""Decode steps at static shapes, through the model's compiled forward.

A decode-only step of n sequences runs as a batch of `bucket(n)` rows (the smallest bucket that
holds n): the rows past n are padding. Every per-row input of the forward (token ids, positions,
the cache write index, context lengths, knobs) lives in one persistent device buffer, filled from
one host array by one copy per step, and the forward reads views of it; the page tables live in
one persistent int32 table that a step updates only where it changed (engine/page_tables.py), its
update riding in the same copy. So a bucket's step always sees tensors of the same shapes at the
same addresses (what CUDA-graph capture needs) and the compiled forward takes no host
synchronisation.

Depth models decode at static shapes too (`DepthModel.static_decode_spec`): a row's page table
has the columns of every slot the deepest request can hold (its own slots at their columns, the
rest the scratch page with write index -1), and its knobs arrive as per-row values
(`meta.static.settings`), so a batch whose requests loop or recur differently runs one graph:
every row runs the depth the deepest request can have, and the model keeps the result only where
the row's own knobs say so (depthserve/layers/rows.py, `MaskedRows`: the same forward as an eager
step's, its levels kept with `torch.where`, never a product with a mask, so nothing read from the
scratch page leaks in).

Padding rows write nothing to any sequence's pages: their cache write index is -1 (every store op
skips such rows) and their tables' first block points at the scratch page (one page past the
block manager's, held by no sequence, so what an op that updates the pages it reads, SAOBP's bias
update, writes for them lands there); they attend to one key and their outputs are dropped.
Attention, norms and the MLP work per row, so padding never changes a real row's result.

The forward is compiled (`torch.compile`, fullgraph) with the kernels as torch.library custom ops
(kernels/library.py), once, with the batch left dynamic, so one compiled graph serves every bucket
(a dimension of size 1 would be compiled as a constant, so a lone sequence runs padded to two
rows). On CPU the page-table and page-pool lengths are dynamic too (tables as long as the longest
context). On CUDA page tables are as wide as max_model_len (the Triton kernels read only up to
each row's context, and the decode kernel splits the batch's longest context, not the width), so
a bucket's inputs never change shape or address, and each bucket's step is captured once as a CUDA
graph at start-up (vLLM's design): a step is one host-to-device copy, the table update (at most
two small device ops) and one graph replay, whatever the batch's depth settings, instead of a
launch per kernel.

Regional compilation (`StaticDecodeSpec.compiled_regions`, the recipe PyTorch documents for cold
start): a looped model's step runs its recurrent layers once per pass, so a graph of the whole
forward grows with the loop count and is compiled again at every level cap (the tiny Dory's four caps
unroll 36 layers; the 4B one's eight caps would unroll 848). Such a model names its layer class
instead: each class's forward is compiled once, with every dimension dynamic (so the batch, the
tables and the pool, whatever their size; a layer's own sizes are constants), and serves each of its
instances and every pass, while the glue between layers runs eagerly. On CUDA the captured graph
records the glue's kernels with the regions', so a replay costs the same.

State read from the pool: a model whose rows carry state in the pool's pages (PUT's conv state)
reads those pages as values before its looped layers and uses them after those layers have stored
keys into the same pool. Inductor's locality pass moves a pure op down to its first user, so the
read would land after those stores, and to keep the values it read the stores could no longer run in
place: the compiled step would copy the whole pool twice (a tiny PUT on a 2 GiB pool: 1.9 s a step,
6-11 ms without the copies). Such a model's step is compiled without that pass, so its reads stay
where the forward makes them and every store writes the pool in place
(`tests/test_static_decode.py` checks no store is compiled as a copy).

Steps ahead (vLLM's multi-step scheduling): a step's host work (scheduling, the rows, the copy,
the sampler's launches and its synchronisation, the outputs) keeps the GPU idle for most of a small
batch's decode step. When every row of a decode-only batch is greedy with nothing to apply, the
engine may run up to `num_scheduler_steps` steps in one go (`run_ahead`): each step's graph also
holds the LM head, the greedy pick (`sampler.greedy_tokens`: the sampler's own arithmetic) and the
advance of every real row's inputs on the device (its token becomes the next input, its position and
context length grow by one, its cache write index moves to the next position's page), so the steps
replay back to back with no host work between them, and the host reads all their tokens in one
synchronisation. The scheduler gives each sequence the pages of the steps ahead first
(Scheduler.look_ahead); the engine then takes the tokens in one at a time, so a sequence that stops
within them keeps only the tokens up to its stop, and its pages (holding the keys of tokens past
the stop, never read) are freed as at any finish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from depthserve.archs.base import StaticDecodeSpec
from depthserve.cache import CacheLayout
from depthserve.engine.page_tables import DecodeTables, RowTable
from depthserve.kernels.dispatch import Kernels
from depthserve.layers.attention import AttentionMetadata, KVPool, StaticRows

logger = logging.getLogger("depthserve.engine")


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes a decode step is padded to: 1, 2, 4, 8, then every multiple of 8 up to 64, of 32
    beyond, and max_num_seqs itself."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    size = 8
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 64 else 32
    return tuple(sizes) + (max_num_seqs,)


@dataclass(frozen=True)
class AheadTokens:
    """What `StaticDecode.run_ahead` picked, [steps, rows] each (host arrays)."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    finite: np.ndarray  # the row had a finite score to pick at that step (else the sampler's fault)


# hidden states [rows, hidden] -> (greedy token, its logprob, whether it was finite), each [rows], no host sync
Pick = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DecodeRow:
    """One sequence's decode step, laid out for the model's StaticDecodeSpec."""

    token_id: int
    position: int
    table: RowTable  # [blocks covering the context, width] pages, the spec layout's columns
    write: np.ndarray  # [width] flat cache index of the new token per column; -1: store nothing
    settings: np.ndarray  # [spec.settings] float32 knobs of the request
    state_pages: np.ndarray  # pages of the per-sequence state (spec.state_bytes at most)
    routed_lens: np.ndarray  # [spec routed slots] tokens each routed slot holds (0 where it has none)
    level: int = 0  # the depth level its request's step needs (DepthModel.static_level)


def spec_columns(spec: StaticDecodeSpec, layout: CacheLayout) -> np.ndarray:
    """[spec width] the column of a request's page table (laid out as `layout`) that lands at each
    column of the spec layout, -1 where the request lacks the slot (and at routed slots' columns,
    which the runner fills from the routed tables)."""
    source = np.full(spec.width, -1, dtype=np.int64)
    own = layout.slot_columns()
    for name, target in spec.layout.slot_columns().items():
        if name in own:
            source[target] = np.arange(own[name].start, own[name].stop)
    return source


def _compiled_region(forward: Callable) -> Callable:
    """A region's forward compiled with every dimension dynamic, each its own size: with duck sizing
    (dims of equal size at tracing traced as one) the warm-up's batch of 2 rows and its table of 2
    blocks would be one size, and every later step would compile again."""
    compiled = torch.compile(forward, fullgraph=True, dynamic=True)

    def run(*args):
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled(*args)

    return run


def _inductor_options(spec: StaticDecodeSpec) -> dict[str, bool]:
    """Inductor settings of the compiled step (module docstring, "State read from the pool")."""
    return {"reorder_for_locality": False} if spec.state_bytes else {}


class StaticDecode:
    """The persistent buffers and the compiled forward of decode-only steps (module docstring)."""

    def __init__(self, forward: Callable, pool: KVPool, kernels: Kernels, spec: StaticDecodeSpec, *,
                 block_size: int, max_blocks: int, max_num_seqs: int, device: torch.device, scratch_page: int,
                 cuda_graphs: bool = True, pick: Pick | None = None, steps_ahead: int = 1):
        self.pool, self.kernels, self.device, self.spec = pool, kernels, device, spec
        self.scratch_page = scratch_page  # where padding rows and missing slots point (no sequence holds it)
        self.block_size, self.width, self.max_blocks = block_size, spec.width, max_blocks
        self.dynamic = device.type == "cpu"  # page tables and pool of dynamic length (CUDA: fixed)
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self.buckets = decode_buckets(max_num_seqs)
        if len(self.buckets) > 1:
            # One graph dynamic in the batch serves every size from 2 (a size of 1 would be compiled
            # as a constant, as any dimension of size 1 is): a lone sequence runs padded to 2 rows.
            self.buckets = self.buckets[1:]
        self.steps = 0  # steps run (warm-up included)
        self.level_steps: dict[int | None, int] = {}  # steps served at each level cap (after warm-up)
        rows, width = self.buckets[-1], self.width
        page_bytes = 2 * pool.k_pages[0].numel() * pool.k_pages.element_size()
        self.state_pages = -(-spec.state_bytes // page_bytes)
        # CPU: one block more than a row can use, so the forward's view of a step's first `blocks` is
        # never contiguous: a view that turned contiguous at the full width would fail the compiled
        # graph's stride guard (stride 0 != width * blocks) and compile the step again.
        self.tables = DecodeTables(rows, max_blocks + self.dynamic, width, scratch_page, device)
        # Layout of the one int64 buffer: ids | positions | context lengths | write index | settings
        # (float32 pairs) | state pages | routed lengths | the page tables' update (CUDA; last: a step
        # copies only the part it uses).
        self._settings_words = -(-spec.settings // 2)
        self.num_routed = len(spec.layout.routed_slots)
        self.columns = spec.columns()  # slot name -> columns of a row's page table
        self.routed_index = {slot.name: i for i, slot in enumerate(spec.layout.routed_slots)}
        self._sizes = (rows, rows, rows, rows * width, rows * self._settings_words, rows * self.state_pages,
                       rows * self.num_routed, 0 if device.type == "cpu" else self.tables.staging_words())
        self._host = torch.zeros(sum(self._sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
        self._device = self._host if device.type == "cpu" else torch.zeros_like(self._host, device=device)
        self.decisions = torch.zeros(rows, spec.decisions, dtype=torch.int32, device=device)
        # Steps ahead (module docstring): where the spec keeps no per-step host record (routing decisions,
        # routed slots' lengths), with the pick of each step's tokens.
        self._pick = pick
        self.steps_ahead = steps_ahead if pick is not None and not spec.decisions and not self.num_routed else 1
        self._ahead_out = (torch.zeros(self.steps_ahead, rows, dtype=torch.int64, device=device),
                           torch.zeros(self.steps_ahead, rows, dtype=torch.float32, device=device),
                           torch.zeros(self.steps_ahead, rows, dtype=torch.bool, device=device))
        self.levels: tuple[int | None, ...] = spec.levels or (None,)  # one compiled graph per level cap
        # The batch (and on CPU the table and pool lengths) marked dynamic on every call; the level cap
        # is a constant of each graph. Dynamo keeps a graph per level and per model instance (each
        # engine of a process), past its default limit of 8 per function.
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 16 * len(self.levels))
        if spec.compiled_regions:  # module docstring, "Regional compilation"
            self.regions = {cls: _compiled_region(cls.forward) for cls in spec.compiled_regions}
            self.forward = forward
        else:
            self.regions = {}
            self.forward = torch.compile(forward, fullgraph=True, dynamic=None, options=_inductor_options(spec))
        # CUDA: (bucket size, level cap) -> (captured graph, its output), filled by warm_up; one memory pool.
        self._graphs: dict[tuple[int, int | None], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._ahead_graphs: dict[tuple[int, int | None], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        # Warm-up runs and captures on one side stream (as torch.cuda.graph's documentation does), so the
        # libraries' per-stream workspaces exist before capture.
        self._capture_stream = torch.cuda.Stream(device) if self.cuda_graphs else None

    def bucket(self, num_rows: int) -> int:
        return next(size for size in self.buckets if size >= num_rows)

    def warm_up(self) -> None:
        """Compile the decode step of every level cap now, not on the first requests (a progress
        line), and on CUDA capture every bucket's graph at every cap, the largest first (a line)."""
        idle = [DecodeRow(0, 0, RowTable.of_array(np.full((1, self.width), self.scratch_page, np.int64)),
                          np.full(self.width, -1, np.int64),
                          np.zeros(self.spec.settings, np.float32), np.zeros(0, np.int64),
                          np.zeros(self.num_routed, np.int64), level or 0) for level in self.levels]
        start = time.perf_counter()
        for row in idle:
            self.run([row] * self.buckets[0])
        levels = f", depth levels {self.levels[0]}..{self.levels[-1]}" if self.spec.levels else ""
        logger.info("compiled the decode step (batch %d..%d%s) in %.1f s", self.buckets[0], self.buckets[-1], levels,
                    time.perf_counter() - start)
        if self.cuda_graphs:
            start = time.perf_counter()
            self._capture_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._capture_stream):
                for size in reversed(self.buckets):
                    for row in idle:
                        self.run([row] * size)  # the eager run first: Triton's kernels compile outside capture
                        self._capture(self._graphs, self._step, size, self._cap([row]))
                        if self.steps_ahead > 1:
                            self.run_ahead([row] * size, 1)
                            self._capture(self._ahead_graphs, self._step_ahead, size, self._cap([row]))
            torch.cuda.current_stream(self.device).wait_stream(self._capture_stream)
            logger.info("captured %d CUDA graphs of the decode step in %.1f s", len(self._graphs) + len(self._ahead_graphs),
                        time.perf_counter() - start)
        self.level_steps.clear()

    def _cap(self, rows: list[DecodeRow]) -> int | None:
        """The step's level cap: the smallest level that covers every row's."""
        if not self.spec.levels:
            return None
        deepest = max(row.level for row in rows)
        return next(level for level in self.spec.levels if level >= deepest)

    @torch.inference_mode()
    def _capture(self, graphs: dict, step: Callable, size: int, cap: int | None) -> None:
        """Record the bucket's step (`_step` or `_step_ahead`) on its buffers' current contents: a
        replay reruns it on whatever the buffers then hold."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool, stream=self._capture_stream):
            out = step(size, self.max_blocks, cap)
        graphs[size, cap] = (graph, out)

    @torch.inference_mode()
    def run(self, rows: list[DecodeRow]) -> torch.Tensor:
        """Hidden states [len(rows), hidden] of one decode step."""
        size, blocks, cap = self._load(rows, 1)
        if (size, cap) in self._graphs:
            graph, out = self._graphs[size, cap]
            graph.replay()
            return out[: len(rows)]
        return self._step(size, blocks, cap)[: len(rows)]

    @torch.inference_mode()
    def run_ahead(self, rows: list[DecodeRow], steps: int) -> AheadTokens:
        """`steps` decode steps back to back, each row's greedy token the input of its next step
        (module docstring, "Steps ahead"); the rows' tables cover every step's position."""
        if not 1 <= steps <= self.steps_ahead:
            raise ValueError(f"steps ahead must lie in 1..{self.steps_ahead}, got {steps}")
        size, blocks, cap = self._load(rows, steps)
        for k in range(steps):
            if (size, cap) in self._ahead_graphs:
                graph, picked = self._ahead_graphs[size, cap]
                graph.replay()
            else:
                picked = self._step_ahead(size, blocks, cap)
            for buffer, value in zip(self._ahead_out, picked):
                buffer[k, :size].copy_(value)
        return AheadTokens(*(buffer[:steps, : len(rows)].cpu().numpy() for buffer in self._ahead_out))

    def _load(self, rows: list[DecodeRow], steps: int) -> tuple[int, int, int | None]:
        """Fill the step's buffers with the rows (one host-to-device copy on CUDA) and count the
        steps; returns (bucket size, table blocks the step reads, level cap)."""
        size = self.bucket(len(rows))
        blocks = self.max_blocks
        if self.dynamic:  # CPU: tables as long as the longest context, in powers of two from 2 blocks
            # (a length of 1 would be compiled as a constant, as any dimension of size 1 is)
            longest = max(r.table.num_blocks for r in rows)
            blocks = min(self.max_blocks, max(2, 1 << (longest - 1).bit_length()))
        ids, positions, lens, index, settings, states, routed, staging = self._views(self._host.numpy(), size)
        ids[:], positions[:], lens[:], index[:], settings[:], states[:], routed[:] = 0, 0, 1, -1, 0, -1, 0
        for i, row in enumerate(rows):
            ids[i], positions[i], lens[i] = row.token_id, row.position, row.position + 1
            index[i] = row.write
            settings[i] = row.settings
            states[i, : len(row.state_pages)] = row.state_pages
            routed[i] = row.routed_lens
        update = self.tables.update([row.table for row in rows], size)
        if self._device is self._host:
            self.tables.apply_on_host(update)
        else:
            # One copy: every region up to the end of the staged table update. The host buffer is
            # rewritten only at the next step, after the sampler has read this step's logits (a
            # synchronisation).
            staged = self.tables.stage(update, staging)
            used = sum(self._sizes[:-1]) + staged
            self._device[:used].copy_(self._host[:used], non_blocking=True)
            self.tables.apply_on_device(update, self._views(self._device, size)[-1][:staged])
        self.steps += steps
        cap = self._cap(rows)
        self.level_steps[cap] = self.level_steps.get(cap, 0) + steps
        return size, blocks, cap

    def _step(self, size: int, blocks: int, cap: int | None) -> torch.Tensor:
        return self.forward(*self._arguments(size, blocks, cap))

    def _step_ahead(self, size: int, blocks: int, cap: int | None) -> tuple[torch.Tensor, ...]:
        """A decode step whose picked tokens become the next step's inputs (module docstring)."""
        token, logprob, finite = self._pick(self._step(size, blocks, cap))
        ids, positions, lens, index = self._views(self._device, size)[:4]
        live = (index >= 0).any(dim=1)  # padding rows write nothing and stay where they are
        ids.copy_(torch.where(live, token, ids))
        advance = live.to(positions.dtype)
        positions.add_(advance)
        lens.add_(advance)
        table = self.tables.table[:size]
        block = (positions // self.block_size).clamp_(max=table.shape[1] - 1)
        pages = table.gather(1, block.view(size, 1, 1).expand(size, 1, table.shape[2])).squeeze(1).to(index.dtype)
        index.copy_(torch.where(index >= 0, pages * self.block_size + (positions % self.block_size).unsqueeze(1), index))
        return token, logprob, finite

    def _arguments(self, size: int, blocks: int, cap: int | None) -> tuple:
        """The forward's arguments for a step of `size` rows: views of the device buffer."""
        ids, positions, lens, index, settings, states, routed, _ = self._views(self._device, size)
        tables = self.tables.table[:size, :blocks]
        decisions = self.decisions[:size]
        for tensor in (ids, positions, lens, index, settings, states, routed, tables, decisions):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        if self.dynamic:
            for tensor in (self.pool.k_pages, self.pool.v_pages):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.maybe_mark_dynamic(tables, 1)
        meta = AttentionMetadata(num_tokens=size, block_size=self.block_size, slot_index=index, prefills=[],
                                 num_prefill_tokens=0, decode_page_table=tables, decode_context_lens=lens,
                                 kernels=self.kernels,
                                 static=StaticRows(settings, states, positions, decisions, routed, self.columns,
                                                   self.routed_index, cap, self.regions))
        return ids, positions, self.pool, meta

    def _views(self, flat, size: int) -> tuple:
        """The step's arrays (numpy, host) or tensors (device), each contiguous at the start of its
        region of the buffer (laid out for the largest bucket), and the table update's region."""
        bounds = np.cumsum((0,) + self._sizes)
        ids, positions, lens, index, settings, states, routed, staging = (flat[bounds[i]:bounds[i + 1]]
                                                                          for i in range(8))
        words = self._settings_words
        settings = settings[: size * words]
        settings = (settings.view(np.float32) if isinstance(settings, np.ndarray) else settings.view(torch.float32))
        return (ids[:size], positions[:size], lens[:size], index[: size * self.width].reshape(size, self.width),
                settings.reshape(size, 2 * words)[:, : self.spec.settings],
                states[: size * self.state_pages].reshape(size, self.state_pages),
                routed[: size * self.num_routed].reshape(size, self.num_routed), staging)
