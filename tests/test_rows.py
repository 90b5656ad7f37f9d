"""layers/rows.py: a depth loop written once gives the same rows' results gathered (eager steps) and
masked (the static decode step), nested levels included; the confidence exit lowers a row's level."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from depthserve.layers.attention import StaticRows
from depthserve.layers.batch import BatchItem, StepBatch
from depthserve.layers.rows import GatheredRows, MaskedRows, StepRows

DEPTHS = [3, 1, 2, 3, 0, 2]  # one request per row (decode rows)


def gathered(depths=DEPTHS, thresholds=None) -> GatheredRows:
    plan = SimpleNamespace(layout=SimpleNamespace(base_width=1), elastic=SimpleNamespace(minimum=1))
    items = [BatchItem(i, plan, 5, 1, i, np.zeros((2, 1), np.int64), settings=np.array([d], np.float32),
                       exit_threshold=None if thresholds is None else thresholds[i], samples=True)
             for i, d in enumerate(depths)]
    step = StepBatch(items, 4, torch.device("cpu"), None)
    return GatheredRows(None, step, None, None)


def masked(depths=DEPTHS, cap=None) -> MaskedRows:
    n = len(depths)
    static = StaticRows(torch.tensor(depths, dtype=torch.float32)[:, None], torch.zeros(n, 0, dtype=torch.long),
                        torch.zeros(n, dtype=torch.long), torch.zeros(n, 1, dtype=torch.int32),
                        torch.zeros(n, 0, dtype=torch.long), {}, {}, cap)
    return MaskedRows(None, static, None)


def per_level_loop(rows: StepRows, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each level from the whole step (SGT, PUT); and a record of the rows that ran each level."""
    depth = rows.setting(0)
    ran = []
    for k in range(1, rows.deepest(depth, 3) + 1):
        level = rows.narrow(depth, k)
        level_x = level.take(x)
        x = level.merge(x, level_x * 2 + k)
        ran.append(level.spread(torch.full((level_x.shape[0],), k, dtype=torch.int32), -1))
    return x, torch.stack(ran, 1)


def nested_loop(rows: StepRows, x: torch.Tensor) -> torch.Tensor:
    """Each level from the one before (Dreamer): the carried values narrow with the rows."""
    depth = rows.setting(0)
    level, entered = rows, []
    for k in range(1, rows.deepest(depth, 3) + 1):
        inner = level.narrow(depth, k)
        if inner.empty:
            break
        entered.append((inner, x))
        x = inner.take(x) * 2 + k
        level = inner
    for inner, before in reversed(entered):
        x = inner.merge(before, x)
    return x


def expected(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    for i, d in enumerate(DEPTHS):
        for k in range(1, d + 1):
            out[i] = out[i] * 2 + k
    return out


def test_a_loop_gives_the_same_rows_gathered_and_masked():
    x = torch.arange(len(DEPTHS) * 2, dtype=torch.float32).view(len(DEPTHS), 2)
    for rows in (gathered(), masked()):
        out, ran = per_level_loop(rows, x)
        torch.testing.assert_close(out, expected(x), rtol=0, atol=0)
        assert ran.tolist() == [[k if k <= d else -1 for k in (1, 2, 3)] for d in DEPTHS]
        torch.testing.assert_close(nested_loop(rows, x), expected(x), rtol=0, atol=0)


def test_a_level_cap_bounds_the_masked_loop_and_gathered_rows_skip_what_no_row_runs():
    assert masked(cap=2).deepest(None, 4) == 2 and masked().deepest(None, 4) == 4
    rows = gathered()
    assert rows.deepest(rows.setting(0), 4) == 3
    full = rows.narrow(rows.setting(0), 0)
    assert full.index is None and full.rows is None  # every row runs: no gather at all
    assert rows.narrow(rows.setting(0), 3).rows.tolist() == [0, 3]


def test_the_confidence_exit_lowers_a_confident_rows_level_within_its_range():
    rows = gathered(thresholds=[0.5, None, 0.5, 2.0, None, 0.5])
    exit = rows.confidence_exit(0)
    readout = lambda x: torch.tensor([[10.0, 0.0]]).expand(x.shape[0], 2)  # noqa: E731 (top-1 p ~ 1)
    exit.check(readout, torch.zeros(len(DEPTHS), 2), None, 1)
    # rows 0 and 5 stop at level 1 (row 2 too: 1 < 2); row 3's threshold is never reached
    assert exit.levels.tolist() == [1, 1, 1, 3, 0, 1]
    assert exit.readouts(torch.device("cpu")).tolist() == [1, 0, 1, 1, 0, 1]
    exit.finish()
    assert rows.step.ran_levels == {0: [1], 2: [1], 3: [3], 5: [1]}


def test_a_causal_window_over_decode_rows_is_the_same_gathered_and_masked():
    """One row per sequence (PUT's conv at decode): tap j of a row is its carried value j back, the new
    carry its last values; a window of one row carries nothing (a kernel of size 1)."""
    for size in (1, 2, 3):
        (g_taps, g_kept), (m_taps, m_kept) = gathered().causal_window(size), masked().causal_window(size)
        assert [t.tolist() for t in g_taps] == [t.tolist() for t in m_taps], size
        assert g_kept.tolist() == m_kept.tolist(), size
        assert len(m_kept) == len(DEPTHS) * (size - 1)
