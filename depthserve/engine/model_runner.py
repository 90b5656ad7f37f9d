"""Turns a scheduled batch into tensors and metadata, runs the model, samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from depthserve.archs.base import DepthModel, RequestState, StaticDecodeSpec
from depthserve.cache import CacheLayout
from depthserve.engine.block_manager import BlockManager
from depthserve.engine.page_tables import RowTable
from depthserve.engine.scheduler import ScheduledSeq
from depthserve.engine.sequence import Sequence
from depthserve.engine.structured_output import StepMasks, StructuredOutputs
from depthserve.engine.static_decode import DecodeRow, StaticDecode, spec_columns
from depthserve.kernels.dispatch import Kernels
from depthserve.layers import huge_pages
from depthserve.layers.attention import AttentionMetadata, KVPool, PrefillSeqMeta
from depthserve.layers.batch import BatchItem, StepBatch, decode_tables_tensors, page_table_tensor
from depthserve.sampler import (NO_FINITE_SCORE, Sampler, SampledToken, SamplingFault, SamplingRow, greedy_tokens,
                                prompt_logprobs)


_NO_ALLOWED_TOKEN = ("no token can be sampled: the structured-output constraint allows none of the tokens the "
                     "model scored (can this model's vocabulary write what the constraint asks for?)")


def prompt_next_tokens(item: ScheduledSeq) -> np.ndarray:
    """Per token of the step, the prompt's next token where it is in the prompt, else -1 (prompt
    tokens by need: the token its readout is checked against)."""
    known = item.seq.prompt_token_ids[item.start + 1 : item.end + 1]
    out = np.full(item.num_tokens, -1, np.int64)
    out[: len(known)] = known
    return out


def _samples(item: ScheduledSeq) -> bool:
    """The sequence samples a token after this step (its logits row is read out)."""
    return item.samples and len(item.seq.output_token_ids) < item.seq.max_tokens


@dataclass
class PromptLogprob:
    position: int  # index of the prompt token this scores (>= 1)
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SeqStepOutput:
    scheduled: ScheduledSeq
    sampled: SampledToken | None
    prompt_logprobs: list[PromptLogprob]
    fault: str | None = None  # no token could be sampled for this sequence (SamplingFault.reason)


def _page_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The zeroed K or V pages; on the CPU on huge pages, where a decode step's reads of pages
    scattered over the pool take less time (layers/huge_pages.py)."""
    if device.type == "cpu":
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def request_state(seq: Sequence) -> RequestState:
    """What the model sees of a sequence (DepthModel.report): its plan, record and token counts."""
    return RequestState(seq.plan, seq.depth_record, seq.num_computed_tokens, seq.num_prompt_tokens,
                        len(seq.output_token_ids), tuple(seq.levels))


class ModelRunner:
    def __init__(self, model: DepthModel, block_manager: BlockManager, sampler: Sampler,
                 dtype: torch.dtype, device: torch.device, kernels: Kernels,
                 structured: StructuredOutputs | None = None):
        self.model = model
        self.structured = structured
        self.kernels = kernels
        self.static: StaticDecode | None = None  # set by enable_static_decode
        self._columns: dict[CacheLayout, np.ndarray] = {}  # request layout -> static spec columns
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.sampler = sampler
        self.device = device
        # One page past the block manager's: the scratch page, never given to a sequence, that a static
        # decode step's padding rows and missing slots point at (whatever they write lands there).
        self.scratch_page = block_manager.num_pages
        shape = (block_manager.num_pages + 1, self.block_size, model.head_dim)
        self.pool = KVPool(k_pages=_page_pool(shape, dtype, device), v_pages=_page_pool(shape, dtype, device))

    def enable_static_decode(self, spec: StaticDecodeSpec, max_blocks: int, max_num_seqs: int,
                             cuda_graphs: bool = True, steps_ahead: int = 1) -> None:
        """Run decode-only steps padded to batch buckets through the compiled forward, compiling it
        now (and on CUDA capturing every bucket's graph); with steps_ahead > 1, greedy batches may
        run that many steps in one go (`execute_ahead`)."""
        kernels = Kernels(self.kernels.backend, traceable=True, native_cpu=self.kernels.native_cpu)
        self.static = StaticDecode(
            self.model.forward, self.pool, kernels, spec, block_size=self.block_size, max_blocks=max_blocks,
            max_num_seqs=max_num_seqs, device=self.device, scratch_page=self.scratch_page, cuda_graphs=cuda_graphs,
            pick=self._pick_greedy, steps_ahead=steps_ahead)
        self.static.warm_up()

    def _pick_greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return greedy_tokens(self.model.compute_logits(hidden), self.sampler.vocab_size)

    @staticmethod
    def page_bytes(block_size: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * block_size * head_dim * torch.empty((), dtype=dtype).element_size()

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> list[SeqStepOutput]:
        # Multi-token chunks first, then single-token (decode-shaped) rows batched together.
        batch = sorted(scheduled, key=lambda s: s.num_tokens == 1)
        # Constrained rows' masks: filled beside the forward pass where a core is free (structured_output.py).
        masks = None if self.structured is None else self.structured.start_step(
            [item.seq for item in batch if _samples(item)])
        try:
            return self._execute(batch, masks)
        finally:
            if masks is not None:
                masks.settle()  # a failed step must not leave the worker on the matchers

    def _execute(self, batch: list[ScheduledSeq], masks: StepMasks | None) -> list[SeqStepOutput]:
        if self._is_static_decode(batch):
            hidden = self.static.run([self._decode_row(item) for item in batch])
            if self.static.spec.decisions:
                for item, decisions in zip(batch, self.static.decisions[: len(batch)].cpu().numpy()):
                    stored = self.model.record_decisions(item.seq.depth_record, item.start, decisions[None])
                    self._commit_routed_slots(item.seq, lambda name: stored.get(name, 0))
            return self._postprocess_logits(batch, hidden, masks)
        input_ids, positions, meta = self._prepare(batch, masks)
        hidden = self.model(input_ids, positions, self.pool, meta)
        if meta.batch is not None:
            step = meta.batch
            self._commit_routed(batch, step)
            if step.decisions is not None:
                decisions = step.decisions.cpu().numpy()
                for item, ran in zip(batch, step.items):
                    rows = decisions[ran.row: ran.row + ran.num_tokens]
                    self.model.record_decisions(item.seq.depth_record, item.start, rows)
            # Tokens that stopped early (the confidence exit) report the level they ran.
            batch = [replace(item, ran_levels=tuple(step.ran_levels[i])) if i in step.ran_levels else item
                     for i, item in enumerate(batch)]
        return self._postprocess_logits(batch, hidden, masks)

    # ---- steps ahead (engine/static_decode.py) ---------------------------------------------------
    def can_run_ahead(self, batch: list[ScheduledSeq]) -> bool:
        """Whether the batch may run several decode steps in one go: a static decode step whose rows
        all sample a greedy token with nothing to apply and no constraint (`Sampler.picks_plainly`)."""
        return (self.static is not None and self.static.steps_ahead > 1 and self._is_static_decode(batch)
                and all(_samples(item) and item.exit_threshold is None and item.seq.matcher is None
                        and self.sampler.picks_plainly(self._sampling_row(item)) for item in batch))

    def max_steps_ahead(self, batch: list[ScheduledSeq]) -> int:
        """The most decode steps the batch may run in one go: the static step's, where it may (else 1)."""
        return self.static.steps_ahead if self.can_run_ahead(batch) else 1

    @torch.inference_mode()
    def execute_ahead(self, batch: list[ScheduledSeq], steps: int) -> list[list[SeqStepOutput]]:
        """`steps` decode steps of the batch (each sequence's pages grown for them), one list of
        outputs per step: step k's item of a sequence starts k positions after its scheduled one."""
        rows = [self._decode_row(item, steps) for item in batch]
        picked = self.static.run_ahead(rows, steps)
        return [[self._picked_output(replace(item, start=item.start + k), picked.token_ids[k, i],
                                     picked.logprobs[k, i], picked.finite[k, i]) for i, item in enumerate(batch)]
                for k in range(steps)]

    @staticmethod
    def _picked_output(item: ScheduledSeq, token: int, logprob: float, finite: bool) -> SeqStepOutput:
        if not finite:
            return SeqStepOutput(item, None, [], fault=NO_FINITE_SCORE)
        return SeqStepOutput(item, SampledToken(int(token), float(logprob), 0, []), [])

    def _is_static_decode(self, batch: list[ScheduledSeq]) -> bool:
        # A range knob's deeper slots grow with the tokens that ran them: such steps run eagerly.
        return (self.static is not None and len(batch) <= self.static.buckets[-1]
                and all(item.num_tokens == 1 and item.level is None for item in batch))

    def _decode_row(self, item: ScheduledSeq, steps: int = 1) -> DecodeRow:
        """The sequence's decode step with its page-table columns moved to the static spec's, its
        table covering the positions of `steps` steps."""
        seq, bs = item.seq, self.block_size
        table = self._row_table(seq, -(-(item.end + steps - 1) // bs))
        columns = self._spec_columns(seq.layout)
        write = np.where(columns >= 0, table.blocks(item.start // bs, item.start // bs + 1)[0] * bs + item.start % bs,
                         -1)
        routed_lens = np.zeros(self.static.num_routed, np.int64)
        for slot in seq.layout.routed_slots:
            # Where the slot's next token would go (the model stores it only if the token is selected).
            pages, length = self.block_manager.routed_table(seq, slot.name)
            write[self.static.columns[slot.name]] = pages[length // bs] * bs + length % bs
            routed_lens[self.static.routed_index[slot.name]] = length
        state = self.block_manager.state_table(seq)
        return DecodeRow(seq.token_ids(item.start, item.end)[0], item.start, table, write,
                         self.model.row_settings(seq.plan, None), np.zeros(0, np.int64) if state is None else state,
                         routed_lens, self.model.static_level(seq.plan))

    def _row_table(self, seq, num_blocks: int) -> RowTable:
        """The sequence's page table in the static spec's columns, block by block (the static decode
        asks only for the blocks its device table lacks). Keyed by the sequence's allocation: its
        table only grows until its pages are freed (finish, or preemption, which counts in
        num_preemptions). A routed slot's rows past its committed tokens are a reservation whose
        pages may change from step to step, so the blocks from there on are not stable."""
        bs, scratch = self.block_size, self.scratch_page
        columns = self._spec_columns(seq.layout)
        own = self.block_manager.page_table(seq)
        routed = [(self.static.columns[slot.name], *self.block_manager.routed_table(seq, slot.name))
                  for slot in seq.layout.routed_slots]

        def blocks(start: int, stop: int) -> np.ndarray:
            rows = np.where(columns >= 0, own[start:stop][:, columns], scratch)
            for slot_columns, pages, _ in routed:  # routed row i: the slot's selected tokens i*bs..
                if start < min(len(pages), stop):
                    rows[: min(len(pages), stop) - start, slot_columns] = pages[start:stop]
            return rows

        stable = min([num_blocks] + [-(-length // bs) for _, _, length in routed])
        return RowTable((seq.seq_id, seq.num_preemptions), num_blocks, stable, blocks)

    def _spec_columns(self, layout: CacheLayout) -> np.ndarray:
        if layout not in self._columns:
            self._columns[layout] = spec_columns(self.static.spec, layout)
        return self._columns[layout]

    def _commit_routed(self, batch: list[ScheduledSeq], step: StepBatch) -> None:
        for item in batch:
            seq_id = item.seq.seq_id
            self._commit_routed_slots(item.seq, lambda name: step.routed_counts.get((seq_id, name), 0))

    def _commit_routed_slots(self, seq, stored: Callable[[str], int]) -> None:
        """Routed slots: keep the tokens the step stored in each (by slot name), return the rest of
        the worst-case reservation."""
        for slot in seq.layout.routed_slots:
            self.block_manager.commit_routed(seq, slot.name, stored(slot.name))

    def _prepare(self, batch: list[ScheduledSeq], masks: StepMasks | None):
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        prefills: list[PrefillSeqMeta] = []
        decode_tables: list[np.ndarray] = []
        decode_lens: list[int] = []
        row = 0
        num_prefill_tokens = 0
        depth_model = self.model.uses_step_batch
        items: list[BatchItem] = []
        for item in batch:
            full_table = self.block_manager.page_table(item.seq)
            # The base (dense) slots sit at the same leading columns for every request of a model.
            table = full_table[:, : item.seq.layout.base_width]
            if depth_model:
                seq = item.seq
                routed = {slot.name: self.block_manager.routed_table(seq, slot.name)
                          for slot in seq.layout.routed_slots}
                allowed = (masks.for_sequence(seq.seq_id)
                           if masks is not None and item.exit_threshold is not None and _samples(item) else None)
                items.append(BatchItem(seq.seq_id, seq.plan, item.start, item.num_tokens, row, full_table, routed,
                                       self.block_manager.state_table(seq), item.level, item.exit_threshold,
                                       item.samples, self.model.row_settings(seq.plan, item.level), allowed,
                                       prompt_next_tokens(item) if item.exit_prompt else None,
                                       seq.levels if seq.plan.elastic is not None else (),
                                       num_prompt_tokens=seq.num_prompt_tokens))
            positions = np.arange(item.start, item.end)
            ids.extend(item.seq.token_ids(item.start, item.end))
            pos_chunks.append(positions)
            slot_chunks.append(table[positions // bs] * bs + (positions % bs)[:, None])
            if item.num_tokens > 1:
                prefills.append(PrefillSeqMeta(row, item.num_tokens, item.end, page_table_tensor(table, self.device)))
                num_prefill_tokens += item.num_tokens
            else:
                decode_tables.append(table[: -(-item.end // bs)])
                decode_lens.append(item.end)
            row += item.num_tokens
        decode_table, decode_len = decode_tables_tensors(decode_tables, decode_lens, self.device)
        meta = AttentionMetadata(
            num_tokens=row,
            block_size=bs,
            slot_index=self._tensor(np.concatenate(slot_chunks)),
            prefills=prefills,
            num_prefill_tokens=num_prefill_tokens,
            decode_page_table=decode_table,
            decode_context_lens=decode_len,
            kernels=self.kernels,
            batch=StepBatch(items, bs, self.device, self.kernels) if depth_model else None,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = self._tensor(np.concatenate(pos_chunks))
        return input_ids, positions, meta

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

    def _postprocess_logits(self, batch: list[ScheduledSeq], hidden: torch.Tensor,
                            masks: StepMasks | None) -> list[SeqStepOutput]:
        sample_rows: list[int] = []
        sample_items: list[ScheduledSeq] = []
        outputs: dict[int, SeqStepOutput] = {}
        row = 0
        prompt_jobs: list[tuple[ScheduledSeq, int, np.ndarray]] = []
        for item in batch:
            seq = item.seq
            outputs[seq.seq_id] = SeqStepOutput(item, None, [])
            if _samples(item):
                sample_rows.append(row + item.num_tokens - 1)
                sample_items.append(item)
            if seq.prompt_logprobs is not None:
                done = len(seq.prompt_logprobs)
                # Position p predicts prompt token p + 1; score each prompt token once.
                wanted = np.arange(max(item.start, done - 1), min(item.end, seq.num_prompt_tokens - 1))
                if len(wanted):
                    prompt_jobs.append((item, row, wanted))
            row += item.num_tokens
        if sample_rows:
            logits = self.model.compute_logits(hidden[sample_rows])
            if masks is not None:
                masks.apply(logits)  # before penalties, temperature and the sampler
            rows = [self._sampling_row(item) for item in sample_items]
            for item, token in zip(sample_items, self.sampler(logits, rows)):
                if isinstance(token, SamplingFault):
                    outputs[item.seq.seq_id].fault = token.reason if item.seq.matcher is None else _NO_ALLOWED_TOKEN
                else:
                    outputs[item.seq.seq_id].sampled = token
        for item, row_start, wanted in prompt_jobs:
            seq = item.seq
            rows = row_start + (wanted - item.start)
            logits = self.model.compute_logits(hidden[torch.from_numpy(rows)])
            targets = torch.tensor([seq.prompt_token_ids[p + 1] for p in wanted], device=logits.device)
            for p, (lp, rank, top) in zip(wanted, prompt_logprobs(logits, targets, seq.sampling.prompt_logprobs)):
                outputs[seq.seq_id].prompt_logprobs.append(PromptLogprob(int(p) + 1, lp, rank, top))
        return [outputs[item.seq.seq_id] for item in batch]

    @staticmethod
    def _sampling_row(item: ScheduledSeq) -> SamplingRow:
        seq = item.seq
        return SamplingRow(
            params=seq.sampling,
            generator=seq.generator,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
        )
