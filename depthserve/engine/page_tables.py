"""The page tables of the static decode step's rows, kept where the forward reads them and updated
by what changed.

A row's table is `max_blocks` rows of `width` page ids (int32): wide enough for max_model_len (on
CUDA the forward always reads the full width, so a bucket's step keeps its shapes and addresses for
CUDA-graph replay). Rebuilding and copying every row every step would cost, at 64 sequences and
8,192 tokens of SmolLM2 (90 columns, 512 blocks), 24 MB filled and copied per step in int64.
Instead each row remembers whose pages it holds (`RowTable.key`: a sequence's allocation) and how
many leading blocks are current, and a step sends only:

- the blocks a row lacks: its sequence's new blocks (one every `block_size` tokens), all of a row
  that holds a sequence for the first time, and the few blocks whose pages may change from step to
  step (the reserved block of a routed slot);
- moves: a sequence whose row index changed (a sequence before it finished) takes its row from the
  old index on the device (one gather), instead of resending it.

Rows of the bucket past the step's sequences are padding: their first block points at the scratch
page (a padding row reads one key there, and SAOBP's bias update writes its bias there). Blocks past
a row's context may hold stale page ids (every id is a valid page): kernels read no key at or past
the context, and the torch ops mask what they read there.

On CPU the table is the host array itself (updates are numpy writes); on CUDA the updates travel in
the step's one host-to-device copy (a region of the static decode's staging buffer) and are applied
by two device ops before the step runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch

PADDING = "padding"  # the key of a row whose first block points at the scratch page


@dataclass(frozen=True)
class RowTable:
    """One decode row's page table, produced block by block on demand."""

    # Whose pages these are: while a row holds the same key, the blocks it was sent stay valid (a
    # sequence's table only grows until its pages are freed, which changes the key). None: never
    # reused (the table is sent whole each step).
    key: Hashable | None
    num_blocks: int  # blocks covering the row's context
    stable_blocks: int  # leading blocks that cannot change under this key; later ones are resent each step
    blocks: Callable[[int, int], np.ndarray]  # (start, stop) -> [stop - start, width] page ids

    @classmethod
    def of_array(cls, table: np.ndarray) -> RowTable:
        """A table given whole (warm-up rows, tests): sent whole each step."""
        return cls(None, len(table), len(table), lambda start, stop: table[start:stop])


@dataclass
class TableUpdate:
    """What one step changes: rows moved (from, to, over their first `moved_blocks` blocks), then
    blocks written (flat block index row * max_blocks + block, and their page ids)."""

    move_from: np.ndarray  # [moves] int64
    move_to: np.ndarray
    moved_blocks: int
    block_index: np.ndarray  # [written] int64
    block_pages: np.ndarray  # [written, width] int32

    def staged_words(self, width: int) -> int:
        """int64 words of the update in a staging buffer (moves, block indices, packed int32 pages)."""
        return 2 * len(self.move_from) + len(self.block_index) + -(-len(self.block_index) * width // 2)


class DecodeTables:
    """The page tables of the static decode rows, [rows, max_blocks, width] int32 (module docstring)."""

    def __init__(self, rows: int, max_blocks: int, width: int, scratch_page: int, device: torch.device):
        self.max_blocks, self.width, self.scratch_page = max_blocks, width, scratch_page
        self.table = torch.full((rows, max_blocks, width), scratch_page, dtype=torch.int32, device=device)
        self._host = self.table.numpy() if device.type == "cpu" else None  # CPU: updated in place
        self.keys: list[Hashable | None] = [PADDING] * rows  # what each row holds
        self.valid = np.zeros(rows, dtype=np.int64)  # leading blocks of each row that hold its key's pages
        # Since start: page-table bytes written (page ids of the blocks written), sent to the device
        # (CUDA: the staged updates, indices and moves included) and moved between rows.
        self.bytes_written = self.bytes_sent = self.bytes_moved = 0

    def staging_words(self) -> int:
        """The most int64 words one step's update can take in a staging buffer: every row moved and
        every block of every row written."""
        rows = self.table.shape[0]
        return 2 * rows + rows * self.max_blocks + -(-rows * self.max_blocks * self.width // 2)

    def update(self, tables: list[RowTable], size: int) -> TableUpdate:
        """The changes that make rows 0..size-1 hold `tables` (then padding), with the bookkeeping
        updated as if they were applied (`apply_on_host` or `stage` + `apply_on_device` must follow)."""
        keys, valid = list(self.keys), self.valid.copy()
        move_from, move_to = self._place(tables, size, keys, valid)
        index, pages = self._blocks_to_write(tables, size, keys, valid)
        moved_blocks = int(self.valid[move_from].max()) if move_from else 0
        self.keys, self.valid = keys, valid
        update = TableUpdate(np.asarray(move_from, np.int64), np.asarray(move_to, np.int64), moved_blocks,
                             np.concatenate(index) if index else np.zeros(0, np.int64),
                             np.concatenate(pages).astype(np.int32) if pages else np.zeros((0, self.width), np.int32))
        self.bytes_moved += len(move_from) * moved_blocks * self.width * 4
        self.bytes_written += update.block_pages.nbytes
        return update

    def _place(self, tables: list[RowTable], size: int, keys: list, valid: np.ndarray) -> tuple[list, list]:
        """Give each row its key (in `keys`, `valid`); a key found at another row moves from there with
        its valid blocks. Returns the moves (from rows, to rows)."""
        row_of = {key: row for row, key in enumerate(self.keys) if key is not None and key != PADDING}
        move_from, move_to, left = [], [], set()
        for row, table in enumerate(tables):
            if table.key is not None and keys[row] == table.key:
                continue
            source = row_of.get(table.key) if table.key is not None else None
            valid[row] = 0 if source is None else self.valid[source]
            if valid[row]:
                move_from.append(source)
                move_to.append(row)
            if source is not None:
                left.add(source)
            keys[row] = table.key
        for source in left - set(range(size)):  # a row outside the bucket that its key left holds nothing now
            keys[source], valid[source] = None, 0
        return move_from, move_to

    def _blocks_to_write(self, tables: list[RowTable], size: int, keys: list,
                         valid: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The blocks each row lacks (flat block indices and page ids), and the first block of rows
        that turn to padding; `valid` becomes what stays valid for the next step."""
        index, pages = [], []
        for row, table in enumerate(tables):
            start = int(valid[row])
            if start < table.num_blocks:
                index.append(row * self.max_blocks + np.arange(start, table.num_blocks))
                pages.append(table.blocks(start, table.num_blocks))
            valid[row] = min(table.stable_blocks, table.num_blocks)
        for row in range(len(tables), size):
            if keys[row] != PADDING:
                index.append(np.array([row * self.max_blocks]))
                pages.append(np.full((1, self.width), self.scratch_page))
                keys[row], valid[row] = PADDING, 0
        return index, pages

    def apply_on_host(self, update: TableUpdate) -> None:
        """CPU: the update written into the table itself."""
        if len(update.move_from):
            blocks = update.moved_blocks
            self._host[update.move_to, :blocks] = self._host[update.move_from, :blocks]
        if len(update.block_index):
            self._host.reshape(-1, self.width)[update.block_index] = update.block_pages

    def stage(self, update: TableUpdate, words: np.ndarray) -> int:
        """CUDA: the update laid out in `words` (int64, a staging buffer's region); returns the words used."""
        moves, written = len(update.move_from), len(update.block_index)
        words[:moves], words[moves: 2 * moves] = update.move_from, update.move_to
        words[2 * moves: 2 * moves + written] = update.block_index
        used = update.staged_words(self.width)
        packed = words[2 * moves + written: used].view(np.int32)
        packed[: written * self.width] = update.block_pages.reshape(-1)
        self.bytes_sent += 8 * used
        return used

    def apply_on_device(self, update: TableUpdate, words: torch.Tensor) -> None:
        """CUDA: the staged update (`words`, the device copy of what `stage` wrote) applied to the table."""
        moves, written = len(update.move_from), len(update.block_index)
        if moves:
            blocks = update.moved_blocks
            source = self.table[:, :blocks].index_select(0, words[:moves])  # read before any row is written
            self.table[:, :blocks].index_copy_(0, words[moves: 2 * moves], source)
        if written:
            packed = words[2 * moves + written: update.staged_words(self.width)].view(torch.int32)
            pages = packed[: written * self.width].view(written, self.width)
            self.table.view(-1, self.width).index_copy_(0, words[2 * moves: 2 * moves + written], pages)
