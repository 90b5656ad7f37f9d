"""Scheduler: continuous batching, chunked prefill, FCFS admission, preemption (torch-free).

The engine loop is simulated: after each `schedule()`, every scheduled item is "computed"
(num_computed_tokens = item.end, full blocks committed to the prefix cache) and, when the item
samples, a fake output token is appended; a sequence finishes after `max_tokens` outputs.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from depthserve.depth import DepthParams, DepthPlan
from depthserve.engine.block_manager import BlockManager
from depthserve.cache import CacheLayout, SlotKind, SlotSpec
from depthserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from depthserve.engine.sequence import Sequence, SequenceStatus
from depthserve.sampling_params import SamplingParams
from tests.test_block_manager import check_consistent

ONE = CacheLayout((SlotSpec("kv", SlotKind.DENSE, 1),))
TWO_HEADS = CacheLayout((SlotSpec("kv", SlotKind.DENSE, 2),))
MIXED = CacheLayout(
    (
        SlotSpec("layer0", SlotKind.DENSE, 2),
        SlotSpec("layer1", SlotKind.DENSE, 2),
        SlotSpec("layer2", SlotKind.DENSE, 2),
        SlotSpec("loop1", SlotKind.HEAD_SUBSET, 1),
    )
)


def make_seq(rid, prompt, max_tokens, layout=ONE, depth=None, sampling=None):
    if isinstance(prompt, int):
        prompt = [hash((rid, i)) % 30000 for i in range(prompt)]
    plan = DepthPlan(depth=depth or DepthParams(), layout=layout)
    return Sequence(rid, 0, list(prompt), sampling or SamplingParams(), plan, max_tokens)


def fake_token(seq: Sequence, position: int) -> int:
    """The token the fake model samples at output position `position` (deterministic)."""
    return 50_000 + 1000 * (seq.seq_id % 50) + position


class Sim:
    """A scheduler and block manager driven like the engine drives them, with invariant checks."""

    def __init__(self, num_pages, block_size=4, *, budget=16, max_num_seqs=8, chunked=True,
                 watermark=0.0, prefix_caching=True, long_threshold=0, chunk_tokens=0, context_scale=0, max_long=1):
        self.bm = BlockManager(num_pages, block_size, prefix_caching)
        self.config = SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
            enable_chunked_prefill=chunked, watermark=watermark, long_prefill_token_threshold=long_threshold,
            long_prefill_chunk_tokens=chunk_tokens, long_prefill_context_scale=context_scale,
            max_long_partial_prefills=max_long,
        )
        self.sched = Scheduler(self.config, self.bm)
        self.seqs: list[Sequence] = []
        self.outputs: list[SchedulerOutput] = []
        self.sat_out: set[str] = set()  # the long prefills that gave way in the last step

    def add(self, *seqs: Sequence) -> None:
        for seq in seqs:
            assert self.bm.fits_ever(seq.layout, seq.num_prompt_tokens + seq.max_tokens), "bad test setup"
            self.seqs.append(seq)
            self.sched.add(seq)

    def step(self) -> SchedulerOutput:
        sched, bm = self.sched, self.bm
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        out = sched.schedule()
        self.outputs.append(out)
        self._check(out, running_before, waiting_before)
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.end
            bm.commit_computed(seq, seq.depth.cache_key())
            if item.samples:
                seq.output_token_ids.append(fake_token(seq, len(seq.output_token_ids)))
                if len(seq.output_token_ids) >= seq.max_tokens:
                    sched.finish(seq, "length")
        check_consistent(bm)
        return out

    def run(self, max_steps=5000, arrivals=None) -> int:
        """Step until every sequence finished; `arrivals` maps a step number to sequences to add."""
        arrivals = dict(arrivals or {})
        idle = 0
        for step in range(max_steps):
            for seq in arrivals.pop(step, ()):
                self.add(seq)
            if not self.sched.has_work() and not arrivals:
                return step
            out = self.step()
            idle = idle + 1 if out.empty and self.sched.has_work() else 0
            assert idle <= 2, f"deadlock at step {step}: waiting={[s.request_id for s in self.sched.waiting]}"
        raise AssertionError(f"not done after {max_steps} steps")

    def _check(self, out, running_before, waiting_before) -> None:
        sched, bm, config = self.sched, self.bm, self.config
        assert out.num_tokens <= config.max_num_batched_tokens
        assert out.num_tokens == sum(item.num_tokens for item in out.scheduled)
        assert len(out.scheduled) <= config.max_num_seqs
        assert len(sched.running) <= config.max_num_seqs
        seen = [item.seq for item in out.scheduled]
        assert len(set(map(id, seen))) == len(seen), "a sequence scheduled twice in one step"
        newly = [s for s in seen if s not in running_before]
        # Running sequences are served before waiting ones are admitted.
        assert seen == [s for s in seen if s in running_before] + newly
        # New sequences come from the head of the waiting queue, in order; one passed over is a long
        # prompt while the long prefills allowed are running.
        assert newly == [s for s in waiting_before if s in newly]
        passed_over = waiting_before[: waiting_before.index(newly[-1])] if newly else []
        assert all(config.is_long_prefill(s.num_tokens, s.num_tokens) for s in passed_over if s not in newly)
        long_items = [item for item in out.scheduled
                      if config.is_long_prefill(item.seq.num_tokens, item.seq.num_tokens - item.start)]
        assert len(long_items) <= config.max_long_partial_prefills
        if out.preempted:
            assert not newly, "admitted a sequence in a step that preempted"
        for item in out.scheduled:
            seq = item.seq
            assert item.num_tokens > 0
            assert item.start == seq.num_computed_tokens
            cap = config.prefill_chunk_cap(item.start)
            if item in long_items:
                assert cap is None or item.num_tokens <= cap, "a long prefill's chunk over its cost cap"
            assert item.end <= seq.num_tokens
            assert seq.status is SequenceStatus.RUNNING and seq in sched.running
            assert bm.pages_held(seq) >= bm.pages_for(seq.layout, item.end), "page table too short"
            if not config.enable_chunked_prefill:
                assert item.end == seq.num_tokens, "a prompt was split without chunked prefill"
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING and seq in sched.waiting
            assert seq.num_computed_tokens == 0
            assert not bm.has(seq)
        for seq in sched.waiting:
            assert seq.status is SequenceStatus.WAITING
            assert bm.pages_held(seq) == 0, f"waiting {seq.request_id} holds pages"
        assert set(map(id, sched.running)) == {id(s) for s in seen} | (
            {id(s) for s in running_before} - {id(s) for s in out.preempted}
        ), "a running sequence was neither scheduled nor preempted"
        # A running sequence is skipped only when the budget is spent, or when it is a long prefill that
        # gives way to a short prompt, never in two steps running.
        skipped = [s for s in sched.running if s not in seen]
        sat_out = {s.request_id for s in skipped if config.is_long_prefill(s.num_tokens, s.num_uncomputed_tokens)}
        if len(skipped) > len(sat_out):
            assert out.num_tokens == config.max_num_batched_tokens
        assert not sat_out & self.sat_out, "a long prefill sat out two steps running"
        assert not sat_out or any(s not in running_before for s in seen) or out.num_tokens == config.max_num_batched_tokens
        self.sat_out = sat_out

    def assert_all_done(self) -> None:
        for seq in self.seqs:
            assert seq.finished
            if seq.finish_reason == "length":
                assert seq.output_token_ids == [fake_token(seq, i) for i in range(seq.max_tokens)]
        assert not self.sched.has_work()
        assert_pages_free(self.bm)

    def trace(self, out: SchedulerOutput) -> list[tuple[str, int, int]]:
        return [(item.seq.request_id, item.start, item.num_tokens) for item in out.scheduled]


def assert_pages_free(bm: BlockManager) -> None:
    check_consistent(bm)
    assert not bm._seqs
    assert bm.num_free_pages == bm.num_pages
    assert bm.num_used_pages == 0


@pytest.fixture
def sim(request):
    """Sims a test creates; at teardown each must be finished with every page free."""
    created: list[Sim] = []
    failed_before = request.session.testsfailed

    def factory(*args, **kwargs) -> Sim:
        created.append(Sim(*args, **kwargs))
        return created[-1]

    yield factory
    if request.session.testsfailed > failed_before:
        return
    for s in created:
        assert not s.sched.has_work(), "the test left work in the scheduler"
        assert_pages_free(s.bm)


@pytest.fixture(scope="module", autouse=True)
def _torch_free():
    preloaded = "torch" in sys.modules  # another test module of this session imported it
    yield
    if not preloaded:
        assert "torch" not in sys.modules, "the scheduler tests imported torch"


# ---- small pieces ------------------------------------------------------------------------------


def test_scheduled_seq_and_output_helpers():
    seq = make_seq("a", 5, 3)
    item = ScheduledSeq(seq, 2, 3)
    assert item.end == 5 and item.samples
    assert not ScheduledSeq(seq, 0, 4).samples
    seq.output_token_ids = [7, 8]  # 7 tokens known: only a step reaching the last samples
    assert not ScheduledSeq(seq, 0, 5).samples
    assert not ScheduledSeq(seq, 3, 3).samples
    assert ScheduledSeq(seq, 5, 2).samples
    assert ScheduledSeq(seq, 6, 1).samples
    out = SchedulerOutput()
    assert out.empty and out.num_tokens == 0
    out.scheduled += [item, ScheduledSeq(make_seq("b", 2, 1), 0, 2)]
    assert not out.empty and out.num_tokens == 5


# ---- budget, chunked prefill, ordering -------------------------------------------------------


def test_long_prompt_is_split_into_chunks(sim):
    s = sim(64, budget=8)
    a = make_seq("a", 30, 3)
    s.add(a)
    traces = [s.trace(s.step()) for _ in range(6)]
    assert traces == [
        [("a", 0, 8)], [("a", 8, 8)], [("a", 16, 8)], [("a", 24, 6)],  # the last chunk samples
        [("a", 30, 1)], [("a", 31, 1)],
    ]
    assert a.finished and a.output_token_ids == [fake_token(a, i) for i in range(3)]
    s.assert_all_done()


def test_running_sequences_are_served_before_waiting_ones(sim):
    s = sim(64, budget=8)
    a = make_seq("a", 20, 2)
    s.add(a)
    assert s.trace(s.step()) == [("a", 0, 8)]
    b = make_seq("b", 5, 3)
    s.add(b)
    assert s.trace(s.step()) == [("a", 8, 8)]  # the budget went to the running prefill
    assert s.sched.waiting[0] is b
    assert s.trace(s.step()) == [("a", 16, 4), ("b", 0, 4)]  # b gets what is left
    assert s.trace(s.step()) == [("a", 20, 1), ("b", 4, 1)]  # a decodes, b's last chunk
    assert a.finished
    assert s.trace(s.step()) == [("b", 5, 1)]
    assert s.trace(s.step()) == [("b", 6, 1)]
    s.assert_all_done()


def test_decodes_keep_running_while_a_prompt_is_chunked(sim):
    s = sim(128, budget=4)
    decoders = [make_seq(f"d{i}", 1, 6) for i in range(3)]
    s.add(*decoders)
    big = make_seq("big", 10, 1)
    s.add(big)
    assert s.trace(s.step()) == [("d0", 0, 1), ("d1", 0, 1), ("d2", 0, 1), ("big", 0, 1)]
    for step in range(1, 6):
        trace = s.trace(s.step())
        assert trace[:3] == [(f"d{i}", step, 1) for i in range(3)]  # one token each, every step
        assert trace[3] == ("big", step, 1)
    s.run()
    s.assert_all_done()


def test_budget_respected_with_many_sequences(sim):
    s = sim(512, block_size=4, budget=7, max_num_seqs=5)
    rng = random.Random(0)
    s.add(*[make_seq(f"r{i}", rng.randint(1, 25), rng.randint(1, 6)) for i in range(15)])
    s.run()
    assert any(out.num_tokens == 7 for out in s.outputs)
    s.assert_all_done()


def test_max_num_seqs(sim):
    s = sim(256, budget=64, max_num_seqs=2)
    seqs = [make_seq(f"r{i}", 3, 2 + i) for i in range(5)]
    s.add(*seqs)
    first = s.step()
    assert [item.seq for item in first.scheduled] == seqs[:2]
    assert len(s.sched.running) == 2 and list(s.sched.waiting) == seqs[2:]
    s.run()
    first_step = {}
    finished_step = {}
    for step, out in enumerate(s.outputs):
        assert len(out.scheduled) <= 2
        for item in out.scheduled:
            first_step.setdefault(item.seq.request_id, step)
            finished_step[item.seq.request_id] = step
    # r2 starts only once r0 (the shorter of the first two) is done, and so on, in order.
    assert first_step["r2"] == finished_step["r0"] + 1
    assert first_step["r3"] == finished_step["r1"] + 1
    assert sorted(first_step, key=first_step.get) == [f"r{i}" for i in range(5)]
    s.assert_all_done()


def test_fcfs_big_request_is_not_overtaken_by_small_ones(sim):
    s = sim(12, block_size=4, budget=64)
    running = make_seq("running", 20, 12)  # 5 pages, growing to 8
    s.add(running)
    s.step()
    big = make_seq("big", 36, 2)  # 9 pages: cannot be admitted while `running` holds 5+
    small = [make_seq(f"small{i}", 3, 2) for i in range(3)]  # 1 page each: would fit
    s.add(big, *small)
    blocked_steps = 0
    while big.status is not SequenceStatus.RUNNING:
        out = s.step()
        scheduled = [item.seq for item in out.scheduled]
        if big in scheduled:  # admitted at last, the small ones may follow it in the same step
            assert all(scheduled.index(sm) > scheduled.index(big) for sm in small if sm in scheduled)
            break
        blocked_steps += 1
        assert scheduled == [running], "a small request overtook the big one"
        assert list(s.sched.waiting) == [big, *small]
    assert blocked_steps >= 10 and running.finished
    s.run()
    s.assert_all_done()


def test_fcfs_by_budget_without_chunked_prefill(sim):
    s = sim(256, block_size=4, budget=16, chunked=False)
    decoder = make_seq("decoder", 4, 5)
    s.add(decoder)
    s.step()
    big = make_seq("big", 16, 1)  # needs the whole budget in one step
    small = make_seq("small", 2, 1)
    s.add(big, small)
    for _ in range(4):  # the decoder takes 1 token: 15 left, not enough for big
        assert s.trace(s.step()) == [("decoder", decoder.num_computed_tokens - 1, 1)]
        assert list(s.sched.waiting) == [big, small]
    assert decoder.finished
    assert s.trace(s.step()) == [("big", 0, 16)]
    assert s.trace(s.step()) == [("small", 0, 2)]
    s.assert_all_done()


def test_chunked_prefill_disabled_prompt_fits_in_one_step(sim):
    s = sim(256, block_size=4, budget=10, chunked=False)
    a, b, c = make_seq("a", 6, 2), make_seq("b", 3, 2), make_seq("c", 10, 1)
    s.add(a, b, c)
    assert s.trace(s.step()) == [("a", 0, 6), ("b", 0, 3)]  # c (10) does not fit in 1 token
    assert s.trace(s.step()) == [("a", 6, 1), ("b", 3, 1)]  # 8 left: still not enough for c
    assert a.finished and b.finished
    assert s.trace(s.step()) == [("c", 0, 10)]
    s.assert_all_done()


def test_chunked_prefill_enabled_uses_the_leftover_budget(sim):
    s = sim(256, block_size=4, budget=10, chunked=True)
    a, b, c = make_seq("a", 6, 2), make_seq("b", 3, 2), make_seq("c", 10, 1)
    s.add(a, b, c)
    assert s.trace(s.step()) == [("a", 0, 6), ("b", 0, 3), ("c", 0, 1)]
    assert s.trace(s.step()) == [("a", 6, 1), ("b", 3, 1), ("c", 1, 8)]
    assert s.trace(s.step()) == [("c", 9, 1)]
    s.assert_all_done()


def test_watermark_keeps_headroom_but_never_blocks_a_lone_sequence(sim):
    s = sim(8, block_size=4, budget=64, watermark=0.25)  # keeps 2 pages free at admission
    a = make_seq("a", 8, 2)  # 2 pages
    s.add(a)
    s.step()
    b = make_seq("b", 20, 1)  # 5 pages: fits in the 6 free, but not with 2 held back
    s.add(b)
    out = s.step()
    assert s.trace(out) == [("a", 8, 1)]
    assert a.finished and s.sched.waiting[0] is b
    c = make_seq("c", 31, 1)  # 8 pages: the whole pool, more than the watermark allows
    s.add(c)
    assert s.trace(s.step()) == [("b", 0, 20)]
    assert s.trace(s.step()) == [("c", 0, 31)]  # alone: admitted despite the watermark
    s.assert_all_done()


def test_admission_needs_room_for_the_whole_prompt_not_just_the_chunk(sim):
    s = sim(8, block_size=4, budget=8)
    r = make_seq("r", 13, 3)  # 4 pages once decoding
    s.add(r)
    s.step()
    s.step()
    p = make_seq("p", 24, 1)  # first chunk (8 tokens, 2 pages) would fit; the prompt (6) does not
    s.add(p)
    while not r.finished:
        out = s.step()
        assert s.trace(out) == [("r", r.num_computed_tokens - 1, 1)]
        assert s.sched.waiting[0] is p and not s.bm.has(p)
    assert s.trace(s.step()) == [("p", 0, 8)]
    s.run()
    s.assert_all_done()


def test_no_admission_in_a_step_that_preempted(sim):
    s = sim(7, block_size=2, budget=64)
    a = make_seq("a", 2, 8)
    w = make_seq("w", [1, 2, 3, 4, 5], 4)
    v = make_seq("v", [1, 2, 3, 4, 5], 4)  # computed alongside w: its rows are private copies
    s.add(a, w, v)
    assert s.trace(s.step()) == [("a", 0, 2), ("w", 0, 5), ("v", 0, 5)]
    out = s.step()  # a needs a page: v is preempted; v could now fit again on w's cached rows...
    assert out.preempted == [v]
    assert s.trace(out) == [("a", 2, 1), ("w", 5, 1)]  # ...but is not re-admitted in this step
    assert list(s.sched.waiting) == [v]
    out = s.step()
    assert s.trace(out) == [("a", 3, 1), ("w", 6, 1), ("v", 4, 2)]  # w's two rows reused
    s.run()
    s.assert_all_done()


# ---- preemption ------------------------------------------------------------------------------


def test_newest_running_sequence_is_preempted(sim):
    s = sim(6, block_size=2, budget=64)
    a = make_seq("a", 4, 6)  # 10 tokens: 5 pages at most
    b = make_seq("b", 4, 6)
    s.add(a, b)
    for _ in range(3):
        out = s.step()
        assert [item.seq for item in out.scheduled] == [a, b] and not out.preempted
    assert s.bm.num_free_pages == 0
    assert b.num_tokens == 7 and b.num_computed_tokens == 6
    out = s.step()  # a needs a 4th page: b, the newest, is preempted
    assert out.preempted == [b]
    assert s.trace(out) == [("a", 6, 1)]
    assert b.status is SequenceStatus.WAITING
    assert list(s.sched.waiting) == [b] and s.sched.running == [a]
    assert b.num_computed_tokens == 0
    assert not s.bm.has(b) and s.bm.pages_held(b) == 0
    assert b.num_preemptions == 1 and s.sched.num_preemptions == 1
    assert b.output_token_ids == [fake_token(b, i) for i in range(3)]  # nothing is lost
    s.run()
    s.assert_all_done()
    # b was recomputed from its tokens (prompt and outputs) when it came back.
    back = next(item for o in s.outputs[4:] for item in o.scheduled if item.seq is b)
    assert back.start == 0 or back.start % 2 == 0  # from zero, or from cached full blocks
    assert b.num_cached_tokens == 0


def test_a_sequence_that_cannot_grow_preempts_itself_when_newest(sim):
    s = sim(5, block_size=2, budget=64, prefix_caching=False)
    a = make_seq("a", 3, 2)  # 2 pages, never grows past 2 (4 tokens)
    b = make_seq("b", 4, 3)  # 2 pages, then needs a 3rd at 5 tokens
    c = make_seq("c", 1, 1)  # 1 page
    s.add(a, b, c)
    out = s.step()
    assert s.trace(out) == [("a", 0, 3), ("b", 0, 4), ("c", 0, 1)]
    assert c.finished and s.bm.num_free_pages == 1
    out = s.step()
    assert s.trace(out) == [("a", 3, 1), ("b", 4, 1)]  # b takes the last free page
    assert a.finished
    out = s.step()
    assert s.trace(out) == [("b", 5, 1)]
    s.run()
    s.assert_all_done()

    s = sim(4, block_size=2, budget=64, prefix_caching=False)
    a = make_seq("a", 3, 2)  # 2 pages
    b = make_seq("b", 4, 4)  # 2 pages, then a 3rd
    s.add(a, b)
    s.step()
    out = s.step()  # a fits in its 2 pages; b needs a 3rd: it is the newest, so it yields
    assert out.preempted == [b]
    assert s.trace(out) == [("a", 3, 1)]
    assert a.finished and list(s.sched.waiting) == [b]
    s.run()
    s.assert_all_done()
    assert b.num_preemptions == 1


def test_several_victims_newest_first_and_queue_order_kept(sim):
    s = sim(10, block_size=2, budget=6, prefix_caching=False)
    a = make_seq("a", 6, 4, layout=TWO_HEADS)  # rows of 2 pages
    s.add(a)
    assert s.trace(s.step()) == [("a", 0, 6)]
    b, c = make_seq("b", 1, 5), make_seq("c", 1, 5)
    s.add(b, c)
    assert s.trace(s.step()) == [("a", 6, 1), ("b", 0, 1), ("c", 0, 1)]
    assert s.bm.num_free_pages == 0
    assert s.trace(s.step()) == [("a", 7, 1), ("b", 1, 1), ("c", 1, 1)]
    out = s.step()  # a needs a row of 2 pages: c (1 page) is not enough, b goes too
    assert out.preempted == [c, b]
    assert s.trace(out) == [("a", 8, 1)]
    assert list(s.sched.waiting) == [b, c]  # b arrived first: it stays ahead
    s.run()
    assert s.sched.num_preemptions == 2
    s.assert_all_done()


def test_preempted_sequence_returns_to_the_front_of_the_queue(sim):
    s = sim(6, block_size=2, budget=64, prefix_caching=False)
    a = make_seq("a", 4, 6)
    b = make_seq("b", 4, 6)
    s.add(a, b)
    for _ in range(3):
        s.step()
    late = make_seq("late", 1, 1)  # arrives before b is preempted
    s.add(late)
    out = s.step()
    assert out.preempted == [b]
    assert list(s.sched.waiting) == [b, late]
    s.run()
    readmitted = next(i for i, o in enumerate(s.outputs) if i > 3 and any(x.seq is b for x in o.scheduled))
    started_late = next(i for i, o in enumerate(s.outputs) if any(x.seq is late for x in o.scheduled))
    assert readmitted <= started_late
    s.assert_all_done()


def test_preempted_sequence_is_recomputed_in_chunks_without_sampling_early(sim):
    s = sim(12, block_size=2, budget=3, prefix_caching=False)
    a = make_seq("a", 2, 18)  # 20 tokens: 10 pages at most
    b = make_seq("b", 2, 14)  # 16 tokens: 8 pages; both together outgrow the 12-page pool
    s.add(a, b)
    for _ in range(100):
        if b.num_preemptions:
            break
        s.step()
    assert b.num_preemptions == 1 and not b.finished
    assert b.num_tokens > 3  # more than one budget: recomputed over several steps
    back = []
    for _ in range(200):
        if b.finished:
            break
        out = s.step()
        back += [item for item in out.scheduled if item.seq is b]
    assert b.finished
    chunks = [(item.start, item.num_tokens, item.samples) for item in back]
    recompute = [c for c in chunks if c[0] < chunks[-1][0] and not c[2]]
    assert len(recompute) >= 2 and recompute[0][0] == 0
    s.run()
    s.assert_all_done()


def test_release_when_chunking_is_disabled_and_the_prompt_does_not_fit_the_budget(sim):
    s = sim(64, block_size=4, budget=16, chunked=False)
    warm = make_seq("warm", list(range(1, 17)), 1)
    s.add(warm)
    s.run()
    decoders = [make_seq(f"d{i}", 1, 8) for i in range(6)]
    s.add(*decoders)
    s.step()
    # 16 tokens cached from warm, 12 left to compute: more than the 10 of budget the decoders leave.
    p = make_seq("p", list(range(1, 17)) + list(range(100, 112)), 1)
    s.add(p)
    for _ in range(3):
        out = s.step()
        assert all(item.seq is not p for item in out.scheduled)
        assert s.sched.waiting[0] is p and s.bm.pages_held(p) == 0 and p.num_computed_tokens == 0
    s.run()
    assert p.num_cached_tokens == 16
    s.assert_all_done()


# ---- long prompts beside short ones (docs/server.md, "Scheduling") -----------------------------


def test_chunk_cap_shrinks_with_the_context_and_never_reaches_zero():
    config = SchedulerConfig(long_prefill_token_threshold=128, long_prefill_context_scale=256)
    assert [config.prefill_chunk_cap(c) for c in (0, 256, 768, 7936, 1 << 20)] == [128, 64, 32, 4, 1]
    chunked = replace(config, long_prefill_chunk_tokens=32)  # a chunk size of its own, below the threshold
    assert [chunked.prefill_chunk_cap(c) for c in (0, 256, 768, 7936)] == [32, 16, 8, 1]
    assert SchedulerConfig(long_prefill_token_threshold=128).prefill_chunk_cap(8000) == 128  # no scale
    assert SchedulerConfig().prefill_chunk_cap(0) is None  # off: only the budget
    assert SchedulerConfig(long_prefill_token_threshold=128, enable_chunked_prefill=False).prefill_chunk_cap(0) is None


def test_a_long_prefill_is_one_whose_tokens_reach_past_the_threshold_until_its_last_prompt_token():
    config = SchedulerConfig(long_prefill_token_threshold=128)
    assert config.is_long_prefill(129, 129) and not config.is_long_prefill(128, 128)
    assert config.is_long_prefill(8000, 2)  # its last chunk still attends to 7998 positions
    assert not config.is_long_prefill(8000, 1)  # decoding
    assert not SchedulerConfig().is_long_prefill(8000, 8000)  # no threshold: nothing is long


@pytest.mark.parametrize("context_scale", [0, 64])
def test_short_request_runs_in_the_next_step_while_a_long_prompt_is_mid_prefill(sim, context_scale):
    s = sim(256, budget=64, long_threshold=16, context_scale=context_scale)
    long = make_seq("long", 400, 2)
    s.add(long)
    s.step()
    s.step()
    assert 0 < long.num_computed_tokens < long.num_prompt_tokens
    short = make_seq("short", 4, 3)
    s.add(short)
    out = s.step()
    assert ("short", 0, 4) in s.trace(out)  # admitted at once, its whole prompt: it samples now
    assert len(short.output_token_ids) == 1
    assert [item.seq for item in out.scheduled] == [short]  # the long prefill sat this step out
    assert s.trace(s.step())[0][0] == "long"  # and is back in the next
    s.run()
    s.assert_all_done()


def test_without_a_threshold_the_long_prompt_takes_the_whole_budget(sim):
    """The behaviour the threshold replaces: the short request waits for the long prefill."""
    s = sim(256, budget=64)
    long = make_seq("long", 400, 2)
    s.add(long)
    s.step()
    short = make_seq("short", 4, 3)
    s.add(short)
    assert s.trace(s.step()) == [("long", 64, 64)]
    assert short.status is SequenceStatus.WAITING
    s.run()
    s.assert_all_done()


def test_long_prefill_share_of_a_step_is_bounded_it_gives_way_every_other_step_at_most(sim):
    threshold, chunk_tokens, scale = 16, 12, 32
    s = sim(512, block_size=4, budget=32, max_num_seqs=32, long_threshold=threshold, chunk_tokens=chunk_tokens,
            context_scale=scale)
    long = make_seq("long", 300, 1)
    s.add(long)
    arrivals = {step: [make_seq(f"short{step}", 3, 4)] for step in range(1, 400)}  # a short request every step
    chunks = []
    for step in range(400):
        for seq in arrivals.pop(step, ()):
            s.add(seq)
        before = long.num_computed_tokens
        out = s.step()
        if before >= long.num_prompt_tokens:
            break
        chunk = long.num_computed_tokens - before
        chunks.append(chunk)
        cap = min(max(1, chunk_tokens * scale // (scale + before)), long.num_prompt_tokens - before)
        # from step 1 on a short prompt waits at every step: the long prefill gives way (sits the step
        # out) in every other step, and takes its capped chunk in the others (its last prompt token,
        # a one-token step like a decode's, is not a long prefill)
        assert chunk == (0 if step % 2 == 1 and long.num_prompt_tokens - before > 1 else cap)
        newcomer = f"short{step}"
        if step >= 1:  # each step's new short request is admitted in that very step
            assert any(item.seq.request_id == newcomer for item in out.scheduled)
    else:
        raise AssertionError("the long prompt never finished its prefill")
    assert sum(chunks) == long.num_prompt_tokens
    taken = [chunk for chunk in chunks if chunk]
    assert taken[0] == chunk_tokens and taken[-1] < chunk_tokens // 4  # the cap shrank as the context grew
    s.run(arrivals=arrivals)
    s.assert_all_done()


def test_one_long_prefill_at_a_time_shorter_prompts_go_ahead_long_ones_keep_their_order(sim):
    s = sim(512, block_size=4, budget=48, long_threshold=16)
    first, second, third = make_seq("long1", 100, 1), make_seq("long2", 60, 1), make_seq("long3", 40, 1)
    short = make_seq("short", 5, 2)
    s.add(first, second, short, third)
    out = s.step()
    # long2 and long3 wait, short goes ahead; long1 is admitted after it in the next step (it gave way)
    assert s.trace(out) == [("short", 0, 5)]
    assert s.trace(s.step()) == [("short", 5, 1), ("long1", 0, 16)]
    assert list(s.sched.waiting) == [second, third]
    while first.status is not SequenceStatus.FINISHED:  # long prefill to its last token, alone
        out = s.step()
        assert [item.seq for item in out.scheduled] == [first]
        assert second.status is SequenceStatus.WAITING and third.status is SequenceStatus.WAITING
    # long1's prefill is done: long2, first in the queue, starts, long3 still waits
    out = s.step()
    assert [item.seq for item in out.scheduled] == [second]
    assert third.status is SequenceStatus.WAITING
    s.run()
    s.assert_all_done()


def test_two_long_prefills_at_once_when_allowed(sim):
    s = sim(512, block_size=4, budget=48, long_threshold=16, max_long=2)
    first, second, third = make_seq("long1", 100, 1), make_seq("long2", 60, 1), make_seq("long3", 40, 1)
    s.add(first, second, third)
    assert s.trace(s.step()) == [("long1", 0, 16), ("long2", 0, 16)]
    assert list(s.sched.waiting) == [third]
    s.run()
    s.assert_all_done()


@pytest.mark.parametrize("seed", range(4))
def test_no_deadlock_with_long_prefill_caps_and_tight_pages(sim, seed):
    rng = random.Random(100 + seed)
    s = sim(28, 4, budget=rng.choice([8, 16, 24]), max_num_seqs=rng.choice([3, 6, 16]), long_threshold=rng.choice([2, 6]),
            context_scale=rng.choice([0, 8]), max_long=rng.choice([1, 2]))
    shared = [[rng.randrange(30000) for _ in range(24)] for _ in range(3)]
    seqs = random_workload(rng, 24, 4, 28, 40, [ONE, TWO_HEADS, MIXED], shared)
    arrivals = {}
    for seq in seqs:
        arrivals.setdefault(rng.randint(0, 30), []).append(seq)
    s.run(arrivals=arrivals)
    s.assert_all_done()
    assert all(len(seq.output_token_ids) == seq.max_tokens for seq in seqs)


# ---- no deadlock -------------------------------------------------------------------------------


def random_workload(rng, n, block_size, num_pages, max_len, layouts, shared_prefixes):
    seqs = []
    for i in range(n):
        layout = rng.choice(layouts)
        cap = min(max_len, (num_pages // layout.row_width) * block_size)
        total = rng.randint(2, cap)
        max_tokens = rng.randint(1, min(12, total - 1))
        prompt_len = total - max_tokens
        if shared_prefixes and rng.random() < 0.6:
            prefix = list(rng.choice(shared_prefixes))[:prompt_len]
        else:
            prefix = []
        prompt = prefix + [rng.randrange(30000) for _ in range(prompt_len - len(prefix))]
        seqs.append(make_seq(f"r{i}", prompt, max_tokens, layout=layout))
    return seqs


@pytest.mark.parametrize(
    "seed, chunked, prefix_caching, layouts",
    [
        (0, True, True, "one"),
        (1, True, False, "one"),
        (2, False, True, "one"),
        (3, False, False, "one"),
        (4, True, True, "mixed"),
        (5, False, True, "mixed"),
        (6, True, True, "one"),
        (7, True, True, "mixed"),
    ],
)
def test_no_deadlock_with_tight_pages(sim, seed, chunked, prefix_caching, layouts):
    rng = random.Random(seed)
    block_size = 4
    layouts = [ONE, TWO_HEADS] if layouts == "one" else [ONE, TWO_HEADS, MIXED]
    num_pages = 28
    max_len = 40
    budget = rng.choice([8, 16, 24]) if chunked else max_len
    s = sim(num_pages, block_size, budget=budget, max_num_seqs=rng.choice([3, 6, 16]), chunked=chunked,
            prefix_caching=prefix_caching)
    shared = [[rng.randrange(30000) for _ in range(24)] for _ in range(3)]
    seqs = random_workload(rng, 24, block_size, num_pages, max_len, layouts, shared)
    arrivals = {}
    for seq in seqs:
        arrivals.setdefault(rng.randint(0, 30), []).append(seq)
    s.run(arrivals=arrivals)
    s.assert_all_done()
    assert all(len(seq.output_token_ids) == seq.max_tokens for seq in seqs)
    assert s.sched.num_preemptions > 0  # the pool really was tight
    if prefix_caching:
        assert s.bm.prefix_hits > 0


def test_waiting_sequence_with_a_cached_prefix_does_not_block_the_queue(sim):
    """Regression: a head-of-queue sequence that attached prefix-cache rows and then failed
    admission kept them while waiting; a preempted sequence in front of it could then never
    fit again and every later step was empty (deadlock)."""
    s = sim(8, block_size=2, budget=64)
    c = make_seq("c", [1, 2, 3, 4, 5], 1)
    s.add(c)
    s.step()  # c computes and caches [1, 2], [3, 4], then finishes
    assert c.finished and s.bm.num_free_pages == 8
    a = make_seq("a", list(range(100, 110)), 6)  # 16 tokens: the whole pool at the end
    s.add(a)
    s.step()
    b = make_seq("b", [1, 2, 3, 4] + list(range(50, 56)), 1)  # prefix hit, but 5 pages needed
    s.add(b)
    out = s.step()
    assert s.trace(out) == [("a", 10, 1)]
    assert s.sched.waiting[0] is b and s.bm.pages_held(b) == 0  # attached rows given back
    assert b.num_computed_tokens == 0
    s.run(max_steps=50)
    s.assert_all_done()


def test_many_sequences_share_one_prefix_under_pressure(sim):
    s = sim(20, block_size=2, budget=12, max_num_seqs=8)
    system = list(range(1, 9))  # 4 full blocks shared by everyone
    seqs = [make_seq(f"r{i}", system + [100 + i, 200 + i], 4) for i in range(10)]
    s.add(*seqs)
    s.run()
    s.assert_all_done()
    assert s.bm.prefix_hits > 0
    assert sum(seq.num_cached_tokens > 0 for seq in seqs) >= 5


# ---- abort ----------------------------------------------------------------------------------------


def test_abort_waiting_and_running_frees_every_page_at_once(sim):
    s = sim(40, block_size=4, budget=10)
    long = make_seq("long", 30, 5)  # mid-prefill after one step
    dec = [make_seq(f"dec{i}", 2, 50) for i in range(2)]
    s.add(*dec, long)
    s.step()
    s.step()
    waiting = [make_seq(f"w{i}", 20, 5) for i in range(3)]
    s.add(*waiting)
    assert long.status is SequenceStatus.RUNNING and 0 < long.num_computed_tokens < 30
    assert s.bm.num_used_pages > 0
    held = s.bm.pages_held(dec[0])
    used = s.bm.num_used_pages
    s.sched.finish(dec[0], "abort")
    assert s.bm.num_used_pages == used - held and not s.bm.has(dec[0])
    for seq in [long, dec[1], *waiting]:
        s.sched.finish(seq, "abort")
    assert s.bm.num_used_pages == 0
    assert s.bm.num_free_pages == s.bm.num_pages
    assert not s.sched.has_work() and not s.sched.running and not s.sched.waiting
    for seq in s.seqs:
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "abort"
    s.sched.finish(long, "length")  # already finished: a no-op
    assert long.finish_reason == "abort"
    assert s.sched.schedule().empty
    assert_pages_free(s.bm)


def test_abort_one_running_sequence_others_complete(sim):
    s = sim(12, block_size=2, budget=16)
    seqs = [make_seq(f"r{i}", 3, 4) for i in range(4)]
    s.add(*seqs)
    s.step()
    s.step()
    s.sched.finish(seqs[1], "abort")
    assert not s.bm.has(seqs[1])
    s.run()
    assert seqs[1].finish_reason == "abort" and len(seqs[1].output_token_ids) == 2
    s.assert_all_done()


def test_abort_a_preempted_sequence(sim):
    s = sim(6, block_size=2, budget=64)
    a, b = make_seq("a", 4, 6), make_seq("b", 4, 6)
    s.add(a, b)
    for _ in range(4):
        s.step()
    assert b.num_preemptions == 1 and b.status is SequenceStatus.WAITING
    s.sched.finish(b, "abort", stop_reason="user")
    assert b.finished and b.stop_reason == "user" and not s.sched.waiting
    s.run()
    s.assert_all_done()


# ---- prefix caching through the scheduler ---------------------------------------------------------


def test_prefix_hits_set_num_cached_tokens(sim):
    s = sim(64, block_size=4, budget=64)
    base = list(range(1, 11))  # 10 tokens: 2 full blocks
    first = make_seq("first", base, 2)
    s.add(first)
    s.run()
    assert first.num_cached_tokens == 0

    b = make_seq("b", base[:8] + [77, 78, 79], 1)
    same = make_seq("same", base, 1)
    exact = make_seq("exact", base[:8], 1)  # all blocks cached: the last one is recomputed
    scored = make_seq("scored", base, 1, sampling=SamplingParams(prompt_logprobs=1))
    other_depth = make_seq("deep", base, 1, depth=DepthParams(loops=2))
    other_layout = make_seq("wide", base, 1, layout=TWO_HEADS)
    for seq in (b, same, exact, scored, other_depth, other_layout):
        s.add(seq)
        out = s.step()
        assert len(out.scheduled) == 1
        item = out.scheduled[0]
        assert item.start == seq.num_cached_tokens
        assert item.num_tokens == seq.num_prompt_tokens - seq.num_cached_tokens
        s.run()
    assert b.num_cached_tokens == 8
    assert same.num_cached_tokens == 8
    assert exact.num_cached_tokens == 4
    assert scored.num_cached_tokens == 0  # prompt logprobs need every position computed
    assert other_depth.num_cached_tokens == 0
    assert other_layout.num_cached_tokens == 0
    s.assert_all_done()


def test_num_cached_tokens_is_kept_across_preemption(sim):
    s = sim(8, block_size=2, budget=64)
    warm = make_seq("warm", [1, 2, 3, 4, 5], 1)
    s.add(warm)
    s.run()
    a = make_seq("a", [9, 9, 9, 9], 6)
    b = make_seq("b", [1, 2, 3, 4, 5], 8)
    s.add(a, b)
    s.step()
    assert b.num_cached_tokens == 4
    while not b.num_preemptions:
        s.step()
        assert not b.finished
    s.run()
    assert b.num_cached_tokens == 4
    s.assert_all_done()


def test_preempted_sequence_reuses_its_own_cached_blocks(sim):
    s = sim(6, block_size=2, budget=64)
    a, b = make_seq("a", 4, 6), make_seq("b", 4, 6)
    s.add(a, b)
    for _ in range(4):
        s.step()
    assert b.num_preemptions == 1
    hits_before = s.bm.prefix_hits
    s.run()
    back = next(item for o in s.outputs[4:] for item in o.scheduled if item.seq is b)
    assert back.start > 0 and s.bm.prefix_hits > hits_before  # its blocks were still cached
    s.assert_all_done()


# ---- torch-free --------------------------------------------------------------------------------


def test_runs_without_torch_in_a_fresh_interpreter():
    script = textwrap.dedent(
        """
        import sys
        from depthserve.depth import DepthParams, DepthPlan
        from depthserve.engine.block_manager import BlockManager
        from depthserve.cache import CacheLayout, SlotKind, SlotSpec
        from depthserve.engine.scheduler import Scheduler, SchedulerConfig
        from depthserve.engine.sequence import Sequence
        from depthserve.sampling_params import SamplingParams
        layout = CacheLayout((SlotSpec("kv", SlotKind.DENSE, 1),))
        bm = BlockManager(8, 2)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), bm)
        seqs = [Sequence(str(i), 0, [1, 2, 3, 4], SamplingParams(), DepthPlan(depth=DepthParams(), layout=layout), 6) for i in range(3)]
        for seq in seqs:
            sched.add(seq)
        for _ in range(200):
            if not sched.has_work():
                break
            for item in sched.schedule().scheduled:
                seq = item.seq
                seq.num_computed_tokens = item.end
                bm.commit_computed(seq, seq.depth.cache_key())
                if item.samples:
                    seq.output_token_ids.append(7)
                    if len(seq.output_token_ids) >= seq.max_tokens:
                        sched.finish(seq, "length")
        assert not sched.has_work() and sched.num_preemptions > 0
        assert bm.num_free_pages == 8
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_look_ahead_grows_pages_for_the_steps_ahead_only_when_every_sequence_can():
    """Scheduler.look_ahead: a decode-only batch with nothing waiting gets up to the asked steps,
    never past a sequence's max_tokens, its pages grown for them; a prefill chunk in the batch, a
    waiting request or a page shortfall keeps it at one step."""
    sim = Sim(num_pages=12, block_size=4, budget=64)
    short, long = make_seq("short", 5, max_tokens=4), make_seq("long", 6, max_tokens=20)
    sim.add(short, long)
    out = sim.step()  # both prefills: no look-ahead for chunks
    assert sim.sched.look_ahead(out.scheduled, 8) == 1
    out = sim.sched.schedule()  # both decode
    assert sim.sched.look_ahead(out.scheduled, 8) == 3  # "short" has 3 tokens left to generate
    for item in out.scheduled:
        assert sim.bm.pages_held(item.seq) >= sim.bm.pages_for(item.seq.layout, item.start + 3)
    assert sim.sched.look_ahead(out.scheduled, 1) == 1
    sim.add(make_seq("late", 3, max_tokens=2))
    assert sim.sched.look_ahead(out.scheduled, 8) == 1, "a waiting request must not wait for steps ahead"
    check_consistent(sim.bm)

    tight = Sim(num_pages=4, block_size=4, budget=64)  # 16 tokens in all
    a, b = make_seq("a", 7, max_tokens=8), make_seq("b", 4, max_tokens=8)
    tight.add(a, b)
    tight.step()
    out = tight.sched.schedule()
    assert [item.num_tokens for item in out.scheduled] == [1, 1]
    assert tight.sched.look_ahead(out.scheduled, 8) == 1, "8 more tokens each do not fit 4 pages"
    check_consistent(tight.bm)
