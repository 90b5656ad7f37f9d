"""Block manager: page accounting, page tables, prefix caching (torch-free, no model)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from depthserve.depth import DepthParams, DepthPlan
from depthserve.engine.block_manager import BlockManager
from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.engine.sequence import Sequence
from depthserve.sampling_params import SamplingParams

# ---- layouts -------------------------------------------------------------------------------

ONE = CacheLayout((SlotSpec("kv", SlotKind.DENSE, 1),))
TWO_HEADS = CacheLayout((SlotSpec("kv", SlotKind.DENSE, 2),))
# 3 dense slots of 2 KV heads each, plus an SGT-style loop slot that stores 1 head of 2.
MIXED = CacheLayout(
    (
        SlotSpec("layer0", SlotKind.DENSE, 2),
        SlotSpec("layer1", SlotKind.DENSE, 2),
        SlotSpec("layer2", SlotKind.DENSE, 2),
        SlotSpec("loop1", SlotKind.HEAD_SUBSET, 1),
    )
)
LAYOUTS = {"one": ONE, "two_heads": TWO_HEADS, "mixed": MIXED}


def make_seq(prompt, layout=ONE, max_tokens=8, depth=None, sampling=None, rid="r"):
    plan = DepthPlan(depth=depth or DepthParams(), layout=layout)
    return Sequence(rid, 0, list(prompt), sampling or SamplingParams(), plan, max_tokens)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What the engine does around one step: cover the tokens, compute them, commit."""
    bm.grow(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    bm.commit_computed(seq, seq.depth.cache_key())


def check_consistent(bm: BlockManager) -> None:
    """Every page is exactly one of: free, held by a live sequence, or an evictable cached row."""
    free = list(bm._free)
    evictable = [int(p) for h in bm._evictable for p in bm._cached[h]]
    held = set()
    for entry in bm._seqs.values():
        for i, row in enumerate(entry.table()):
            released = entry.released_from <= i < entry.released_to  # its windowed pages given back
            held.update(int(p) for p in (np.delete(row, entry.layout.windowed_columns) if released else row))
        for routed in entry.routed.values():  # past its leading rows given back behind a window
            held.update(int(p) for p in routed.rows.view()[routed.released:].ravel())
    assert len(free) == len(set(free)), "a page is on the free list twice"
    assert len(evictable) == len(set(evictable)), "an evictable page is cached twice"
    assert not set(free) & set(evictable)
    assert not set(free) & held, "a page is both free and held"
    assert not set(evictable) & held, "a page is both evictable and held"
    assert set(free) | set(evictable) | held == set(range(bm.num_pages)), "a page leaked"
    assert bm.num_used_pages == len(held)
    assert bm.num_free_pages == len(free) + len(evictable)


@pytest.fixture
def make_bm(request):
    """Block managers a test creates; at teardown each must have every page free again."""
    created: list[BlockManager] = []
    failed_before = request.session.testsfailed

    def factory(num_pages: int, block_size: int = 4, enable_prefix_caching: bool = True) -> BlockManager:
        bm = BlockManager(num_pages, block_size, enable_prefix_caching)
        created.append(bm)
        return bm

    yield factory
    if request.session.testsfailed > failed_before:
        return  # the test itself failed: its report says why
    for bm in created:
        check_consistent(bm)
        assert not bm._seqs, "a sequence was not freed"
        assert bm.num_free_pages == bm.num_pages
        assert bm.num_used_pages == 0
        assert not np.any(bm._refs)


@pytest.fixture(scope="module", autouse=True)
def _torch_free():
    preloaded = "torch" in sys.modules  # another test module of this session imported it
    yield
    if not preloaded:
        assert "torch" not in sys.modules, "the block manager tests imported torch"


# ---- layouts -------------------------------------------------------------------------------


def test_layout_row_width_counts_stored_heads():
    assert ONE.row_width == 1
    assert TWO_HEADS.row_width == 2
    assert MIXED.row_width == 7  # 3 x 2 dense heads + 1 head-subset head
    assert MIXED.columns(0) == slice(0, 2)
    assert MIXED.columns(2) == slice(4, 6)
    assert MIXED.columns(3) == slice(6, 7)
    assert MIXED.pages_by_kind() == {SlotKind.DENSE: 6, SlotKind.HEAD_SUBSET: 1}
    with pytest.raises(ValueError):
        SlotSpec("empty", SlotKind.DENSE, 0)


def test_constructor_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_sizes(make_bm):
    bm = make_bm(100, block_size=4)
    assert [bm.blocks_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]
    assert bm.pages_for(MIXED, 9) == 3 * 7
    assert bm.pages_for(ONE, 9) == 3
    assert bm.fits_ever(MIXED, 14 * 4)  # 14 blocks x 7 pages = 98
    assert not bm.fits_ever(MIXED, 14 * 4 + 1)
    assert bm.fits_ever(ONE, 400) and not bm.fits_ever(ONE, 401)


# ---- grow / can_grow -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_grow_accounting(make_bm, name, block_size):
    layout = LAYOUTS[name]
    width = layout.row_width
    extra = width - 1  # less than one more row
    num_pages = 10 * width + extra
    bm = make_bm(num_pages, block_size)
    seq = make_seq(range(3 * block_size + 1), layout)
    assert not bm.has(seq)
    assert bm.pages_held(seq) == 0
    assert bm.can_grow(seq, 0)

    previous = np.empty((0, width), dtype=np.int32)
    for num_tokens in (1, block_size, block_size + 1, 3 * block_size + 1, 3 * block_size, 5 * block_size):
        blocks = bm.blocks_for(num_tokens)
        assert bm.can_grow(seq, num_tokens)
        bm.grow(seq, num_tokens)
        rows = max(len(previous), blocks)  # never shrinks
        table = bm.page_table(seq)
        assert table.shape == (rows, width)
        assert table.dtype == np.int32
        np.testing.assert_array_equal(table[: len(previous)], previous)  # earlier rows kept
        assert len(set(table.ravel().tolist())) == table.size
        assert all(0 <= p < num_pages for p in table.ravel().tolist())
        assert bm.pages_held(seq) == rows * width
        assert bm.num_used_pages == rows * width
        assert bm.num_free_pages == num_pages - rows * width
        previous = table.copy()

    # 5 blocks held, 5 * width + extra pages free: exactly 5 more blocks fit, not 6.
    assert bm.can_grow(seq, 10 * block_size)
    assert not bm.can_grow(seq, 10 * block_size + 1)
    assert bm.can_grow(seq, 9 * block_size, reserve_pages=width + extra)
    assert not bm.can_grow(seq, 9 * block_size, reserve_pages=width + extra + 1)
    assert bm.can_grow(seq, 10 * block_size, reserve_pages=extra)
    assert not bm.can_grow(seq, 10 * block_size, reserve_pages=extra + 1)
    # Asking for fewer tokens than held never needs pages.
    assert bm.can_grow(seq, block_size, reserve_pages=bm.num_free_pages)
    bm.free(seq)
    assert not bm.has(seq)


def test_can_grow_of_a_new_sequence_counts_its_whole_table(make_bm):
    bm = make_bm(21, block_size=4)
    seq = make_seq(range(12), MIXED)
    assert bm.can_grow(seq, 12)  # 3 blocks x 7 pages = 21
    assert not bm.can_grow(seq, 13)
    assert not bm.can_grow(seq, 12, reserve_pages=1)
    assert not bm.has(seq)  # can_grow allocates nothing
    assert bm.num_free_pages == 21


def test_mixed_layout_costs_exactly_its_heads(make_bm):
    bm = make_bm(70, block_size=2)
    dense = make_seq(range(4), TWO_HEADS)
    mixed = make_seq(range(4), MIXED)
    bm.grow(dense, 4)
    bm.grow(mixed, 3)
    assert bm.pages_held(dense) == 2 * 2
    assert bm.pages_held(mixed) == 2 * 7
    assert bm.num_free_pages == 70 - 4 - 14
    assert bm.used_pages_by_kind() == {SlotKind.DENSE: 4 + 12, SlotKind.HEAD_SUBSET: 2}
    bm.free(dense)
    bm.free(mixed)
    assert bm.used_pages_by_kind() == {}


def test_page_ids_unique_across_sequences(make_bm):
    bm = make_bm(200, block_size=4)
    seqs = [make_seq(range(n), layout, rid=str(i)) for i, (n, layout) in enumerate(
        [(5, ONE), (9, MIXED), (1, TWO_HEADS), (16, MIXED), (30, ONE), (7, TWO_HEADS)]
    )]
    # Interleave growth so rows of different sequences alternate in the pool.
    for step in range(1, 31):
        for seq in seqs:
            bm.grow(seq, min(step, seq.num_tokens))
    pages = np.concatenate([bm.page_table(s).ravel() for s in seqs]).tolist()
    assert len(pages) == len(set(pages))
    assert len(pages) == sum(bm.pages_held(s) for s in seqs) == bm.num_used_pages
    # Free some, grow others into the released pages: still unique.
    bm.free(seqs[1])
    bm.free(seqs[4])
    extra = make_seq(range(40), MIXED, rid="extra")
    bm.grow(extra, 40)
    live = [s for s in seqs if bm.has(s)] + [extra]
    pages = np.concatenate([bm.page_table(s).ravel() for s in live]).tolist()
    assert len(pages) == len(set(pages))
    check_consistent(bm)
    for seq in live:
        bm.free(seq)


def test_free_is_idempotent(make_bm):
    bm = make_bm(16, block_size=4)
    a = make_seq(range(10), TWO_HEADS, rid="a")
    b = make_seq(range(6), TWO_HEADS, rid="b")
    bm.grow(a, 10)
    bm.grow(b, 6)
    bm.free(a)
    bm.free(a)  # twice: no double free
    assert bm.num_free_pages == 16 - 4
    check_consistent(bm)
    never = make_seq(range(3), rid="never")
    bm.free(never)  # never allocated
    bm.free(b)
    bm.free(b)
    assert bm.num_free_pages == 16
    # The pool is whole: every page can be handed out once more, no id twice.
    c = make_seq(range(32), TWO_HEADS, rid="c")
    bm.grow(c, 32)
    assert sorted(bm.page_table(c).ravel().tolist()) == list(range(16))
    bm.free(c)


def test_out_of_pages(make_bm):
    bm = make_bm(10, block_size=4)
    a = make_seq(range(16), TWO_HEADS, rid="a")
    bm.grow(a, 16)  # 8 pages
    b = make_seq(range(8), TWO_HEADS, rid="b")
    assert bm.can_grow(b, 4)
    assert not bm.can_grow(b, 5)
    with pytest.raises(RuntimeError, match="out of KV-cache pages"):
        bm.grow(b, 8)
    assert bm.num_free_pages + bm.num_used_pages == 10
    check_consistent(bm)
    bm.free(b)
    bm.free(a)
    assert bm.num_free_pages == 10


# ---- prefix caching --------------------------------------------------------------------------


def test_no_hit_before_commit(make_bm):
    bm = make_bm(32, block_size=4)
    a = make_seq(range(12), rid="a")
    bm.grow(a, 12)
    a.num_computed_tokens = 12  # computed, but never committed
    b = make_seq(range(12), rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 0
    bm.free(a)
    bm.free(b)


def test_hits_only_on_full_computed_blocks(make_bm):
    bm = make_bm(64, block_size=4)
    prompt = list(range(100, 120))
    a = make_seq(prompt, rid="a")
    bm.grow(a, 20)  # the whole prompt is covered...
    a.num_computed_tokens = 7  # ...but only 7 tokens computed: one full block
    bm.commit_computed(a, ())
    b = make_seq(prompt, rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 4
    np.testing.assert_array_equal(bm.page_table(b), bm.page_table(a)[:1])  # the same pages
    bm.free(b)

    a.num_computed_tokens = 16
    bm.commit_computed(a, ())
    c = make_seq(prompt, rid="c")
    assert bm.allocate_cached_prefix(c, ()) == 16
    np.testing.assert_array_equal(bm.page_table(c), bm.page_table(a)[:4])
    # Committing again is a no-op; the shared rows are referenced by both.
    bm.commit_computed(a, ())
    assert bm.num_used_pages == 5
    bm.free(a)
    bm.free(c)


@pytest.mark.parametrize("prompt_len, expected", [(8, 4), (9, 8), (11, 8), (12, 8), (13, 12), (3, 0), (4, 0), (5, 4)])
def test_never_the_whole_prompt(make_bm, prompt_len, expected):
    """At least one token is always left to compute, even when every block is cached."""
    bm = make_bm(64, block_size=4)
    prompt = list(range(prompt_len))
    a = make_seq(prompt + [999] * 8, rid="a")  # a longer sequence with the same prefix
    compute(bm, a, a.num_tokens)
    b = make_seq(prompt, rid="b")
    cached = bm.allocate_cached_prefix(b, ())
    assert cached == expected
    assert cached < b.num_tokens
    assert bm.pages_held(b) == expected // 4
    bm.free(a)
    bm.free(b)


def test_identical_prompt_leaves_last_token(make_bm):
    bm = make_bm(64, block_size=4)
    a = make_seq(range(8), rid="a")
    compute(bm, a, 8)
    b = make_seq(range(8), rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 4
    bm.grow(b, 8)
    # The last block is recomputed into a private row; its pages differ from a's.
    assert not set(bm.page_table(b)[1].tolist()) & set(bm.page_table(a)[1].tolist())
    assert bm.page_table(b)[0].tolist() == bm.page_table(a)[0].tolist()
    bm.free(a)
    bm.free(b)


def test_hits_follow_the_chain(make_bm):
    bm = make_bm(64, block_size=4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], rid="a")
    compute(bm, a, 13)
    # Same second and third blocks, different first block: the chain breaks at block 0.
    b = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 0
    # Diverges in the second block: only the first block hits.
    c = make_seq([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13], rid="c")
    assert bm.allocate_cached_prefix(c, ()) == 4
    for seq in (a, b, c):
        bm.free(seq)


def test_depth_settings_and_layout_are_part_of_the_key(make_bm):
    bm = make_bm(128, block_size=4)
    prompt = list(range(13))
    loops2 = DepthParams(loops=2)
    a = make_seq(prompt, ONE, depth=loops2, rid="a")
    compute(bm, a, 13)
    key = loops2.cache_key()
    same = make_seq(prompt, ONE, depth=DepthParams(loops=2), rid="same")
    assert bm.allocate_cached_prefix(same, key) == 12

    other_depth = DepthParams(loops=3)
    b = make_seq(prompt, ONE, depth=other_depth, rid="b")
    assert bm.allocate_cached_prefix(b, other_depth.cache_key()) == 0
    c = make_seq(prompt, ONE, rid="c")  # default depth
    assert bm.allocate_cached_prefix(c, DepthParams().cache_key()) == 0
    # Same depth key and same row width, but a different layout (slot kind / name).
    subset = CacheLayout((SlotSpec("kv", SlotKind.HEAD_SUBSET, 1),))
    d = make_seq(prompt, subset, depth=loops2, rid="d")
    assert bm.allocate_cached_prefix(d, key) == 0
    renamed = CacheLayout((SlotSpec("other", SlotKind.DENSE, 1),))
    e = make_seq(prompt, renamed, depth=loops2, rid="e")
    assert bm.allocate_cached_prefix(e, key) == 0
    f = make_seq(prompt, TWO_HEADS, depth=loops2, rid="f")
    assert bm.allocate_cached_prefix(f, key) == 0
    # A layout with the same slots in an equal (not identical) object still hits.
    g = make_seq(prompt, CacheLayout((SlotSpec("kv", SlotKind.DENSE, 1),)), depth=loops2, rid="g")
    assert bm.allocate_cached_prefix(g, DepthParams(loops=2).cache_key()) == 12
    for seq in (a, same, b, c, d, e, f, g):
        bm.free(seq)


def test_dict_valued_depth_key_hits(make_bm):
    bm = make_bm(32, block_size=2)
    depth = DepthParams(loops={0: 2, 3: 1}, selection_ratios=[0.5, 0.25])
    a = make_seq(range(7), depth=depth, rid="a")
    compute(bm, a, 7)
    same = DepthParams(loops={3: 1, 0: 2}, selection_ratios=[0.5, 0.25])
    b = make_seq(range(7), depth=same, rid="b")
    assert bm.allocate_cached_prefix(b, same.cache_key()) == 6
    other = DepthParams(loops={0: 2, 3: 2}, selection_ratios=[0.5, 0.25])
    c = make_seq(range(7), depth=other, rid="c")
    assert bm.allocate_cached_prefix(c, other.cache_key()) == 0
    for seq in (a, b, c):
        bm.free(seq)


def test_refcounts_shared_rows_freed_by_last_user(make_bm):
    bm = make_bm(24, block_size=4)
    prompt = list(range(13))
    a = make_seq(prompt, MIXED, rid="a")  # width 7: 2 blocks = 14 pages
    compute(bm, a, 8)
    b = make_seq(prompt, MIXED, rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 8
    shared = set(bm.page_table(a).ravel().tolist())
    assert set(bm.page_table(b).ravel().tolist()) == shared
    assert bm.num_used_pages == 14  # shared pages counted once
    assert bm.used_pages_by_kind() == {SlotKind.DENSE: 12, SlotKind.HEAD_SUBSET: 2}
    assert bm.num_free_pages == 24 - 14
    bm.free(a)
    # b still uses every shared page: none is free or evictable, none is handed out again.
    assert bm.num_used_pages == 14
    assert bm.num_free_pages == 10
    assert not shared & set(bm._free)
    assert not bm.can_grow(b, 13)  # 2 more rows = 14 pages > 10
    assert bm.can_grow(b, 12)  # 1 more row = 7 pages
    bm.grow(b, 12)
    assert not shared & set(bm.page_table(b)[2].tolist())
    check_consistent(bm)
    bm.free(b)
    assert bm.num_used_pages == 0
    assert bm.num_free_pages == 24


def test_three_users_of_one_row(make_bm):
    bm = make_bm(8, block_size=2)
    seqs = [make_seq([5, 6, 7], rid=str(i)) for i in range(3)]
    compute(bm, seqs[0], 2)
    for seq in seqs[1:]:
        assert bm.allocate_cached_prefix(seq, ()) == 2
    row = bm.page_table(seqs[0])[0].tolist()
    assert int(bm._refs[row[0]]) == 3
    bm.free(seqs[2])
    bm.free(seqs[0])
    assert int(bm._refs[row[0]]) == 1
    assert bm.num_used_pages == 1
    bm.free(seqs[1])
    assert bm.num_used_pages == 0
    # Cached rows count as free, and still hit.
    assert bm.num_free_pages == 8
    d = make_seq([5, 6, 7], rid="d")
    assert bm.allocate_cached_prefix(d, ()) == 2
    assert bm.page_table(d)[0].tolist() == row
    bm.free(d)


def test_cached_rows_are_free_and_reused_by_later_sequences(make_bm):
    bm = make_bm(12, block_size=4)
    a = make_seq(range(13), TWO_HEADS, rid="a")
    compute(bm, a, 13)  # 4 rows x 2 pages, 3 committed
    table = bm.page_table(a).copy()
    bm.free(a)
    assert bm.num_free_pages == 12
    assert bm.num_used_pages == 0
    b = make_seq(range(13), TWO_HEADS, rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 12
    np.testing.assert_array_equal(bm.page_table(b), table[:3])
    assert bm.num_used_pages == 6
    assert bm.num_free_pages == 6
    bm.free(b)


def test_lru_eviction_of_unreferenced_rows(make_bm):
    bm = make_bm(8, block_size=2)
    old = make_seq([1, 2, 3, 4, 5], rid="old")
    new = make_seq([6, 7, 8, 9, 10], rid="new")
    compute(bm, old, 5)  # 3 rows, 2 committed
    compute(bm, new, 5)
    bm.free(old)  # freed first: least recently used
    bm.free(new)
    assert bm.num_free_pages == 8
    assert len(bm._free) == 4  # the 4 committed rows stay cached

    # Needs 5 pages: the 4 free ones, then one evicted row: the old sequence's LAST block
    # (rows of a sequence are freed tail first, so its first block survives longer).
    filler = make_seq(range(100, 110), rid="filler")
    bm.grow(filler, 10)
    assert bm.num_free_pages == 3
    probe_old = make_seq([1, 2, 3, 4, 5], rid="probe_old")
    assert bm.allocate_cached_prefix(probe_old, ()) == 2
    probe_new = make_seq([6, 7, 8, 9, 10], rid="probe_new")
    assert bm.allocate_cached_prefix(probe_new, ()) == 4  # untouched
    bm.free(probe_new)
    bm.free(probe_old)  # its row is now the most recently freed

    # Two more pages: the LRU rows now are new's (freed before probe_old's row).
    more = make_seq(range(200, 204), rid="more")
    bm.grow(more, 4)
    assert bm.num_free_pages == 1
    x = make_seq([1, 2, 3, 4, 5], rid="x")
    assert bm.allocate_cached_prefix(x, ()) == 2
    y = make_seq([6, 7, 8, 9, 10], rid="y")
    assert bm.allocate_cached_prefix(y, ()) == 0
    for seq in (filler, more, x, y):
        bm.free(seq)


def test_referenced_cached_rows_are_never_evicted(make_bm):
    bm = make_bm(6, block_size=2)
    a = make_seq([1, 2, 3, 4, 5], rid="a")
    compute(bm, a, 5)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 5], rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 4
    shared = set(bm.page_table(b).ravel().tolist())
    assert bm.num_free_pages == 4
    c = make_seq(range(50, 58), rid="c")
    assert bm.can_grow(c, 8) and not bm.can_grow(c, 9)
    bm.grow(c, 8)  # takes every other page, evicts nothing b uses
    assert not shared & set(bm.page_table(c).ravel().tolist())
    with pytest.raises(RuntimeError):
        bm.grow(b, 5)
    bm.free(c)
    bm.free(b)


def test_duplicate_blocks_computed_twice(make_bm):
    """Two sequences compute the same prefix independently: one copy is cached, no page leaks."""
    bm = make_bm(16, block_size=2)
    a = make_seq([1, 2, 3, 4, 5], rid="a")
    b = make_seq([1, 2, 3, 4, 5], rid="b")
    bm.grow(a, 5)
    bm.grow(b, 5)
    for seq in (a, b):
        seq.num_computed_tokens = 5
        bm.commit_computed(seq, ())
    assert len(bm._cached) == 2
    bm.free(a)
    bm.free(b)
    check_consistent(bm)
    assert bm.num_free_pages == 16
    c = make_seq([1, 2, 3, 4, 5], rid="c")
    assert bm.allocate_cached_prefix(c, ()) == 4
    bm.free(c)


def test_output_tokens_are_cached_too(make_bm):
    bm = make_bm(16, block_size=2)
    a = make_seq([1, 2, 3], rid="a")
    a.output_token_ids = [4, 5, 6]
    compute(bm, a, 5)  # the last output token is not computed yet
    assert len(bm._seqs[a.seq_id].block_hashes) == 2
    b = make_seq([1, 2, 3, 4, 5, 6, 7], rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 4
    bm.free(a)
    bm.free(b)


def test_allocate_cached_prefix_only_on_an_empty_table(make_bm):
    bm = make_bm(16, block_size=2)
    a = make_seq([1, 2, 3, 4, 5], rid="a")
    compute(bm, a, 5)
    b = make_seq([1, 2, 3, 4, 5], rid="b")
    bm.grow(b, 1)
    assert bm.allocate_cached_prefix(b, ()) == 0
    assert bm.pages_held(b) == 1
    bm.free(a)
    bm.free(b)


def test_reset_prefix_cache(make_bm):
    bm = make_bm(16, block_size=2)
    a = make_seq(range(9), TWO_HEADS, rid="a")
    compute(bm, a, 9)
    bm.free(a)
    assert bm.num_free_pages == 16
    assert len(bm._free) < 16
    bm.reset_prefix_cache()
    assert len(bm._free) == 16
    assert bm.num_free_pages == 16
    b = make_seq(range(9), TWO_HEADS, rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 0
    bm.free(b)
    bm.reset_prefix_cache()  # empty: a no-op


def test_prefix_caching_disabled(make_bm):
    bm = make_bm(16, block_size=2, enable_prefix_caching=False)
    a = make_seq(range(9), rid="a")
    compute(bm, a, 9)
    b = make_seq(range(9), rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 0
    bm.free(a)
    assert len(bm._free) == 16  # nothing kept cached
    bm.free(b)
    assert bm.prefix_queries == 0


def test_prefix_counters(make_bm):
    bm = make_bm(32, block_size=2)
    a = make_seq(range(9), rid="a")
    compute(bm, a, 9)
    b = make_seq([0, 1, 2, 3, 99, 5, 6, 7, 8], rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 4
    assert bm.prefix_queries == 3  # two hits, then the miss that ends the chain
    assert bm.prefix_hits == 2
    bm.free(a)
    bm.free(b)


def test_runs_without_torch_in_a_fresh_interpreter():
    script = textwrap.dedent(
        """
        import sys
        from depthserve.depth import DepthParams, DepthPlan
        from depthserve.engine.block_manager import BlockManager
        from depthserve.cache import CacheLayout, SlotKind, SlotSpec
        from depthserve.engine.sequence import Sequence
        from depthserve.sampling_params import SamplingParams
        layout = CacheLayout((SlotSpec("a", SlotKind.DENSE, 2), SlotSpec("b", SlotKind.HEAD_SUBSET, 1)))
        bm = BlockManager(64, 4)
        seqs = [Sequence(str(i), 0, list(range(13)), SamplingParams(), DepthPlan(depth=DepthParams(), layout=layout), 4) for i in range(3)]
        for seq in seqs:
            bm.allocate_cached_prefix(seq, ())
            bm.grow(seq, 13)
            seq.num_computed_tokens = 13
            bm.commit_computed(seq, ())
            bm.used_pages_by_kind()
        for seq in seqs:
            bm.free(seq)
        bm.reset_prefix_cache()
        assert bm.num_free_pages == 64
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# ---- split-dependent blocks (CacheLayout.prefix_chunk, Dory's last_loop cache) --------------------
CHUNKED = CacheLayout((SlotSpec("kv", SlotKind.DENSE, 1),), prefix_chunk=8)


def run_forwards(bm: BlockManager, seq: Sequence, sizes: list[int]) -> None:
    """The engine's steps over `seq`, one forward of each size in turn."""
    for size in sizes:
        compute(bm, seq, seq.num_computed_tokens + size)


def test_split_dependent_layout_registers_whole_prompt_chunks_only(make_bm):
    """Prompt of 21 tokens in chunks of 8 (8, 8, 5) then decodes: only the two whole chunks' blocks
    enter the cache, not the partial chunk's nor the decoded ones, even once they fill a chunk."""
    bm = make_bm(64, block_size=4)
    a = make_seq(range(21), layout=CHUNKED, rid="a")
    a.output_token_ids = list(range(100, 112))
    run_forwards(bm, a, [8, 8, 5] + [1] * 11)
    assert len(bm._seqs[a.seq_id].block_hashes) == 4  # tokens 0..15
    b = make_seq([*range(21), *range(100, 112), 7], layout=CHUNKED, rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 16
    bm.free(a)
    bm.free(b)


def test_split_dependent_hits_are_whole_chunks(make_bm):
    """A hit that would end inside a chunk is cut back to the chunk boundary (its rows stay cached)."""
    bm = make_bm(64, block_size=4)
    a = make_seq(range(24), layout=CHUNKED, rid="a")
    run_forwards(bm, a, [8, 8, 8])
    b = make_seq([*range(20), 99, 98], layout=CHUNKED, rid="b")  # shares 5 blocks: 20 tokens
    assert bm.allocate_cached_prefix(b, ()) == 16
    assert bm.pages_held(b) == 4
    c = make_seq([*range(12), 99], layout=CHUNKED, rid="c")  # shares 3 blocks: one chunk
    assert bm.allocate_cached_prefix(c, ()) == 8
    bm.free(a)
    bm.free(b)
    bm.free(c)
    check_consistent(bm)
    assert len(bm._evictable) == 6  # a's six chunk blocks, cached and unreferenced


def test_split_dependent_hit_then_chunks_feeds_the_cache(make_bm):
    """After a hit of one chunk, the next whole chunk computed by the hit sequence is registered."""
    bm = make_bm(64, block_size=4)
    a = make_seq(range(10), layout=CHUNKED, rid="a")
    run_forwards(bm, a, [8, 2])
    b = make_seq([*range(8), *range(50, 60)], layout=CHUNKED, rid="b")
    b.num_computed_tokens = bm.allocate_cached_prefix(b, ())
    assert b.num_computed_tokens == 8
    run_forwards(bm, b, [8, 2])
    c = make_seq([*range(8), *range(50, 58), 1], layout=CHUNKED, rid="c")
    assert bm.allocate_cached_prefix(c, ()) == 16
    for seq in (a, b, c):
        bm.free(seq)


def test_split_dependent_layout_takes_no_hit_without_chunked_prefill(make_bm):
    bm = make_bm(64, block_size=4)
    a = make_seq(range(8), layout=CHUNKED, rid="a")
    run_forwards(bm, a, [8])
    b = make_seq(range(20), layout=CHUNKED, rid="b")
    assert bm.allocate_cached_prefix(b, (), chunked_prefill=False) == 0
    assert bm.allocate_cached_prefix(b, (), chunked_prefill=True) == 8
    bm.free(a)
    bm.free(b)


def test_prefix_chunk_must_be_positive():
    with pytest.raises(ValueError, match="prefix_chunk"):
        CacheLayout((SlotSpec("kv", SlotKind.DENSE, 1),), prefix_chunk=0)


# ---- prompt-keyed blocks (CacheLayout.prompt_keyed, HRM-Text's bidirectional prompt) ----------------
PROMPT_KEYED = CacheLayout((SlotSpec("kv", SlotKind.DENSE, 1),), prompt_keyed=True)


def test_prompt_keyed_blocks_are_shared_only_with_the_same_prompt(make_bm):
    """A 14-token prompt computed, then 6 tokens decoded: a request with the same prompt takes its
    blocks, decoded ones included (a resumed sequence's case); requests whose prompts share every
    one of those blocks' tokens but not the whole prompt take none."""
    bm = make_bm(64, block_size=4)
    a = make_seq(range(14), layout=PROMPT_KEYED, rid="a")
    a.output_token_ids = list(range(100, 106))
    run_forwards(bm, a, [14] + [1] * 5)
    assert len(bm._seqs[a.seq_id].block_hashes) == 4  # tokens 0..15: 14 prompt, 2 decoded
    same = make_seq(range(14), layout=PROMPT_KEYED, rid="same")
    assert bm.allocate_cached_prefix(same, ()) == 12  # one token is always left to compute
    resumed = make_seq(range(14), layout=PROMPT_KEYED, rid="resumed")
    resumed.output_token_ids = list(range(100, 106))
    assert bm.allocate_cached_prefix(resumed, ()) == 16
    other_cycles = make_seq(range(14), layout=PROMPT_KEYED, rid="cycles")
    assert bm.allocate_cached_prefix(other_cycles, (("h_cycles", 3),)) == 0
    others = [make_seq(prompt, layout=PROMPT_KEYED, rid=str(i))
              for i, prompt in enumerate(([*range(13), 99], [*range(14), 5], [*range(14), *range(100, 106)]))]
    assert [bm.allocate_cached_prefix(seq, ()) for seq in others] == [0, 0, 0]
    causal = make_seq(range(14), layout=ONE, rid="causal")  # another layout's chain
    assert bm.allocate_cached_prefix(causal, ()) == 0
    for seq in (a, same, resumed, other_cycles, causal, *others):
        bm.free(seq)
    check_consistent(bm)


# ---- sliding windows (SlotSpec.window) --------------------------------------------------------------
# A full slot of 2 heads and a windowed slot of 1 head (window 5): rows of 3 pages.
WINDOWED = CacheLayout((SlotSpec("full", SlotKind.DENSE, 2), SlotSpec("sliding", SlotKind.DENSE, 1, window=5)))


def windowed_pages_held(bm: BlockManager, seq: Sequence) -> int:
    entry = bm._seqs[seq.seq_id]
    return (entry.num_rows - entry.released_rows) * len(entry.layout.windowed_columns)


def test_layout_knows_its_windowed_columns():
    assert WINDOWED.windowed_columns == (2,) and WINDOWED.max_window == 5
    assert ONE.windowed_columns == () and ONE.max_window is None
    assert WINDOWED.pages_by_kind(windowed=False) == {SlotKind.DENSE: 2}
    with pytest.raises(ValueError, match="window"):
        SlotSpec("w", SlotKind.DENSE, 1, window=0)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_windowed_pages_behind_the_window_go_back_during_decode(make_bm, prefix_caching):
    """Decoding 60 tokens one per step: the windowed slot holds at most ceil((window + block) / block) + 1
    blocks, the full slot every block; the pages given back are free for other sequences and the
    accounting stays exact. With prefix caching on, the computed rows enter the cache and keep their pages."""
    bm = make_bm(128, block_size=4, enable_prefix_caching=prefix_caching)
    a = make_seq(range(6), layout=WINDOWED, max_tokens=64, rid="a")
    a.output_token_ids = list(range(100, 160))
    compute(bm, a, 6)
    bound = -(-(5 + 4) // 4) + 1
    most = 0
    for n in range(7, 67):
        compute(bm, a, n)
        most = max(most, windowed_pages_held(bm, a))
        assert bm.pages_held(a) == bm.num_used_pages
        check_consistent(bm)
    rows = bm._seqs[a.seq_id].num_rows
    if prefix_caching:
        assert most == rows  # every row is in the cache chain: nothing given back
    else:
        assert most <= bound and bm.pages_held(a) == 2 * rows + windowed_pages_held(bm, a)
        assert bm.num_free_pages == 128 - bm.pages_held(a)
        assert bm.used_pages_by_kind() == {SlotKind.DENSE: bm.pages_held(a)}
    bm.free(a)


def test_released_rows_stay_out_of_the_prefix_cache(make_bm):
    """A row whose windowed pages went back is never registered, so no hit reads a page another
    sequence may hold now."""
    bm = make_bm(128, block_size=4)
    chunked = CacheLayout(WINDOWED.slots, prefix_chunk=8)
    a = make_seq(range(10), layout=chunked, rid="a")  # one whole chunk (two blocks), a partial one
    a.output_token_ids = list(range(100, 130))
    run_forwards(bm, a, [8, 2] + [1] * 30)
    entry = bm._seqs[a.seq_id]
    assert len(entry.block_hashes) == 2 and entry.released_from == 2 and entry.released_to > 2
    b = make_seq([*range(10), *range(100, 130), 1], layout=chunked, rid="b")
    assert bm.allocate_cached_prefix(b, ()) == 8
    bm.free(a)
    bm.free(b)


# A windowed routed slot of the positions at level >= 2 (Dory's pass 2 under a range of loops) beside
# a full dense slot: its entries behind the window are counted from the sequence's recorded levels.
LEVEL_ROUTED = CacheLayout((SlotSpec("pass1", SlotKind.DENSE, 1),),
                           (SlotSpec("pass2", SlotKind.ROUTED, 2, window=5, from_level=2),))


def test_a_routed_slot_may_have_a_window_only_with_its_level():
    with pytest.raises(ValueError, match="from_level"):
        SlotSpec("r", SlotKind.ROUTED, 1, window=4)
    with pytest.raises(ValueError, match="routed"):
        SlotSpec("d", SlotKind.DENSE, 1, from_level=2)


def test_windowed_routed_pages_behind_the_window_go_back(make_bm):
    """Decoding at levels 1/2 in turn: the routed slot's leading rows whose entries all sit before the
    next query's window (position p >= next - window + 1 is visible) give their pages back before the
    step, exactly as many as the levels say; the accounting stays exact and `free` returns the rest."""
    bm = make_bm(256, block_size=4, enable_prefix_caching=False)
    a = make_seq(range(6), layout=LEVEL_ROUTED, max_tokens=64, rid="a")
    a.output_token_ids = list(range(100, 160))
    levels = [2, 2, 1, 2, 2, 2] + [1 + (i % 3 != 0) for i in range(60)]
    done = 0
    for n in [6] + list(range(7, 67)):
        bm.grow(a, n)
        entry = bm._seqs[a.seq_id].routed["pass2"]
        behind = sum(level >= 2 for level in levels[: max(done - 5 + 1, 0)])
        assert entry.released == behind // 4
        a.levels[done:n] = levels[done:n]
        bm.commit_routed(a, "pass2", sum(level >= 2 for level in levels[done:n]))
        a.num_computed_tokens = done = n
        assert bm.pages_held(a) == bm.num_used_pages == 256 - bm.num_free_pages
        check_consistent(bm)
    entry = bm._seqs[a.seq_id].routed["pass2"]
    assert entry.length == sum(level >= 2 for level in levels) and entry.released >= 9
    assert entry.pages_held() <= (-(-(5 + 4) // 4) + 1) * 2  # what the window can see, as for a dense slot
    assert bm.used_pages_by_kind()[SlotKind.ROUTED] == entry.pages_held()
    bm.free(a)
    assert bm.num_free_pages == 256
