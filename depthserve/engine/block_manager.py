"""Paged KV-cache bookkeeping: pages, reference counts, page tables, prefix caching.

No torch here: the block manager counts pages and hands out page ids; the model runner
turns page tables into tensors. One page = `block_size` tokens of one KV head of one slot.
A sequence's token-covering slots share one page table (`CacheLayout`): row i lists the
pages of token block i for every slot.

Prefix caching: a full token block, once computed, is registered under a hash of
(previous block's hash, its tokens, the layout, the depth settings). A later sequence with
the same prefix and settings reuses the row (reference count + 1). Rows nobody uses stay
cached until their pages are needed (least recently freed first).

Routed slots (ITT steps, `CacheLayout.routed_slots`) are not token-covering: each has its own
list of page rows (one per `block_size` selected tokens) and a committed length. Before a step,
`grow` reserves the worst case (every token of the step selected, in every routed slot);
after it, `commit_routed` adds the tokens actually selected and returns the pages beyond them.
Which tokens a step selects depends on the whole prefix, so a sequence with routed slots
neither uses nor feeds the prefix cache.

Per-sequence state (SlotKind.SEQ_STATE, `CacheLayout.state_bytes`, e.g. the PUT conv state) is
accounted in bytes and held as ceil(state_bytes / page_bytes) pages of the same pool, taken with
the sequence's first pages and freed with them (finish, abort, preemption: `free`). The model
stores the state in those pages, so it lives exactly as long as the sequence holds pages. A
sequence with state neither uses nor feeds the prefix cache.

Split-dependent blocks (`CacheLayout.prefix_chunk`, Dory's last_loop cache, docs/depth-semantics.md
"Public looped models: Dory"): a block's keys depend on how its tokens were split into forwards. The
prompt runs in forwards of `prefix_chunk` tokens counted from its first token, then one token per
forward; a later request computes the same chunk only if its prompt holds the whole chunk. So only
blocks inside whole prompt chunks are registered (the manager follows each sequence's forwards
through `commit_computed`), never those of a partial last chunk or of one-token decode forwards, and
a hit is cut to a whole number of chunks. With chunked prefill off the prompt is one forward, which
no cached chunk reproduces: such a sequence takes no hit.

Prompt-keyed blocks (`CacheLayout.prompt_keyed`, HRM-Text's bidirectional instruction block): every
key of the prompt depends on every prompt token, so the root of a sequence's hash chain includes its
whole prompt. A block is then shared only between sequences with the same prompt and settings (a
repeated request, a preempted one resuming); the model computes the prompt tokens a hit leaves
uncomputed in one forward attending over the whole prompt (docs/depth-semantics.md, "HRM-Text").

Sliding windows (`SlotSpec.window`): a windowed slot's keys of a block wholly behind the window of
the sequence's next query are never read again, so before each step `grow` gives back those pages
of the rows that are not in the prefix-cache chain (the row keeps the page ids: the attention ops
mask every key outside the window, so they never use what such a page holds now). Rows in the
chain keep every page, since a hit needs the window's keys before its end: with prefix caching on,
a layout whose computed blocks all enter the cache (every one but Dory's last_loop) frees nothing.
The released rows are a contiguous run after the chain; `free` gives back the rest of their pages.
A routed slot with a window holds the positions of one level (`SlotSpec.from_level`: the tokens of a
depth range that ran a looped model's pass), so the sequence's recorded levels say how many of its
entries sit behind the window; its leading rows made only of those give their pages back the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.engine.sequence import Sequence


class _PageRows:
    """A growable [n, width] int32 array of page-id rows: amortized O(1) append, reads are views."""

    def __init__(self, width: int):
        self._data = np.empty((4, width), dtype=np.int32)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        return self.view()[i]

    def view(self) -> np.ndarray:
        return self._data[: self._len]

    def append(self, row: np.ndarray) -> None:
        if self._len == len(self._data):
            grown = np.empty((2 * len(self._data), self._data.shape[1]), dtype=np.int32)
            grown[: self._len] = self._data[: self._len]
            self._data = grown
        self._data[self._len] = row
        self._len += 1

    def pop(self) -> np.ndarray:
        self._len -= 1
        return self._data[self._len].copy()


class _EvictableRows:
    """Cached rows no sequence uses, least recently freed first, and their pages counted as rows come
    and go (the scheduler asks for the free pages at every admission: no walk over a pool's worth of
    cached rows)."""

    def __init__(self) -> None:
        self._rows: OrderedDict[int, int] = OrderedDict()  # block hash -> pages in its row
        self.pages = 0

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self):
        return iter(list(self._rows))

    def add(self, block_hash: int, pages: int) -> None:
        if block_hash not in self._rows:
            self._rows[block_hash] = pages
            self.pages += pages

    def discard(self, block_hash: int) -> None:
        self.pages -= self._rows.pop(block_hash, 0)

    def oldest(self) -> int:
        return next(iter(self._rows))


@dataclass
class _RoutedPages:
    """One routed slot of one sequence: page rows for its selected tokens, in selection order."""

    num_heads: int
    length: int = 0  # selected tokens committed
    rows: _PageRows = field(init=False)  # [reserved blocks, num_heads]
    # A windowed slot of a level's positions (SlotSpec.from_level): the positions scanned so far
    # for the entries behind the window, how many of them the slot holds, and the leading rows
    # whose pages went back (the row keeps the ids; no query reads an entry behind the window).
    scanned: int = 0
    behind: int = 0
    released: int = 0

    def __post_init__(self) -> None:
        self.rows = _PageRows(self.num_heads)

    def pages_held(self) -> int:
        return (len(self.rows) - self.released) * self.num_heads


@dataclass
class _SeqPages:
    layout: CacheLayout
    rows: _PageRows  # [blocks, row_width] the token-covering page table
    block_hashes: list[int] = field(default_factory=list)  # of the leading full, computed rows
    routed: dict[str, _RoutedPages] = field(default_factory=dict)
    state: np.ndarray | None = None  # pages holding the per-sequence state (None: not taken yet)
    # Split-dependent layouts (prefix_chunk): tokens computed when commit_computed last saw the
    # sequence, and the leading tokens computed in whole prompt chunks (the registrable ones).
    seen_computed: int = 0
    chunked_tokens: int = 0
    # Rows released_from..released_to-1 have given back their windowed slots' pages (never cached rows).
    released_from: int = 0
    released_to: int = 0

    @property
    def released_rows(self) -> int:
        return self.released_to - self.released_from

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def state_pages(self) -> int:
        return 0 if self.state is None else len(self.state)

    def routed_pages(self) -> int:
        return sum(r.pages_held() for r in self.routed.values())

    def table(self) -> np.ndarray:
        return self.rows.view()

    def append(self, row: np.ndarray) -> None:
        self.rows.append(row)


class BlockManager:
    def __init__(self, num_pages: int, block_size: int, enable_prefix_caching: bool = True,
                 page_bytes: int | None = None):
        if num_pages < 1 or block_size < 1:
            raise ValueError("num_pages and block_size must be positive")
        self.num_pages = num_pages
        self.page_bytes = page_bytes  # bytes of one page (per-sequence state is priced with it)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives low ids first
        self._refs = np.zeros(num_pages, dtype=np.int32)
        self._seqs: dict[int, _SeqPages] = {}
        self._cached: dict[int, np.ndarray] = {}  # block hash -> row of pages
        self._row_hash: dict[int, int] = {}  # first page of a cached row -> its hash
        self._evictable = _EvictableRows()  # hashes of unreferenced cached rows
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages available to new allocations (free plus evictable cached rows)."""
        return len(self._free) + self._evictable.pages

    @property
    def num_used_pages(self) -> int:
        return int(np.count_nonzero(self._refs))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def state_pages_for(self, layout: CacheLayout) -> int:
        """Pages that hold a sequence's per-sequence state (SlotKind.SEQ_STATE)."""
        if not layout.state_bytes:
            return 0
        if not self.page_bytes:
            raise ValueError("a layout with per-sequence state needs a BlockManager with page_bytes")
        return -(-layout.state_bytes // self.page_bytes)

    def pages_for(self, layout: CacheLayout, num_tokens: int) -> int:
        """Pages of a sequence of `num_tokens` tokens, routed slots at their worst case, plus its state."""
        return self.blocks_for(num_tokens) * (layout.row_width + layout.routed_width) + self.state_pages_for(layout)

    def fits_ever(self, layout: CacheLayout, num_tokens: int) -> bool:
        return self.pages_for(layout, num_tokens) <= self.num_pages

    # ---- queries ----------------------------------------------------------------------
    def has(self, seq: Sequence) -> bool:
        return seq.seq_id in self._seqs

    def page_table(self, seq: Sequence) -> np.ndarray:
        """[num_blocks, row_width] page ids of the sequence's token-covering slots."""
        return self._seqs[seq.seq_id].table()

    def pages_held(self, seq: Sequence) -> int:
        entry = self._seqs.get(seq.seq_id)
        if entry is None:
            return 0
        return entry.num_rows * entry.layout.row_width + entry.routed_pages() + entry.state_pages() \
            - entry.released_rows * len(entry.layout.windowed_columns)

    def routed_table(self, seq: Sequence, name: str) -> tuple[np.ndarray, int]:
        """([reserved_blocks, num_heads] page ids, committed length) of one routed slot."""
        routed = self._seqs[seq.seq_id].routed[name]
        return routed.rows.view(), routed.length

    def state_table(self, seq: Sequence) -> np.ndarray | None:
        """Page ids holding the sequence's per-sequence state (None when its layout has none)."""
        entry = self._seqs.get(seq.seq_id)
        return None if entry is None else entry.state

    def used_pages_by_kind(self) -> dict[SlotKind, int]:
        """Pages referenced by live sequences, by slot kind (shared rows counted once)."""
        seen: set[int] = set()
        counts: dict[SlotKind, int] = {}
        for entry in self._seqs.values():
            for kind, n in entry.layout.pages_by_kind(windowed=False).items():  # released rows: never shared
                counts[kind] = counts.get(kind, 0) + n * entry.released_rows
            for i, row in enumerate(entry.table()):
                if entry.released_from <= i < entry.released_to:
                    continue
                key = int(row[0])
                if key in seen:
                    continue
                seen.add(key)
                for kind, n in entry.layout.pages_by_kind().items():
                    counts[kind] = counts.get(kind, 0) + n
            if entry.routed:
                counts[SlotKind.ROUTED] = counts.get(SlotKind.ROUTED, 0) + entry.routed_pages()
            if entry.state_pages():
                counts[SlotKind.SEQ_STATE] = counts.get(SlotKind.SEQ_STATE, 0) + entry.state_pages()
        return counts

    # ---- allocation -------------------------------------------------------------------
    def can_grow(self, seq: Sequence, num_tokens: int, reserve_pages: int = 0) -> bool:
        """Whether the sequence's table can cover `num_tokens` tokens.

        Routed slots count at their worst case: every token from `seq.num_computed_tokens` up
        to `num_tokens` selected.
        """
        entry = self._seqs.get(seq.seq_id)
        have = 0 if entry is None else entry.num_rows
        need = max(self.blocks_for(num_tokens) - have, 0) * seq.layout.row_width
        extra = max(num_tokens - seq.num_computed_tokens, 0)
        for slot in seq.layout.routed_slots:
            routed = None if entry is None else entry.routed.get(slot.name)
            length, rows = (0, 0) if routed is None else (routed.length, len(routed.rows))
            need += max(self.blocks_for(length + extra) - rows, 0) * slot.num_heads
        if entry is None or entry.state is None:
            need += self.state_pages_for(seq.layout)
        return need <= self.num_free_pages - reserve_pages

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend the sequence's page table to cover `num_tokens` tokens, and reserve its routed
        slots' worst case for the tokens from `seq.num_computed_tokens` to `num_tokens`."""
        entry = self._entry(seq)
        if entry.state is None and entry.layout.state_bytes:
            entry.state = self._take_pages(self.state_pages_for(entry.layout))
        missing = self.blocks_for(num_tokens) - entry.num_rows
        if missing > 0:  # in one take: the same pages, in the same order, as one take per row
            width = entry.layout.row_width
            for row in self._take_pages(missing * width).reshape(missing, width):
                entry.append(row)
        self._release_behind_window(entry, seq.num_computed_tokens)
        extra = max(num_tokens - seq.num_computed_tokens, 0)
        for slot in entry.layout.routed_slots:
            routed = entry.routed.setdefault(slot.name, _RoutedPages(slot.num_heads))
            self._release_routed_behind_window(routed, slot, seq)
            while len(routed.rows) < self.blocks_for(routed.length + extra):
                routed.rows.append(self._take_pages(slot.num_heads))

    def commit_routed(self, seq: Sequence, name: str, num_selected: int) -> None:
        """After a step: `num_selected` more tokens live in the routed slot; return the unused reservation."""
        routed = self._seqs[seq.seq_id].routed[name]
        routed.length += num_selected
        keep = self.blocks_for(routed.length)
        if keep > len(routed.rows):
            raise RuntimeError(f"routed slot {name!r} used more than its reservation")
        while len(routed.rows) > keep:
            pages = routed.rows.pop()
            self._refs[pages] -= 1
            self._give_back(pages)

    def allocate_cached_prefix(self, seq: Sequence, depth_key: tuple, chunked_prefill: bool = True) -> int:
        """Attach cached rows for the sequence's leading full blocks; returns tokens covered.

        At least one token is always left to compute, so the step that follows produces the
        logits of the last prompt token. A split-dependent layout takes whole chunks only, and
        nothing when its prompt runs in one forward (`chunked_prefill` off).
        """
        entry = self._entry(seq)
        if not self.enable_prefix_caching or entry.num_rows or not entry.layout.uses_prefix_cache:
            return 0
        chunk = entry.layout.prefix_chunk
        if chunk is not None and not chunked_prefill:
            return 0
        tokens = seq.all_token_ids
        hits: list[tuple[int, np.ndarray]] = []
        parent = self._chain_root(entry.layout, seq, depth_key)
        for i in range((len(tokens) - 1) // self.block_size):
            block = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block_hash = hash((parent, block))
            self.prefix_queries += 1
            row = self._cached.get(block_hash)
            if row is None:
                break
            hits.append((block_hash, row))
            parent = block_hash
        if chunk is not None:
            while hits and len(hits) * self.block_size % chunk:
                hits.pop()
        for block_hash, row in hits:
            self.prefix_hits += 1
            self._evictable.discard(block_hash)
            self._refs[row] += 1
            entry.append(row)
            entry.block_hashes.append(block_hash)
        entry.seen_computed = entry.chunked_tokens = entry.num_rows * self.block_size
        return entry.num_rows * self.block_size

    def commit_computed(self, seq: Sequence, depth_key: tuple) -> None:
        """Register the sequence's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        entry = self._seqs.get(seq.seq_id)
        if entry is None or not entry.layout.uses_prefix_cache:
            return
        full = min(self._registrable_tokens(entry, seq) // self.block_size, entry.num_rows)
        if entry.released_rows:
            full = min(full, entry.released_from)
        if len(entry.block_hashes) >= full:
            return
        tokens = seq.all_token_ids
        parent = entry.block_hashes[-1] if entry.block_hashes else self._chain_root(entry.layout, seq, depth_key)
        for i in range(len(entry.block_hashes), full):
            block = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block_hash = hash((parent, block))
            row = entry.rows[i]
            if block_hash not in self._cached:
                self._cached[block_hash] = row.copy()
                self._row_hash[int(row[0])] = block_hash
            entry.block_hashes.append(block_hash)
            parent = block_hash

    def free(self, seq: Sequence) -> None:
        """Release every page the sequence holds (idempotent)."""
        entry = self._seqs.pop(seq.seq_id, None)
        if entry is None:
            return
        if entry.state is not None:
            self._refs[entry.state] -= 1
            self._give_back(entry.state)
        for routed in entry.routed.values():
            for pages in routed.rows.view()[routed.released:][::-1]:
                self._refs[pages] -= 1
                self._give_back(pages)
        table = entry.table()
        for i in range(len(table) - 1, -1, -1):
            row = table[i]
            if entry.released_from <= i < entry.released_to:
                kept = np.delete(row, entry.layout.windowed_columns)
                self._release(kept)
                continue
            self._refs[row] -= 1
            if self._refs[row[0]] > 0:
                continue
            block_hash = self._row_hash.get(int(row[0]))
            if block_hash is not None and np.array_equal(self._cached.get(block_hash, ()), row):
                self._evictable.add(block_hash, len(row))
            else:
                self._give_back(row)

    def reset_prefix_cache(self) -> None:
        for block_hash in self._evictable:
            self._evict(block_hash)

    # ---- internals --------------------------------------------------------------------
    @staticmethod
    def _chain_root(layout: CacheLayout, seq: Sequence, depth_key: tuple) -> int:
        """The hash a sequence's chain of block hashes starts from: its layout and depth settings, and
        for a prompt-keyed layout its whole prompt."""
        if layout.prompt_keyed:
            return hash((layout, depth_key, tuple(seq.all_token_ids[: seq.num_prompt_tokens])))
        return hash((layout, depth_key))

    @staticmethod
    def _registrable_tokens(entry: _SeqPages, seq: Sequence) -> int:
        """Leading tokens whose blocks may enter the prefix cache: every computed one, or for a
        split-dependent layout those of whole prompt chunks (the forwards since the last call
        decide: one that took exactly the chunk after the whole chunks so far extends them)."""
        chunk = entry.layout.prefix_chunk
        if chunk is None:
            return seq.num_computed_tokens
        start, end = entry.seen_computed, seq.num_computed_tokens
        entry.seen_computed = end
        if start == entry.chunked_tokens and end - start == chunk and end <= seq.num_prompt_tokens:
            entry.chunked_tokens = end
        return entry.chunked_tokens

    def _release_behind_window(self, entry: _SeqPages, next_position: int) -> None:
        """Give back the windowed slots' pages of the rows no query from `next_position` on reads
        (every key of the row before next_position - window + 1), past the prefix-cache chain."""
        window = entry.layout.max_window
        if window is None:
            return
        dead_rows = min(max(next_position - window + 1, 0) // self.block_size, entry.num_rows)
        if not entry.released_rows:
            entry.released_from = entry.released_to = max(len(entry.block_hashes), entry.released_to)
        columns = entry.layout.windowed_columns
        for i in range(entry.released_to, dead_rows):
            self._release(entry.rows[i][list(columns)])
        entry.released_to = max(entry.released_to, dead_rows)

    def _release_routed_behind_window(self, routed: _RoutedPages, slot: SlotSpec, seq: Sequence) -> None:
        """A windowed slot of a level's positions: give back the pages of its leading rows whose
        entries all sit before the window of the sequence's next query (routed rows are never
        shared, so the pages go free)."""
        if slot.window is None or slot.from_level is None:
            return
        cutoff = min(max(seq.num_computed_tokens - slot.window + 1, 0), len(seq.levels))
        if cutoff > routed.scanned:
            routed.behind += sum(level >= slot.from_level for level in seq.levels[routed.scanned: cutoff])
            routed.scanned = cutoff
        dead_rows = min(routed.behind // self.block_size, len(routed.rows))
        for i in range(routed.released, dead_rows):
            self._release(routed.rows[i])
        routed.released = max(routed.released, dead_rows)

    def _release(self, pages: np.ndarray) -> None:
        """One reference fewer on pages of rows outside the prefix cache; those unreferenced go free."""
        self._refs[pages] -= 1
        self._give_back(pages[self._refs[pages] == 0])

    def _entry(self, seq: Sequence) -> _SeqPages:
        entry = self._seqs.get(seq.seq_id)
        if entry is None:
            width = seq.layout.row_width
            entry = _SeqPages(layout=seq.layout, rows=_PageRows(width))
            self._seqs[seq.seq_id] = entry
        return entry

    def _take_pages(self, count: int) -> np.ndarray:
        while len(self._free) < count and self._evictable:
            self._evict(self._evictable.oldest())
        if len(self._free) < count:
            raise RuntimeError("out of KV-cache pages (the scheduler should have checked)")
        pages = np.array(self._free[len(self._free) - count:][::-1], dtype=np.int32)  # as `count` pops give them
        del self._free[len(self._free) - count:]
        self._refs[pages] = 1
        return pages

    def _give_back(self, pages: np.ndarray) -> None:
        """Pages onto the free list, the first of them to be taken first."""
        self._free.extend(pages[::-1].tolist())

    def _evict(self, block_hash: int) -> None:
        self._evictable.discard(block_hash)
        row = self._cached.pop(block_hash)
        self._row_hash.pop(int(row[0]), None)
        self._give_back(row)
