"""Decode steps at static shapes through the compiled forward (depthserve/engine/static_decode.py):
equal to the eager engine (greedy tokens identical, logprobs within 1e-4, the same depth reports)
on mixed batches with mixed depth, chunked prefill and preemption, for every architecture with a
static decode spec; compiled with fullgraph=True once at start-up and never again while serving;
padding rows writing nothing to the cache; and the enforce_eager switch. The depth architectures'
cases run in tests/test_static_decode_loops.py and tests/test_static_decode_routers.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch

from depthserve import SamplingParams
from depthserve.engine.page_tables import RowTable
from depthserve.engine.static_decode import DecodeRow, decode_buckets
from depthserve.lab.make_tiny import make_tiny
from tests.depth_helpers import assert_same_generations, depth_params, stream_prompts, tiny_llm

LENGTHS = [3, 17, 9, 30, 5, 12, 41]
DORY_LOOPS = [{"loops": 1}, {"loops": 4}, None, {"loops": 3}, {"loops": 1}, {"loops": 2}, {"loops": 4}]
HRM_CYCLES = [{"h_cycles": 1, "l_cycles": 1}, {"h_cycles": 3, "l_cycles": 1}, None, {"h_cycles": 1, "l_cycles": 3},
              {"prefix_lm": 0}, {"h_cycles": 2, "l_cycles": 3}, {"h_cycles": 3, "l_cycles": 2, "prefix_lm": 0}]
# Architectures with a static decode step beyond Llama: make_tiny options, the depth of each request of
# the mixed batch (GQA SGT with an uneven head subset; ITT steps on and off; Dreamer with attention
# experts; SAOBP has no knobs) and a page budget that forces preemption.
DEPTH_CASES = {
    "sgt": (dict(num_kv_heads=2), [{"loops": 0}, {"loops": 2}, None, {"loops": {1: 0, 2: 3}}, {"loops": 3},
                                   {"loops": 1}, {"loops": {3: 2}}], 120),
    "put": ({}, [{"loops": 1}, {"loops": 3}, None, {"loops": 2}, {"loops": 1}, {"loops": 2}, {"loops": 3}], 150),
    "itt": (dict(num_kv_heads=2), [{"selection_ratios": [0.3, 0.7]}, {"selection_ratios": [1.0, 0.0]}, None,
                                   {"thinking_steps": 0}, {"selection_ratios": [0.7, 1.0]}, {"thinking_steps": 1},
                                   {"selection_ratios": [0.0, 0.5]}], 150),
    "saobp": (dict(num_kv_heads=2, variant="low", self_message=True), [None] * len(LENGTHS), 90),
    "dreamer": (dict(attn_experts=3, da_rope="reversed_half"),
                [{"depth": 1}, {"depth": 4}, None, {"depth": 2}, {"depth": 3}, {"depth": 1}, {"depth": 2}], 90),
    # Dory trained at 1 loop (so up to 4 per request: four levels to compile), sliding windows of 8
    # keys (shorter than most prompts), in both cache modes: in last_loop mode a row writes the
    # shared slot only at the passes it runs.
    "dory": (dict(loops=1, sliding_window=8), DORY_LOOPS, 260),
    "dory:last_loop": (dict(loops=1, cache_mode="last_loop", sliding_window=8), DORY_LOOPS, 100),
    # HRM-Text trained at 2 x 2 cycles (up to 8 of each: eight levels), bidirectional and causal
    # prompts; a level caps both stacks' cycles.
    "hrm_text": (dict(h_cycles=2, l_cycles=2), HRM_CYCLES, 520),
    # Inkling-2 trained at 1 pass of its looped band (up to 4: four levels); experts run on every row.
    "inkling2_loop_text": (dict(loops=1), DORY_LOOPS, 1200),
}


def case_arch(case: str) -> str:
    """The architecture of a DEPTH_CASES key ("arch" or "arch:variant")."""
    return case.split(":")[0]


@pytest.fixture(scope="module")
def path(tmp_path_factory, smollm_tokenizer):
    return make_tiny("llama", tmp_path_factory.mktemp("static") / "llama", seed=3, tokenizer=smollm_tokenizer)


@pytest.fixture(scope="module")
def compiled(path):
    return tiny_llm(path, max_model_len=128, max_num_seqs=8, enforce_eager=False)


def _prompts(vocab_size: int = 49152) -> list[list[int]]:
    return stream_prompts(LENGTHS, seed=1, stride=9, vocab_size=vocab_size)


def test_buckets_cover_every_batch_size():
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_buckets(200) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 200)
    assert decode_buckets(3) == (1, 2, 3) and decode_buckets(1) == (1,)


def assert_same_report(expected, got) -> None:
    """Equal depth reports; routing decisions (arrays) compared element by element."""
    if expected is None:
        assert got is None
        return
    assert dataclasses.replace(got, decisions=None) == dataclasses.replace(expected, decisions=None)
    for name, value in (expected.decisions or {}).items():
        np.testing.assert_array_equal(got.decisions[name], value, err_msg=name)


def compiled_equals_eager(path, pages: int, depths=None, device: str = "cpu", prompts=None):
    """Seven requests over a budget of pages that forces preemption, prompts prefilled in chunks:
    the compiled engine's tokens, logprobs and depth reports are the eager engine's, its decode
    steps ran at static shapes, every store into the pool was compiled in place (checked where the
    step is compiled afresh: a graph from Inductor's cache is not compiled again), and nothing
    compiled after start-up. Returns the compiled engine."""
    from torch._dynamo.utils import ReinplaceCounters, counters

    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2) for _ in LENGTHS]
    depth = None if depths is None else [depth_params(d) for d in depths]
    engines = {}
    ReinplaceCounters.clear()
    for enforce_eager in (True, False):
        engines[enforce_eager] = tiny_llm(path, pages=pages, max_model_len=64, max_num_seqs=8, device=device,
                                          max_num_batched_tokens=16, enforce_eager=enforce_eager)
    eager, llm = engines[True], engines[False]
    # Every store into the pool runs in place (engine/static_decode.py, "State read from the pool"):
    # one Inductor could not reinplace is compiled as a copy of the whole pool, twice a step.
    assert ReinplaceCounters.get_total_missed() == 0, dict(ReinplaceCounters._values)
    assert eager.engine.runner.static is None
    check_page_tables_each_step(llm.engine.runner.static)
    prompts = prompts or _prompts()
    expected = eager.generate(prompts, params, depth)
    graphs, warm_up_steps = counters["stats"]["unique_graphs"], llm.engine.runner.static.steps
    region_calls = count_region_calls(llm.engine.runner.static)
    got = llm.generate(prompts, params, depth)
    static_steps = llm.engine.runner.static.steps - warm_up_steps
    assert static_steps > 10, "decode steps were meant to run at static shapes"
    assert all(calls >= static_steps for calls in region_calls.values()), (region_calls, static_steps)
    assert llm.engine.scheduler.num_preemptions > 0, "the page budget was meant to force preemption"
    assert counters["stats"]["unique_graphs"] == graphs, "a decode step compiled after start-up"
    assert_same_generations(expected, got)
    for e, g in zip(expected, got):
        assert_same_report(e.depth, g.depth)
    assert llm.engine.block_manager.num_used_pages == 0
    return llm


def count_region_calls(static) -> dict[type, int]:
    """From now on, how many times each compiled region (StaticDecodeSpec.compiled_regions) of `static`
    runs: a model that names a region runs it in every static step, never its eager forward. Steps
    replayed as CUDA graphs run no Python: nothing is counted there."""
    if static.cuda_graphs:
        return {}
    calls = dict.fromkeys(static.regions, 0)
    for cls, compiled in list(static.regions.items()):
        def counted(*args, _cls=cls, _compiled=compiled):
            calls[_cls] += 1
            return _compiled(*args)

        static.regions[cls] = counted
    assert set(calls) == set(static.spec.compiled_regions)
    return calls


def check_page_tables_each_step(static) -> None:
    """After every step of `static`, its persistent page table (updated by what changed) holds each
    row's table as built afresh from the block manager, and the padding rows' first block is the
    scratch page."""
    run = static.run

    def checked(rows: list[DecodeRow]) -> torch.Tensor:
        out = run(rows)
        table = static.tables.table
        for i, row in enumerate(rows):
            fresh = row.table.blocks(0, row.table.num_blocks)
            np.testing.assert_array_equal(table[i, : row.table.num_blocks].cpu().numpy(), fresh, err_msg=f"row {i}")
        assert bool((table[len(rows): static.bucket(len(rows)), 0] == static.scratch_page).all())
        return out

    static.run = checked


@pytest.mark.slow
def test_compiled_decode_equals_eager_on_a_mixed_batch_with_preemption(path):
    compiled_equals_eager(path, pages=96)


def depth_case_equals_eager(case: str, tmp_path, tokenizer) -> None:
    """A DEPTH_CASES checkpoint: compiled_equals_eager with every request of the batch at its own depth."""
    options, depths, pages = DEPTH_CASES[case]
    path = make_tiny(case_arch(case), tmp_path / case, seed=11, tokenizer=tokenizer, **options)
    compiled_equals_eager(path, pages=pages, depths=depths)


# Batches shallower than the model's deepest setting (the DEPTH_CASES checkpoints).
SHALLOW = {
    "sgt": [{"loops": 0}, {"loops": 1}, {"loops": {1: 0, 2: 1}}, {"loops": 0}, {"loops": 1}, {"loops": 0}, {"loops": 1}],
    "itt": [{"thinking_steps": 0}, {"selection_ratios": [0.6, 0.0]}, {"thinking_steps": 1}, {"thinking_steps": 0},
            {"selection_ratios": [1.0, 0.0]}, {"thinking_steps": 0}, {"thinking_steps": 1}],
    "put": [{"loops": 1}, {"loops": 2}, {"loops": 1}, {"loops": 2}, {"loops": 1}, {"loops": 1}, {"loops": 2}],
    "dory:last_loop": [{"loops": 1}, {"loops": 3}, None, {"loops": 2}, {"loops": 1}, {"loops": 3}, {"loops": 2}],
}


def shallow_case_runs_capped(case: str, tmp_path, tokenizer) -> None:
    """Every request below the model's deepest setting: the compiled steps run capped at the batch's
    deepest level (iterations past it are not computed), with the eager engine's results."""
    options, _, pages = DEPTH_CASES[case]
    path = make_tiny(case_arch(case), tmp_path / case, seed=11, tokenizer=tokenizer, **options)
    static = compiled_equals_eager(path, pages=pages, depths=SHALLOW[case]).engine.runner.static
    assert static.level_steps and max(static.level_steps) < static.spec.levels[-1], (static.level_steps,
                                                                                     static.spec.levels)


def depth_case_tests(cases: list[str]) -> tuple[Callable[..., None], Callable[..., None]]:
    """The two tests of a depth file (mixed depths, shallow batches), over its DEPTH_CASES keys."""

    @pytest.mark.slow
    @pytest.mark.parametrize("case", cases)
    def test_compiled_depth_decode_equals_eager_on_a_mixed_depth_batch(case, tmp_path, smollm_tokenizer):
        depth_case_equals_eager(case, tmp_path, smollm_tokenizer)

    @pytest.mark.slow
    @pytest.mark.parametrize("case", [case for case in cases if case in SHALLOW])
    def test_a_shallow_batch_runs_capped_below_the_deepest_level_and_equals_eager(case, tmp_path, smollm_tokenizer):
        shallow_case_runs_capped(case, tmp_path, smollm_tokenizer)

    return test_compiled_depth_decode_equals_eager_on_a_mixed_depth_batch, \
        test_a_shallow_batch_runs_capped_below_the_deepest_level_and_equals_eager


def test_every_depth_case_runs_in_one_of_the_depth_files():
    """The depth cases are split over two files (tests/test_static_decode_loops.py and
    _routers.py), so that the two test workers compile them side by side: none is left out."""
    from tests import test_static_decode_loops as loops
    from tests import test_static_decode_routers as routers

    assert sorted(loops.CASES + routers.CASES) == sorted(DEPTH_CASES)
    assert set(SHALLOW) <= set(loops.CASES + routers.CASES)


def test_padding_rows_write_nothing_and_leave_real_rows_alone(compiled):
    """Three rows padded to a bucket of four: the step writes exactly the three rows' cache slots,
    and each real row's hidden state is the one it gets alone (bucket 1)."""
    static, pool = compiled.engine.runner.static, compiled.engine.runner.pool
    assert static.bucket(3) == 4
    width = static.width
    tables = [np.arange(b * width, (b + 2) * width, dtype=np.int64).reshape(2, width) + 1 for b in range(0, 6, 2)]
    bs = static.block_size
    rows = [DecodeRow(token, position, RowTable.of_array(table), table[position // bs] * bs + position % bs,
                      np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64))
            for token, position, table in zip([5, 17, 99], [3, 9, 12], tables)]
    before = pool.k_pages.clone()
    batched = static.run(rows)
    changed = (pool.k_pages != before).any(-1).nonzero().tolist()  # (page, offset) pairs written
    written = sorted([int(p), position % bs] for position, table in zip([3, 9, 12], tables)
                     for p in table[position // bs])
    assert sorted(changed) == written
    for i, row in enumerate(rows):
        torch.testing.assert_close(static.run([row])[0], batched[i], atol=1e-5, rtol=0)


def test_enforce_eager_and_the_default_on_cpu(path):
    assert tiny_llm(path, max_model_len=64).engine.runner.static is None  # CPU default: eager
    assert tiny_llm(path, max_model_len=64, enforce_eager=True).engine.runner.static is None


class _Sequences:
    """Page tables of simulated sequences for DecodeTables: each grows by whole blocks, a preemption
    gives it a new key and new pages, and its last `volatile` blocks change every step (a routed
    slot's reservation)."""

    def __init__(self, width: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.width = width
        self.pages: dict[int, np.ndarray] = {}  # sequence -> [blocks, width]
        self.epoch: dict[int, int] = {}
        self.volatile: dict[int, int] = {}
        self.next_id = 0

    def admit(self, blocks: int, volatile: int = 0) -> int:
        seq = self.next_id
        self.next_id += 1
        self.pages[seq], self.epoch[seq], self.volatile[seq] = self._new(blocks), 0, volatile
        return seq

    def _new(self, blocks: int) -> np.ndarray:
        return self.rng.integers(0, 10_000, (blocks, self.width)).astype(np.int32)

    def grow(self, seq: int) -> None:
        self.pages[seq] = np.concatenate([self.pages[seq], self._new(1)])

    def preempt(self, seq: int) -> None:
        self.pages[seq], self.epoch[seq] = self._new(len(self.pages[seq])), self.epoch[seq] + 1

    def step_volatile(self) -> None:
        for seq, count in self.volatile.items():
            if count:
                self.pages[seq][-count:] = self._new(count)

    def row_table(self, seq: int) -> RowTable:
        pages = self.pages[seq]
        return RowTable((seq, self.epoch[seq]), len(pages), len(pages) - self.volatile[seq],
                        lambda start, stop: pages[start:stop].copy())


def test_incremental_page_tables_equal_fresh_ones():
    """Fifty steps of admissions, finishes (rows shift), preemptions (new keys and pages), new blocks,
    volatile blocks and bucket changes: after each, the table updated incrementally (on the host as on
    CPU, and staged then applied as on CUDA) holds every row's full table, and padding rows' first
    block is the scratch page; the steady steps send far less than the tables."""
    from depthserve.engine.page_tables import DecodeTables

    width, max_blocks, scratch, rows = 5, 12, 99_999, 8
    sequences = _Sequences(width, seed=0)
    host = DecodeTables(rows, max_blocks, width, scratch, torch.device("cpu"))
    staged = DecodeTables(rows, max_blocks, width, scratch, torch.device("cpu"))
    running = [sequences.admit(int(b), volatile=int(b % 2)) for b in (1, 3, 2, 5)]
    for step in range(50):
        rng = sequences.rng
        if rng.random() < 0.2 and len(running) < rows:
            running.insert(int(rng.integers(0, len(running) + 1)), sequences.admit(int(rng.integers(1, 6))))
        if rng.random() < 0.15 and len(running) > 1:
            running.pop(int(rng.integers(0, len(running))))  # finished: the rows after it shift
        if rng.random() < 0.1:
            sequences.preempt(running[int(rng.integers(0, len(running)))])
        for seq in running:
            if rng.random() < 0.3 and len(sequences.pages[seq]) < max_blocks:
                sequences.grow(seq)
        sequences.step_volatile()
        size = next(s for s in (1, 2, 4, 8) if s >= len(running))
        tables = [sequences.row_table(seq) for seq in running]
        host.apply_on_host(host.update(tables, size))
        update = staged.update(tables, size)
        words = np.zeros(staged.staging_words(), np.int64)
        used = staged.stage(update, words)
        staged.apply_on_device(update, torch.from_numpy(words[:used]))
        for table in (host.table, staged.table):
            for row, seq in enumerate(running):
                expected = sequences.pages[seq]
                np.testing.assert_array_equal(table[row, : len(expected)].numpy(), expected, err_msg=f"step {step}")
            assert (table[len(running):size, 0] == scratch).all(), f"step {step}: a padding row's first block"
    full_tables = 50 * rows * max_blocks * width * 8  # what rebuilding every row (int64) would have sent
    assert host.bytes_written < full_tables / 10 and staged.bytes_sent < full_tables / 5


def test_staged_table_updates_as_on_cuda_equal_the_eager_engine(compiled, path):
    """The CUDA way of a step, run on CPU: the per-row inputs and the page tables' update staged in
    the host buffer, copied in one copy to a separate buffer (the device's), and the update applied
    there by device ops. A mixed batch with finishes and admissions gives the eager engine's tokens
    and logprobs, and the table holds each row's fresh table after every step."""
    static = compiled.engine.runner.static
    saved = static._sizes, static._host, static._device
    static._sizes = static._sizes[:-1] + (static.tables.staging_words(),)
    static._host = torch.zeros(sum(static._sizes), dtype=torch.int64)
    static._device = torch.zeros_like(static._host)
    check_page_tables_each_step(static)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
                  for n in (12, 3, 9, 5, 14, 2, 7)]
        expected = tiny_llm(path, max_model_len=128, max_num_seqs=8).generate(_prompts(), params)
        steps, moved = static.steps, static.tables.bytes_moved
        assert_same_generations(expected, compiled.generate(_prompts(), params))
        assert static.steps > steps + 10 and static.tables.bytes_sent > 0
        assert static.tables.bytes_moved > moved, "finishes were meant to move rows"
    finally:
        static._sizes, static._host, static._device = saved
        del static.run  # the checking wrapper
