"""bench/serving.py's long-prompt mix: options, the ratio it reports, the order requests are sent in."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import serving  # noqa: E402


def run(long_prompts: int, rate: float, p99_ms: float, long_ok: int = 0) -> dict:
    record = {"long_prompts": long_prompts, "request_rate": rate, "summary": {"ttft_ms": {"p99": p99_ms}}}
    if long_prompts:
        record["long_summary"] = {"completed": long_ok}
        record["long_requests"] = [{"e2el_s": 60.0 + i} for i in range(long_ok)]
    return record


def test_long_prompt_effect_pairs_each_rate_with_its_run_alone():
    runs = [run(0, 1.0, 200.0), run(1, 1.0, 350.0, long_ok=1), run(0, "inf", 400.0), run(1, "inf", 1200.0, long_ok=1)]
    effects = serving.long_prompt_effect(runs)
    assert [(e["request_rate"], e["short_p99_ttft_ratio"]) for e in effects] == [(1.0, 1.75), ("inf", 3.0)]
    assert effects[0]["short_p99_ttft_ms_alone"] == 200.0 and effects[0]["short_p99_ttft_ms_with_long"] == 350.0
    assert effects[0]["long_completed"] == 1 and effects[0]["long_e2el_s"] == [60.0]
    assert serving.long_prompt_effect([run(0, 1.0, 200.0)]) == []


def test_long_prompt_options_are_checked():
    ns = serving.parse_args(["--long-prompts", "2", "--long-prompt-tokens", "8192"])
    assert (ns.long_prompts, ns.long_prompt_tokens, ns.long_output_len) == (2, 8192, 16)
    assert serving.parse_args([]).long_prompts == 0
    for bad in (["--long-prompts", "-1"], ["--long-prompts", "1", "--long-prompt-tokens", "0"],
                ["--long-prompts", "1", "--launch", "--llama-server"]):
        with pytest.raises(SystemExit):
            serving.parse_args(bad)


def test_long_prompts_are_sent_first_and_their_results_come_first(monkeypatch):
    sent: list[str] = []

    async def fake_send(client, body, run_start):
        sent.append(body["name"])
        await asyncio.sleep(0)
        return serving.RequestResult(ok=True, prompt_tokens=len(body["prompt"]), ttft_s=0.0, e2el_s=0.0)

    monkeypatch.setattr(serving, "send_streaming_request", fake_send)
    ns = serving.parse_args(["--no-progress", "--arrival", "constant"])
    shorts = [{"name": f"short{i}", "prompt": [1] * 4} for i in range(3)]
    longs = [{"name": "long", "prompt": [1] * 100}]
    results, _ = asyncio.run(serving.run_at_rate(None, shorts, 50.0, ns, first=longs))
    assert sent == ["long", "short0"]  # short0 is due with it; the long one is done before short1 is due
    assert [r.prompt_tokens for r in results] == [100, 4]


def test_short_requests_arrive_until_the_long_ones_finish(monkeypatch):
    sent: list[str] = []

    async def fake_send(client, body, run_start):
        sent.append(body["name"])
        await asyncio.sleep(body["takes_s"])
        return serving.RequestResult(ok=True, prompt_tokens=len(body["prompt"]), ttft_s=0.0, e2el_s=0.0)

    monkeypatch.setattr(serving, "send_streaming_request", fake_send)
    ns = serving.parse_args(["--no-progress", "--arrival", "constant"])
    shorts = [{"name": f"short{i}", "prompt": [1] * 4, "takes_s": 0.0} for i in range(40)]
    longs = [{"name": "long", "prompt": [1] * 100, "takes_s": 0.25}]
    results, _ = asyncio.run(serving.run_at_rate(None, shorts, 20.0, ns, first=longs))  # one short every 50 ms
    assert sent[0] == "long" and 3 <= len(sent) - 1 <= 7  # those due within the long one's 250 ms
    assert sent[1:] == [f"short{i}" for i in range(len(sent) - 1)]
    assert [r.prompt_tokens for r in results] == [100] + [4] * (len(sent) - 1)
    without_long, _ = asyncio.run(serving.run_at_rate(None, shorts[:5], 1000.0, ns))
    assert len(without_long) == 5
