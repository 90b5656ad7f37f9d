"""The cache vocabulary of docs/depth-semantics.md as plain types (no torch).

A model declares, for one request's depth settings, the KV slots it needs. Every KV slot is
stored in the same page pool: one page holds `block_size` tokens of ONE KV head (keys and
values). A slot covering a token block takes `num_heads` pages, so a head-subset slot costs
exactly (heads stored)/(heads of the layer) of a dense one.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum


class SlotKind(str, Enum):
    DENSE = "dense"  # every layer, Dreamer/PUT depths
    HEAD_SUBSET = "head_subset"  # SGT loop iterations
    ROUTED = "routed"  # ITT steps: only the tokens selected at that step
    PER_KEY_BIAS = "per_key_bias"  # SAOBP
    SEQ_STATE = "seq_state"  # PUT conv state
    TOKEN_DEPTH = "token_depth"  # Dreamer per-token depth cache


@dataclass(frozen=True)
class SlotSpec:
    name: str
    kind: SlotKind
    num_heads: int  # KV heads stored: pages per token block
    # Keys a query of the slot's layer sees, its own included (a sliding-window layer): its pages of
    # blocks wholly behind every later query's window may be given back (BlockManager). None: all.
    window: int | None = None
    # A ROUTED slot that holds exactly the positions whose recorded level (Sequence.levels, a depth
    # range's per-token level) is at least this, in position order (a looped model's pass past the
    # range's minimum). Its keys' positions are then known to the block manager, so with a window
    # the pages of its entries behind the window may go back too. None: the slot's tokens are chosen
    # by the model (ITT's router), and a routed slot keeps every page.
    from_level: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"slot {self.name!r} must store at least one head")
        if self.window is not None and self.window < 1:
            raise ValueError(f"slot {self.name!r} must see at least one key (window >= 1)")
        if self.from_level is not None and self.kind is not SlotKind.ROUTED:
            raise ValueError(f"slot {self.name!r}: only a routed slot holds the positions of a level")
        if self.kind is SlotKind.ROUTED and self.window is not None and self.from_level is None:
            raise ValueError(f"routed slot {self.name!r} may have a window only with from_level "
                             "(else the positions of its keys are unknown)")


@dataclass(frozen=True)
class CacheLayout:
    """The KV slots of one request.

    `slots` cover every token (dense and head-subset kinds). They share one page table: row i
    holds, for token block i, the pages of every slot in order (`num_heads` each), so
    `columns(index)` picks a slot's pages out of the table. Dense slots come first, so every
    request of a model has its dense slots at the same columns (`base_width`).

    `routed_slots` (ITT steps) hold only the tokens selected at that step: each has its own
    table of pages, one row per `block_size` selected tokens, grown by worst-case reservation
    before a step and trimmed to what was used after it (BlockManager.reserve/commit_routed).
    """

    slots: tuple[SlotSpec, ...]
    routed_slots: tuple[SlotSpec, ...] = ()
    # How many leading slots form the base that every request of the model shares (None: every
    # leading dense slot). A model whose dense slots depend on the request's depth (PUT core
    # steps) puts the slots common to all requests first and says how many they are.
    base_slots: int | None = None
    # Per-sequence state of constant size outside the token-covering slots (SlotKind.SEQ_STATE,
    # e.g. the PUT conv state), in bytes. The block manager holds ceil(state_bytes / page_bytes)
    # pages of the pool for it while the sequence holds pages; such sequences never use or feed
    # the prefix cache (the state is not part of any block).
    state_bytes: int = 0
    # The blocks' contents depend on how the tokens were split into forwards (Dory's last_loop
    # cache): the prompt runs in forwards of this many tokens counted from its first token, and only
    # blocks of those whole chunks are shared, a whole number of chunks at a time (BlockManager).
    # None: any split gives the same blocks.
    prefix_chunk: int | None = None
    # Every block's keys depend on the whole prompt (HRM-Text's bidirectional instruction block, whose
    # tokens attend to the later ones): a block is shared only between sequences with the same prompt
    # (the prompt's tokens key the root of the block-hash chain, BlockManager).
    prompt_keyed: bool = False

    def __post_init__(self) -> None:
        if any(slot.kind is SlotKind.ROUTED for slot in self.slots):
            raise ValueError("routed slots go in routed_slots, not in the token-covering table")
        if any(slot.kind is not SlotKind.ROUTED for slot in self.routed_slots):
            raise ValueError("routed_slots may only hold ROUTED slots")
        if self.base_slots is not None and not 0 <= self.base_slots <= len(self.slots):
            raise ValueError("base_slots must lie in 0..len(slots)")
        if self.state_bytes < 0:
            raise ValueError("state_bytes must be >= 0")
        if self.prefix_chunk is not None and self.prefix_chunk < 1:
            raise ValueError("prefix_chunk must be positive (or None)")
        # Each slot's first column (the row width last) and the columns by slot name, computed once:
        # the models ask for them every step, for every layer and request (plain attributes, which a
        # compiled forward reads as constants; not fields, so equality and hashing ignore them).
        offsets = tuple(itertools.accumulate((slot.num_heads for slot in self.slots), initial=0))
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_columns_by_name",
                           {slot.name: slice(offsets[i], offsets[i + 1]) for i, slot in enumerate(self.slots)})
        windowed = [i for i, slot in enumerate(self.slots) if slot.window is not None]
        object.__setattr__(self, "_windowed_columns",
                           tuple(c for i in windowed for c in range(offsets[i], offsets[i + 1])))
        object.__setattr__(self, "_max_window", max((self.slots[i].window for i in windowed), default=None))

    @property
    def row_width(self) -> int:
        return self._offsets[-1]

    @property
    def base_width(self) -> int:
        """Columns of the leading dense slots (the same for every request of a model)."""
        if self.base_slots is not None:
            return sum(slot.num_heads for slot in self.slots[: self.base_slots])
        width = 0
        for slot in self.slots:
            if slot.kind is not SlotKind.DENSE:
                break
            width += slot.num_heads
        return width

    @property
    def routed_width(self) -> int:
        """Pages per block of selected tokens, summed over the routed slots."""
        return sum(slot.num_heads for slot in self.routed_slots)

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether this layout's blocks may be shared through the prefix cache. Not with routed
        slots (what a step selects depends on the whole prefix) nor with state outside the KV
        blocks that changes for cached keys (SAOBP per-key bias, PUT conv state): such a sequence
        neither uses nor feeds the prefix cache, and its forks compute their own copy."""
        if self.routed_slots or self.state_bytes:
            return False
        return not any(slot.kind in (SlotKind.PER_KEY_BIAS, SlotKind.SEQ_STATE) for slot in self.slots)

    def columns(self, index: int) -> slice:
        return slice(self._offsets[index], self._offsets[index + 1])

    def slot_columns(self) -> Mapping[str, slice]:
        """Name -> columns of every token-covering slot (shared: read it, copy it to change it)."""
        return self._columns_by_name

    @property
    def windowed_columns(self) -> tuple[int, ...]:
        """Columns of the slots with a window (their pages of blocks behind the window may go back)."""
        return self._windowed_columns

    @property
    def max_window(self) -> int | None:
        """The widest window of a windowed slot (None: no slot has one)."""
        return self._max_window

    def pages_by_kind(self, windowed: bool = True) -> dict[SlotKind, int]:
        """Pages of one token block by slot kind (`windowed` False: the windowed slots left out)."""
        counts: dict[SlotKind, int] = {}
        for slot in self.slots:
            if windowed or slot.window is None:
                counts[slot.kind] = counts.get(slot.kind, 0) + slot.num_heads
        return counts
