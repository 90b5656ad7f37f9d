"""Which rows of a step run a depth level, so that each depth mechanism's loop is written once and
runs both eagerly and in the compiled static decode step (docs/depth-semantics.md, section 6).

A loop asks its `StepRows` for the rows that run level k (`narrow`: a row runs it while its
setting is at least k; `where`: the rows a router selected), runs its block on their values
(`take`), and puts the results back (`merge`). Two implementations:

- `GatheredRows` (eager steps, over a `StepBatch`): the settings are known on the host, so a
  level's rows are gathered (index_select), attend through compact metadata for just those rows
  (`StepBatch.level_meta` / `routed_meta`), and are scattered back (index_copy). No row pays for
  a level it does not run.
- `MaskedRows` (a decode step at static shapes, engine/static_decode.py): every row runs every
  level up to the step's cap (`StaticRows.level_cap`), and keeps a level's result where its own
  setting says so (`torch.where`, never a product with a mask, so nothing read from the scratch
  page leaks in). No host synchronisation, no data-dependent shape.

A level narrowed from another level (a chain) carries its parent's rows: `take` maps a tensor
over the parent's rows to the level's, `merge` maps back.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from depthserve.layers.attention import AttentionMetadata, StaticRows, decode_slot_meta
from depthserve.layers.batch import StepBatch, stack_padded
from depthserve.layers.early_exit import ConfidenceExit, LevelExit, NoExit


class StepRows(ABC):
    """A set of a step's rows running one depth level (the whole step at the top)."""

    meta: AttentionMetadata  # the step's metadata

    @abstractmethod
    def setting(self, index: int) -> Any:
        """Each row's value of its request's setting `index` (DepthModel.row_settings), as the
        implementation's `narrow` takes it (host array or device tensor)."""

    @abstractmethod
    def setting_tensor(self, index: int) -> torch.Tensor:
        """The same as a device tensor [step rows] float32."""

    @abstractmethod
    def cap(self, upper: int) -> int:
        """The last level of `upper` the step may run (masked: its level cap)."""

    @abstractmethod
    def deepest(self, values: Any, upper: int) -> int:
        """The last level any row runs by `values` (a `setting`), at most `upper`."""

    @abstractmethod
    def any_below(self, index: int, bound: float) -> bool:
        """Whether any row may have setting `index` below `bound` (masked: always, the cap decides)."""

    @abstractmethod
    def narrow(self, values: Any, level: int) -> StepRows:
        """The rows of this set whose `values` (a `setting`, over the step's rows) are >= `level`."""

    @abstractmethod
    def where(self, selected: torch.Tensor) -> StepRows:
        """The rows of the step where `selected` [step rows] bool holds (a router's choice)."""

    @property
    @abstractmethod
    def empty(self) -> bool:
        """No row runs (known only on the host: False for masked rows)."""

    @abstractmethod
    def take(self, values: torch.Tensor) -> torch.Tensor:
        """The rows of this set from `values` over its parent's rows."""

    @abstractmethod
    def merge(self, parent: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`parent` (over the parent's rows) with this set's rows replaced by `values`."""

    @abstractmethod
    def spread(self, values: torch.Tensor, fill: float) -> torch.Tensor:
        """`values` of this set's rows over every row of the step, `fill` elsewhere."""

    @abstractmethod
    def attend(self, slot: str, read_heads: tuple[int, ...] | None = None) -> tuple[AttentionMetadata, slice]:
        """Attention metadata and page-table columns for this set's rows over the cache slot named
        `slot` (a token-covering or routed slot); `read_heads` maps each attended head to a stored
        KV head (a head subset with uneven GQA groups; a tuple: constants of a compiled step)."""

    @abstractmethod
    def emit(self, decisions: torch.Tensor) -> None:
        """The step's routing decisions [step rows, StaticDecodeSpec.decisions] int32, for the runner
        to record per request (DepthModel.record_decisions)."""

    @abstractmethod
    def confidence_exit(self, setting: int) -> LevelExit:
        """Each row's level (its setting `setting`), lowered where a token exits early
        (layers/early_exit.py): gathered rows only; masked rows never exit."""

    # ---- per-sequence tensors: [the step's sequences, ...] (a masked step has one row per sequence) ----
    @abstractmethod
    def sequence_state_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each of the step's sequences' per-sequence state pages [sequences, pages] int64 (-1: none),
        and whether it carries state from earlier steps [sequences] bool (a sequence whose first
        row is at position 0 starts from zeros)."""

    @abstractmethod
    def of_sequences(self, values: torch.Tensor) -> torch.Tensor:
        """The entries of `values` (over the step's sequences) of the sequences with rows in this set."""

    @abstractmethod
    def merge_sequences(self, parent: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`parent` (over the step's sequences) with this set's sequences' entries replaced by `values`."""

    @abstractmethod
    def causal_window(self, size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """A causal window of `size` rows per sequence over this set's rows, each sequence carrying
        its last size-1 values from before. Over cat(carried [set's sequences * (size-1)], this set's
        rows), oldest carried value first: per tap j, the index of each row's value j rows back
        (counting only this set's rows of its sequence), and the indices of each sequence's last
        size-1 values afterwards (its new carry, [set's sequences * (size-1)])."""

    rows: np.ndarray | None = None  # gathered: the step's packed rows in this set (None: all)
    static_shapes: bool = False  # masked: no host synchronisation, no data-dependent shape

    @property
    def item_indices(self) -> list[int]:
        """Gathered rows: the step items this set's rows belong to, ascending."""
        raise NotImplementedError

    @property
    def item_row_counts(self) -> list[int]:
        """Gathered rows: how many of this set's rows each of `item_indices` has."""
        raise NotImplementedError


def step_rows(meta: AttentionMetadata) -> StepRows:
    """The rows of a depth model's step: masked at static shapes, else gathered."""
    if meta.static is not None:
        return MaskedRows(meta, meta.static, None)
    return GatheredRows(meta, meta.batch, None, None)


class GatheredRows(StepRows):
    def __init__(self, meta: AttentionMetadata, step: StepBatch, rows: np.ndarray | None,
                 index: torch.Tensor | None, of_step: bool = True):
        self.meta, self.step = meta, step
        self.rows = rows  # packed rows of the step in this set, ascending (None: all)
        self.index = index  # their positions among the parent's rows (None: the same rows)
        self.of_step = of_step  # the parent is the whole step: `index` holds the packed rows themselves
        self._windows: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}  # causal_window by size

    def setting(self, index: int) -> np.ndarray:
        return self.step.settings()[:, index]

    def setting_tensor(self, index: int) -> torch.Tensor:
        return self.step.settings_tensor()[:, index]

    def cap(self, upper: int) -> int:
        return upper

    def deepest(self, values: np.ndarray, upper: int) -> int:
        own = values if self.rows is None else values[self.rows]
        return min(upper, int(own.max(initial=0)))

    def any_below(self, index: int, bound: float) -> bool:
        return bool((self.setting(index) < bound).any())

    def narrow(self, values: np.ndarray, level: int) -> GatheredRows:
        own = values if self.rows is None else values[self.rows]
        running = own >= level
        if running.all():
            return GatheredRows(self.meta, self.step, self.rows, None)
        keep = np.flatnonzero(running)
        rows = keep if self.rows is None else self.rows[keep]
        return GatheredRows(self.meta, self.step, rows, self.step.index_tensor(keep), self.rows is None)

    def where(self, selected: torch.Tensor) -> GatheredRows:
        index = selected.nonzero().squeeze(1)
        rows = index.cpu().numpy()
        if len(rows) == self.step.num_rows:
            return GatheredRows(self.meta, self.step, None, None)
        return GatheredRows(self.meta, self.step, rows, index)

    @property
    def empty(self) -> bool:
        return self.rows is not None and len(self.rows) == 0

    def take(self, values: torch.Tensor) -> torch.Tensor:
        return values if self.index is None else values.index_select(0, self.index)

    def merge(self, parent: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return values if self.index is None else parent.index_copy(0, self.index, values)

    def spread(self, values: torch.Tensor, fill: float) -> torch.Tensor:
        if self.rows is None:
            return values
        index = self.index if self.of_step and self.index is not None else self.step.index_tensor(self.rows)
        return values.new_full((self.step.num_rows, *values.shape[1:]), fill).index_copy_(0, index, values)

    @functools.cached_property
    def _items_and_counts(self) -> tuple[list[int], list[int]]:
        if self.rows is None:
            return list(range(len(self.step.items))), [item.num_tokens for item in self.step.items]
        owners, counts = np.unique(self.step.item_of_row()[self.rows], return_counts=True)
        return owners.tolist(), counts.tolist()

    @property
    def item_indices(self) -> list[int]:
        return self._items_and_counts[0]

    @property
    def item_row_counts(self) -> list[int]:
        return self._items_and_counts[1]

    def sequence_state_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        items = self.step.items
        no_pages = np.zeros(0, np.int64)
        pages = stack_padded([no_pages if item.state is None else item.state for item in items], np.int64, fill=-1)
        carried = np.array([item.start > 0 for item in items], dtype=bool)
        device = self.step.device
        return torch.from_numpy(pages).to(device), torch.from_numpy(carried).to(device)

    @functools.cached_property
    def _sequence_index(self) -> torch.Tensor | None:
        if self.rows is None:
            return None
        return self.step.index_tensor(np.array(self.item_indices, dtype=np.int64))

    def of_sequences(self, values: torch.Tensor) -> torch.Tensor:
        index = self._sequence_index
        return values if index is None else values.index_select(0, index)

    def merge_sequences(self, parent: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        index = self._sequence_index
        return values if index is None else parent.index_copy(0, index, values)

    def causal_window(self, size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        if size not in self._windows:
            self._windows[size] = self._causal_window(size)
        return self._windows[size]

    def _causal_window(self, size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        carry, m = size - 1, len(self.item_indices)
        taps: list[list[np.ndarray]] = [[] for _ in range(size)]
        new = []
        row = 0
        for i, n in enumerate(self.item_row_counts):
            local = np.arange(n)
            for j in range(size):
                own = m * carry + row + local - j  # a row of this set
                carried = i * carry + carry + local - j  # from the carry (local - j in [-carry, -1])
                taps[j].append(np.where(local >= j, own, carried))
            last = np.arange(n - carry, n)
            new.append(np.where(last >= 0, m * carry + row + last, i * carry + carry + last))
            row += n
        as_tensor = lambda parts: self.step.index_tensor(np.concatenate(parts).astype(np.int64))  # noqa: E731
        return [as_tensor(tap) for tap in taps], as_tensor(new)

    def attend(self, slot: str, read_heads: tuple[int, ...] | None = None) -> tuple[AttentionMetadata, slice]:
        step = self.step
        indices, counts = self._items_and_counts
        items = [step.items[i] for i in indices]
        slots = [slot if slot in item.routed else item.slot_columns[slot] for item in items]
        first = slots[0] if slots else None
        if read_heads is None and all(isinstance(s, str) for s in slots):  # routed for every item
            rows = np.arange(step.num_rows) if self.rows is None else self.rows
            return step.routed_meta(slot, rows), slice(None)
        if (self.rows is None and read_heads is None and isinstance(first, slice)
                and all(s == first for s in slots) and first.stop <= step.base_width):
            # Every row runs the level, over the same columns of the step's base table: its metadata.
            return self.meta, first
        heads = None if read_heads is None else np.array(read_heads, dtype=np.int64)
        return step.level_meta(items, slots, heads, counts), slice(None)

    def emit(self, decisions: torch.Tensor) -> None:
        self.step.decisions = decisions

    def confidence_exit(self, setting: int) -> LevelExit:
        return ConfidenceExit(self.step, self.setting(setting))


class MaskedRows(StepRows):
    static_shapes = True

    def __init__(self, meta: AttentionMetadata, static: StaticRows, mask: torch.Tensor | None):
        self.meta, self.static = meta, static
        self.mask = mask  # [step rows] bool: the rows that run (None: all)

    def setting(self, index: int) -> torch.Tensor:
        return self.static.settings[:, index]

    def setting_tensor(self, index: int) -> torch.Tensor:
        return self.static.settings[:, index]

    def cap(self, upper: int) -> int:
        cap = self.static.level_cap
        return upper if cap is None else min(cap, upper)

    def deepest(self, values: torch.Tensor, upper: int) -> int:
        return self.cap(upper)

    def any_below(self, index: int, bound: float) -> bool:
        return True

    def narrow(self, values: torch.Tensor, level: int) -> MaskedRows:
        return MaskedRows(self.meta, self.static, values >= level)

    def where(self, selected: torch.Tensor) -> MaskedRows:
        return MaskedRows(self.meta, self.static, selected)

    @property
    def empty(self) -> bool:
        return False

    def take(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def _keep(self, values: torch.Tensor) -> torch.Tensor:
        return self.mask.view(-1, *([1] * (values.dim() - 1)))

    def merge(self, parent: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return values if self.mask is None else torch.where(self._keep(values), values, parent)

    def spread(self, values: torch.Tensor, fill: float) -> torch.Tensor:
        return values if self.mask is None else torch.where(self._keep(values), values, fill)

    def sequence_state_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.static.state_pages, self.static.positions > 0

    def of_sequences(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def merge_sequences(self, parent: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return self.merge(parent, values)

    def causal_window(self, size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One row per sequence: tap j of row r is its own value (j = 0) or its carry's value j back."""
        carry, m = size - 1, self.static.positions.shape[0]
        row = torch.arange(m, device=self.static.positions.device)
        taps = [m * carry + row] + [row * carry + carry - j for j in range(1, size)]
        if not carry:  # a window of one row: nothing carried
            return taps, row[:0]
        kept = [row[:, None] * carry + torch.arange(1, carry, device=row.device), (m * carry + row)[:, None]]
        return taps, torch.cat(kept, dim=1).reshape(-1)

    def attend(self, slot: str, read_heads: tuple[int, ...] | None = None) -> tuple[AttentionMetadata, slice]:
        static, meta = self.static, self.meta
        columns = static.columns[slot]
        if slot in static.routed_index:  # a routed slot stores only the rows that run, at its own length
            lens = static.routed_lens[:, static.routed_index[slot]] + 1
            return decode_slot_meta(meta, columns, read_heads, stores=self.mask, context_lens=lens), slice(None)
        if read_heads is not None or self.mask is not None:  # a row stores its key only at a level it runs
            return decode_slot_meta(meta, columns, read_heads, stores=self.mask), slice(None)
        return meta, columns

    def emit(self, decisions: torch.Tensor) -> None:
        self.static.decisions.copy_(decisions.to(torch.int32))

    def confidence_exit(self, setting: int) -> LevelExit:
        return NoExit(self.setting(setting))
