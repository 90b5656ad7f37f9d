"""What the looped models' throughput benches (dory_throughput.py, hrm_text_throughput.py,
inkling2_throughput.py) measure alike: a batch's decode steps on the engine, the LM head's share of
a step, and the machine's read bandwidth beside them."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common import byte_prompts

PROMPT_TOKENS = 16
BANDWIDTH_BYTES = 1 << 30


@dataclass
class DecodeTiming:
    times: list[float]  # wall seconds of each timed step
    head_times: list[float]  # the LM head's seconds within each (empty without a HeadClock)
    kv_bytes_per_token: float  # the KV bytes a sequence holds per prompt token


class HeadClock:
    """A callable standing in for the LM head's forward that adds its wall time to `seconds`."""

    def __init__(self, forward):
        self.forward, self.seconds = forward, 0.0

    def __call__(self, *args, **kwargs):
        begin = time.perf_counter()
        out = self.forward(*args, **kwargs)
        self.seconds += time.perf_counter() - begin
        return out


def time_decode(engine, batch: int, depth, steps: int, tag: str, head: HeadClock | None = None) -> DecodeTiming:
    """`batch` greedy sequences at `depth` (DepthParams) prefilled from PROMPT_TOKENS-token prompts,
    one decode step unmeasured, then `steps` timed steps; the requests aborted after."""
    from depthserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, byte_prompts(batch, PROMPT_TOKENS)):
        engine.add_request(rid, prompt, params, depth)
    seqs = [engine._requests[rid].seqs[0] for rid in ids]
    while any(seq.num_computed_tokens < PROMPT_TOKENS for seq in seqs):
        engine.step()
    kv_bytes_per_token = engine.block_manager.pages_held(seqs[0]) * engine.block_manager.page_bytes / PROMPT_TOKENS
    engine.step()
    timing = DecodeTiming([], [], kv_bytes_per_token)
    for _ in range(steps):
        if head is not None:
            head.seconds = 0.0
        begin = time.perf_counter()
        engine.step()
        timing.times.append(time.perf_counter() - begin)
        if head is not None:
            timing.head_times.append(head.seconds)
    for rid in ids:
        engine.abort_request(rid)
    return timing


class BandwidthProbe:
    """Bytes per second that `torch.sum` streams from memory over a 1 GiB buffer (the best of
    `repeats` sums), probed again beside each measurement: a shared VM's read rate drifts by tens of
    percent over minutes, so a step's floor is taken from probes made in the same minute."""

    def __init__(self, repeats: int = 2):
        self.buffer = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
        self.repeats = repeats

    def __call__(self) -> float:
        best = math.inf
        for _ in range(self.repeats):
            start = time.perf_counter()
            torch.sum(self.buffer)
            best = min(best, time.perf_counter() - start)
        return BANDWIDTH_BYTES / best


def anon_huge_page_bytes() -> int | None:
    """The process's anonymous memory on transparent huge pages (Linux; None elsewhere): the packed
    weights ask for them (depthserve/layers/huge_pages.py), and on 4 KiB pages they stream slower."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith("AnonHugePages:")), None)
    return None if line is None else int(line.split()[1]) * 1024
