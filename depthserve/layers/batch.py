"""One step's batch, as the depth models see it: per-request rows, page tables, plans and settings.

The base (dense) slots are described once by the step's `AttentionMetadata`. A depth level that
runs only for some rows (an SGT loop iteration for the requests that asked for it, an ITT step for
the tokens its router selected) attends through a compact `AttentionMetadata` for just those rows
and just that slot's pages (`StepBatch.level_meta` / `routed_meta`), built for the gathered rows of
layers/rows.py, so no row pays for depth it did not ask for. An item carries no engine state: the
runner makes it from the scheduled sequence and reads what the forward left in the StepBatch
(routed counts, decisions, the levels tokens ran) after the step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from depthserve.kernels.dispatch import Kernels
from depthserve.layers.attention import AttentionMetadata, PrefillSeqMeta


@dataclass(frozen=True, eq=False)
class BatchItem:
    """One request's part of a step, as the runner saw it: its rows, page tables and depth settings."""

    seq_id: int
    plan: Any  # the request's DepthPlan (the architecture's subclass)
    start: int  # first position computed this step
    num_tokens: int
    row: int  # its first row in the packed batch
    table: np.ndarray  # [blocks, row_width] token-covering page table
    routed: dict[str, tuple[np.ndarray, int]] = field(default_factory=dict)  # name -> (pages, committed length)
    state: np.ndarray | None = None  # pages holding the sequence's per-sequence state (SEQ_STATE), if any
    level: int | None = None  # the depth policy's level for these tokens (a range knob), else None
    exit_threshold: float | None = None  # the confidence exit's top-1 probability (ScheduledSeq)
    samples: bool = False  # the sequence samples after this step: its last token is read out
    settings: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # DepthModel.row_settings
    # A constrained request's allowed next tokens (int32 bitmask row, structured outputs): the
    # confidence exit reads the masked distribution, as the sampler will.
    allowed_tokens: torch.Tensor | None = None
    # Prompt tokens by need (ScheduledSeq.exit_prompt): per row, the prompt's next token that the
    # row's readout is checked against (-1: none; the sampled row keeps the top-1 rule).
    prompt_next_tokens: np.ndarray | None = None
    # A range knob: the level each position before `start` ran at (Sequence.levels), for a model
    # whose routed slots need their keys' positions (Dory's sliding-window passes); () otherwise.
    levels: Sequence[int] = ()
    num_prompt_tokens: int = 0  # the sequence's prompt (a bidirectional prompt's forward ends there)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def decode(self) -> bool:
        return self.num_tokens == 1

    @property
    def slot_columns(self) -> Mapping[str, slice]:
        """Name -> columns of the request's token-covering slots."""
        return self.plan.layout.slot_columns()


@dataclass
class MetaEntry:
    """One sequence's part of a compact attention batch over one slot."""

    num_queries: int
    context_len: int  # keys visible to its last query (its own included)
    read_table: np.ndarray  # [blocks, read_heads] pages to attend over (a KV head may repeat)
    write_index: np.ndarray  # [num_queries, stored_heads] flat cache index of the new keys/values
    decode: bool


def build_metadata(entries: list[MetaEntry], block_size: int, device: torch.device,
                   kernels: Kernels) -> AttentionMetadata:
    """AttentionMetadata for entries whose query rows are packed in order (multi-token entries first)."""
    prefills: list[PrefillSeqMeta] = []
    decode_tables: list[np.ndarray] = []
    decode_lens: list[int] = []
    row = 0
    num_prefill_tokens = 0
    seen_decode = False
    for e in entries:
        if e.decode:
            seen_decode = True
            decode_tables.append(e.read_table)
            decode_lens.append(e.context_len)
        else:
            if seen_decode:
                raise ValueError("prefill entries must come before decode entries")
            prefills.append(PrefillSeqMeta(row, e.num_queries, e.context_len, page_table_tensor(e.read_table, device)))
            num_prefill_tokens += e.num_queries
        row += e.num_queries
    decode_table, decode_len = decode_tables_tensors(decode_tables, decode_lens, device)
    width = entries[0].write_index.shape[1] if entries else 1
    index = np.concatenate([e.write_index for e in entries]) if entries else np.zeros((0, width), np.int64)
    return AttentionMetadata(
        num_tokens=row,
        block_size=block_size,
        slot_index=_tensor(index, device),
        prefills=prefills,
        num_prefill_tokens=num_prefill_tokens,
        decode_page_table=decode_table,
        decode_context_lens=decode_len,
        kernels=kernels,
    )


def decode_tables_tensors(tables: list[np.ndarray], context_lens: list[int],
                          device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The decode rows' page tables padded to the longest ([rows, blocks, width] int32) and their
    context lengths; (None, None) without decode rows."""
    if not tables:
        return None, None
    return page_table_tensor(stack_padded(tables, np.int32), device), _tensor(np.asarray(context_lens), device)


def stack_padded(arrays: list[np.ndarray], dtype: type, fill: int = 0) -> np.ndarray:
    """Arrays of different lengths (the same trailing shape) stacked, each padded to the longest with `fill`."""
    padded = np.full((len(arrays), max(len(a) for a in arrays), *arrays[0].shape[1:]), fill, dtype=dtype)
    for i, array in enumerate(arrays):
        padded[i, : len(array)] = array
    return padded


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)


def page_table_tensor(table: np.ndarray, device: torch.device) -> torch.Tensor:
    """Page ids as int32 (the block manager's type: half the bytes of int64 to fill and copy)."""
    return torch.from_numpy(np.ascontiguousarray(table, dtype=np.int32)).to(device)


class StepBatch:
    """The items of one step (multi-token chunks first, then decodes), in packed-row order."""

    def __init__(self, items: list[BatchItem], block_size: int, device: torch.device, kernels: Kernels):
        self.items = items
        self.block_size = block_size
        self.device = device
        self.kernels = kernels  # the step's ops, carried into every sub-step's metadata
        self.num_rows = sum(item.num_tokens for item in items)
        # Filled by the model during the forward: tokens selected per (sequence, routed slot),
        # committed to the block manager by the runner after the step.
        self.routed_counts: dict[tuple[int, str], int] = {}
        # Filled by the model during the forward (layers/rows.py): the routing decisions of every
        # row (StaticDecodeSpec.decisions columns), and per item index the level each of its tokens
        # ran at where some stopped below the item's level (the confidence exit).
        self.decisions: torch.Tensor | None = None
        self.ran_levels: dict[int, list[int]] = {}
        self.base_width = items[0].plan.layout.base_width if items else 0  # the step metadata's columns
        self._rows: dict[Any, torch.Tensor] = {}
        self._item_of_row: np.ndarray | None = None
        self._settings: np.ndarray | None = None
        self._settings_tensor: torch.Tensor | None = None

    # ---- rows ------------------------------------------------------------------------------------
    def rows(self, items: list[BatchItem]) -> torch.Tensor | None:
        """Packed-row indices of these items (None when they are the whole batch)."""
        if len(items) == len(self.items):
            return None
        key = tuple(id(i) for i in items)
        if key not in self._rows:
            index = np.concatenate([np.arange(i.row, i.row + i.num_tokens) for i in items]) if items else \
                np.zeros(0, np.int64)
            self._rows[key] = _tensor(index, self.device)
        return self._rows[key]

    def index_tensor(self, index: np.ndarray) -> torch.Tensor:
        """`index` (int64 row positions) on the device, made once per step for equal indices."""
        key = ("index", index.tobytes())
        if key not in self._rows:
            self._rows[key] = _tensor(index, self.device)
        return self._rows[key]

    def settings(self) -> np.ndarray:
        """[num_rows, settings] each row's request settings (BatchItem.settings), float32."""
        if self._settings is None:
            width = max((len(item.settings) for item in self.items), default=0)
            rows = np.zeros((self.num_rows, width), np.float32)
            for item in self.items:
                rows[item.row: item.row + item.num_tokens] = item.settings
            self._settings = rows
        return self._settings

    def settings_tensor(self) -> torch.Tensor:
        if self._settings_tensor is None:
            self._settings_tensor = torch.from_numpy(self.settings()).to(self.device)
        return self._settings_tensor

    def item_of_row(self) -> np.ndarray:
        """[num_rows] index of the item each packed row belongs to."""
        if self._item_of_row is None:
            self._item_of_row = np.repeat(np.arange(len(self.items)), [i.num_tokens for i in self.items])
        return self._item_of_row

    def sequence_tables(self, columns: slice) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """AttentionMetadata.sequence_tables from the items' full page tables: each part's blocks up to
        its longest sequence's end, padded with page 0."""
        num_prefills = sum(1 for item in self.items if not item.decode)

        def stack(part: list[BatchItem]) -> torch.Tensor | None:
            if not part:
                return None
            tables = [item.table[: -(-item.end // self.block_size), columns] for item in part]
            return torch.from_numpy(stack_padded(tables, np.int64)).to(self.device)

        return stack(self.items[:num_prefills]), stack(self.items[num_prefills:])

    # ---- metadata for a token-covering slot used by some items --------------------------------------
    def slot_meta(self, items: list[BatchItem], columns: list[slice],
                  read_heads: np.ndarray | None = None) -> AttentionMetadata:
        """Attention metadata over one token-covering slot (e.g. an SGT loop slot) for `items`.

        `columns[i]` is that slot's columns in item i's page table; `read_heads` maps each
        attended head to a stored KV head (GQA subsets whose query heads do not split evenly
        over their KV groups attend through one table row per query head).
        """
        entries = [self._slot_entry(item, cols, read_heads) for item, cols in zip(items, columns)]
        return build_metadata(entries, self.block_size, self.device, self.kernels)

    def level_meta(self, items: list[BatchItem], slots: list[slice | str],
                   read_heads: np.ndarray | None = None, counts: list[int] | None = None) -> AttentionMetadata:
        """Attention metadata over one depth level for `items`, every row of each running it: per
        item, its slot of that level is token-covering (`slots[i]` its columns) or, past the
        minimum of a range knob, routed (`slots[i]` its name: it holds only the tokens that ran
        the level, docs/depth-semantics.md section 6). `read_heads` as for `slot_meta` (an SGT head
        subset with uneven KV groups), for either kind of slot. `counts`: how many of each item's
        rows run the level (the first ones of a token-covering slot must be all; a routed slot
        takes any subset, in order: tokens that stopped at a lower level are not in it)."""
        counts = counts or [item.num_tokens for item in items]
        if any(n != item.num_tokens for item, slot, n in zip(items, slots, counts) if not isinstance(slot, str)):
            raise ValueError("every token of an item runs the levels of its token-covering slots")
        entries = [self._routed_entry(item, slot, n, read_heads) if isinstance(slot, str)
                   else self._slot_entry(item, slot, read_heads) for item, slot, n in zip(items, slots, counts)]
        return build_metadata(entries, self.block_size, self.device, self.kernels)

    def _slot_entry(self, item: BatchItem, cols: slice, read_heads: np.ndarray | None = None) -> MetaEntry:
        bs = self.block_size
        table = item.table[: -(-item.end // bs), cols]
        positions = np.arange(item.start, item.end)
        write = table[positions // bs] * bs + (positions % bs)[:, None]
        read = table if read_heads is None else table[:, read_heads]
        return MetaEntry(item.num_tokens, item.end, read, write, item.decode)

    def _routed_entry(self, item: BatchItem, name: str, count: int,
                      read_heads: np.ndarray | None = None) -> MetaEntry:
        """`count` of the item's tokens go to routed slot `name` (the j-th to routed index committed
        + j, attending to 0..committed + j); the count is recorded for the commit after the step."""
        bs = self.block_size
        pages, committed = item.routed[name]
        routed_index = committed + np.arange(count)
        write = pages[routed_index // bs] * bs + (routed_index % bs)[:, None]
        read = pages[: -(-(committed + count) // bs)]
        if read_heads is not None:
            read = read[:, read_heads]
        self._count_routed(item, name, count)
        return MetaEntry(count, committed + count, read, write, item.decode)

    # ---- metadata for a routed slot, given the rows selected this step -----------------------------
    def routed_meta(self, name: str, selected_rows: np.ndarray) -> AttentionMetadata:
        """Attention metadata over routed slot `name` for the selected packed rows (sorted).

        The j-th token a sequence selects in this step goes to routed index committed + j and
        attends to routed indices 0..committed + j. Records the per-sequence counts for the
        commit after the step.
        """
        owners = self.item_of_row()[selected_rows]
        if len(owners) and self.items[owners[0]].decode:  # decode rows come last: one row per sequence
            return self._routed_decode_meta(name, owners)
        entries = []
        if len(selected_rows):
            boundaries = np.flatnonzero(np.diff(owners)) + 1
            for group in np.split(np.arange(len(selected_rows)), boundaries):
                entries.append(self._routed_entry(self.items[int(owners[group[0]])], name, len(group)))
        return build_metadata(entries, self.block_size, self.device, self.kernels)

    def _routed_decode_meta(self, name: str, owners: np.ndarray) -> AttentionMetadata:
        """routed_meta when every selected row is a decode row: the same result, built in one pass."""
        bs = self.block_size
        items = [self.items[i] for i in owners.tolist()]
        tables = [item.routed[name][0] for item in items]
        committed = np.array([item.routed[name][1] for item in items], dtype=np.int64)
        num_blocks = committed // bs + 1
        padded = np.zeros((len(items), int(num_blocks.max()), tables[0].shape[1]), dtype=np.int32)
        for k, (table, blocks) in enumerate(zip(tables, num_blocks.tolist())):
            padded[k, :blocks] = table[:blocks]
        write = padded[np.arange(len(items)), committed // bs].astype(np.int64) * bs + (committed % bs)[:, None]
        for item in items:
            self._count_routed(item, name, 1)
        return AttentionMetadata(
            num_tokens=len(items),
            block_size=bs,
            slot_index=_tensor(write, self.device),
            prefills=[],
            num_prefill_tokens=0,
            decode_page_table=page_table_tensor(padded, self.device),
            decode_context_lens=_tensor(committed + 1, self.device),
            kernels=self.kernels,
        )

    def _count_routed(self, item: BatchItem, name: str, count: int) -> None:
        key = (item.seq_id, name)
        self.routed_counts[key] = self.routed_counts.get(key, 0) + count
