"""The benchmark scripts' pure parts: statistics, prompt windows, arrivals, SLOs, plots; make-tiny's
depth-layout options."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import common  # noqa: E402
import serving  # noqa: E402

from depthserve import tiny  # noqa: E402
from depthserve.errors import ConfigurationError  # noqa: E402
from tests.flash_helpers import flash_varlen_on_cpu  # noqa: E402


def test_summarize_and_percentiles():
    s = common.summarize([4.0, 1.0, 3.0, 2.0], percentiles=(50, 90, 99))
    assert s["mean"] == 2.5 and s["median"] == 2.5 and s["p50"] == 2.5
    assert s["p90"] == pytest.approx(3.7) and s["p99"] == pytest.approx(3.97)
    assert common.summarize([], (90,)) == {"mean": None, "std": None, "median": None, "p90": None}
    assert common.percentile([7.0], 99) == 7.0


def test_token_windows_take_document_starts_first_then_later_windows():
    docs = [list(range(10)), list(range(100, 104)), list(range(200, 206))]
    assert common.token_windows(docs, 4, 3) == [[0, 1, 2, 3], [100, 101, 102, 103], [200, 201, 202, 203]]
    assert common.token_windows(docs, 4, 5)[3:] == [[4, 5, 6, 7]] + [[0, 1, 2, 3]]  # then cycles
    with pytest.raises(ValueError):
        common.token_windows(docs, 11, 1)


def test_parse_number_list_and_slug():
    assert common.parse_number_list("1, 2.5,inf") == [1.0, 2.5, math.inf]
    assert common.slug("HuggingFaceTB/SmolLM2 135M") == "huggingfacetb-smollm2-135m"


def test_arrivals():
    assert serving.arrival_offsets(3, math.inf, "poisson", 0) == [0.0, 0.0, 0.0]
    assert serving.arrival_offsets(3, 4.0, "constant", 0) == [0.0, 0.25, 0.5]
    gaps = serving.arrival_offsets(2000, 10.0, "poisson", 1)
    assert gaps == sorted(gaps) and gaps[-1] / 1999 == pytest.approx(0.1, rel=0.1)


def test_tpot_and_goodput_slos():
    r = serving.RequestResult(ok=True, prompt_tokens=8, ttft_s=0.2, e2el_s=1.2, output_tokens=11)
    assert r.tpot_s == pytest.approx(0.1)
    assert serving.meets_slos(r, {"ttft": 250, "tpot": 100.001, "e2el": 1300})
    assert not serving.meets_slos(r, {"tpot": 90})
    one = serving.RequestResult(ok=True, prompt_tokens=8, ttft_s=0.2, e2el_s=0.2, output_tokens=1)
    assert one.tpot_s is None and serving.meets_slos(one, {"tpot": 1})
    assert serving.parse_slos(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    with pytest.raises(SystemExit):
        serving.parse_slos(["latency:5"])


def test_shared_prefixes_replace_each_prompts_start_in_turn():
    prompts = [[i] * 6 for i in range(5)]
    shared = serving.with_shared_prefixes(prompts, 2, 4)
    assert shared == [[0, 0, 0, 0, 2, 2], [1, 1, 1, 1, 3, 3], [0, 0, 0, 0, 4, 4]]
    assert serving.with_shared_prefixes(prompts, 0, 4) == prompts


def test_server_arg():
    assert serving.server_arg("--num-threads 2 --device=cpu", "--device") == "cpu"
    assert serving.server_arg("--num-threads 2", "--num-threads") == "2"
    assert serving.server_arg("", "--device") is None


def test_make_tiny_depth_layout_options():
    import argparse

    from depthserve.lab.tiny.itt import tiny_spec as itt_spec
    from depthserve.lab.tiny.sgt import tiny_spec as sgt_spec

    sgt = sgt_spec(30, 9, [10, 15, 20], 2, 1)
    assert [(s.layer, s.heads, s.loops) for s in sgt.layers] == [(10, (0, 1), 1), (15, (0, 1), 1), (20, (0, 1), 1)]
    assert sgt.max_loops == 3
    itt = itt_spec(30, tiny.every_other_layer(30, "odd"), 3)
    assert itt.layers == tuple(range(1, 30, 2)) and itt.steps == 3
    assert itt.alphas == (1.0, 0.5, 0.25) and itt.trained_ratios == (0.5, 0.3, 0.1)
    # The defaults are unchanged by the new options.
    assert itt_spec(4) == itt_spec(4, None, None)
    assert itt_spec(4).alphas == (1.0, 0.5) and itt_spec(4).trained_ratios == (0.5, 0.3)
    assert [(s.layer, s.heads, s.loops) for s in sgt_spec(4, 4).layers] == [
        (1, (3, 0), 2), (2, (1, 2, 3), 1), (3, (1, 0), 1)]
    with pytest.raises(ValueError):
        sgt_spec(30, 9, [10], [[0], [1]])
    with pytest.raises(ConfigurationError, match="applies to its own architecture"):  # another architecture's
        tiny.make_tiny("sgt", "/nonexistent", steps=3)
    flags = dict(arch="sgt", like=None, arch_options=[], sgt_layers=None, sgt_heads=None, sgt_loops=None,
                 itt_layers=None, itt_steps=3)
    with pytest.raises(ValueError, match="--itt"):
        tiny.cli_options(argparse.Namespace(**flags))
    assert tiny.cli_options(argparse.Namespace(**{**flags, "arch": "itt", "itt_layers": "odd"})) == {
        "layers": [1, 3], "steps": 3}


def test_plot_skips_missing_kinds_and_draws_a_depth_sweep_and_a_step_breakdown(tmp_path, capsys):
    import plot

    row = {"knobs": {}, "concurrency": 4, "relative_compute": 1.0, "step_ms": 10.0}
    payload = {"benchmark": "depth-sweep", "environment": {}, "sweeps": [{
        "arch": "sgt", "device": "cpu", "dtype": "float32", "depth_spec": {"architecture": "sgt", "sgt": {
            "looped_layers": [1], "head_sets": [[0, 1]], "loop_counts": [1]}},
        "rows": [{**row, "setting": "loops=0", "is_baseline": True},
                 {**row, "setting": "loops=1", "is_baseline": False, "relative_compute": 1.1, "step_ms": 11.5}]}]}
    (tmp_path / "depth-sweep-test.json").write_text(json.dumps(payload))
    parts = {"weight matmuls": 80.0, "paged attention": 30.0, "ITT routing": 0.0, "rest": 20.0}
    breakdown = {"benchmark": "step-breakdown", "environment": {}, "settings": {"arch": "itt"},
                 "rows": [{"setting": "thinking_steps=0", "concurrency": 4, "parts_ms": parts},
                          {"setting": "ratios=1", "concurrency": 4, "parts_ms": {**parts, "ITT routing": 9.0}}]}
    (tmp_path / "step-breakdown-test.json").write_text(json.dumps(breakdown))
    assert plot.main(["--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no throughput results" in out and "no serving results" in out
    assert (tmp_path / "plots" / "depth-sweep-test-sgt.png").stat().st_size > 0
    assert (tmp_path / "plots" / "step-breakdown-test.png").stat().st_size > 0


def test_depth_sweep_extra_time_is_paired_by_round():
    import depth_sweep

    # The machine's speed swings between rounds, and once a slow spell hits the setting's step
    # alone; in every other round the setting costs 5 ms more than the baseline in that round.
    baseline_steps = [10.0, 30.0, 11.0, 29.0, 20.0]  # median 20
    setting_steps = [15.0, 35.0, 16.0, 34.0, 40.0]  # median 34
    baseline = {"step_ms": 20.0, "step_ms_samples": baseline_steps}
    row = {"step_ms": 34.0, "step_ms_samples": setting_steps}
    assert depth_sweep.paired_extra_ms(row, baseline) == 5.0
    assert depth_sweep.paired_extra_ms({"step_ms": 34.0}, baseline) == 14.0  # no samples: medians


def _count_matmul_rows(model, layers) -> list[tuple[str, int]]:
    seen = []
    for i, layer in enumerate(layers):
        for name, proj in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                           ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
            proj.register_forward_hook(lambda mod, args, out, key=f"{i}.{name}": seen.append((key, args[0].shape[0])))
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(("lm_head", args[0].shape[0])))
    return seen


def test_layer_matmuls_run_every_projection_of_the_layers_on_the_rows_asked(tmp_path):
    from tests.depth_helpers import tiny_llm

    model = tiny_llm(tiny.make_tiny("llama", tmp_path / "llama", seed=1)).engine.model
    layers = list(model.layers)
    seen = _count_matmul_rows(model, layers)
    assert common.layer_matmuls_ms(model, layers[1:], 5, 3, lambda: None) > 0
    assert sorted(seen) == sorted((f"{i}.{n}", 5) for i in range(1, len(layers)) for n in ("qkv", "o", "gate_up", "down")
                                  for _ in range(3))
    seen.clear()
    common.layer_matmuls_ms(model, layers, 7, 1, lambda: None, lm_head=True)
    assert len(seen) == 4 * len(layers) + 1 and seen[-1] == ("lm_head", 7)


def test_throughput_takes_matmul_floor_readings_in_every_repeat_and_bounds_the_decode_ratio():
    import throughput

    calls = []

    class Runner:
        def __init__(self, name):
            self.name = name

        def generate(self, prompts, new_tokens):
            calls.append(self.name)

    readings = iter(range(100))
    figures, probed = throughput.measure([Runner("engine"), Runner("hf")], [[1, 2]], 4, 2, lambda: None,
                                         probe=lambda: calls.append("probe") or float(next(readings)))
    per_repeat = ["engine", "engine", "hf", "hf"] + ["probe"] * throughput.PROBE_SAMPLES
    assert calls == ["engine", "hf"] + 2 * per_repeat  # warm-ups, then the systems and the probe by turns
    assert probed == [float(i) for i in range(2 * throughput.PROBE_SAMPLES)] and set(figures) == {"engine", "hf"}

    floor = throughput.matmul_floor([30.0, 10.0, 20.0, 99.0, 21.0], {"decode_ms_per_step": 42.0})
    assert floor["engine_decode_matmul_ms_per_step"] == 21.0 and floor["decode_ratio_if_only_matmuls"] == 2.0
    assert "decode_ratio_if_only_matmuls" not in throughput.matmul_floor([5.0], None)
    assert "decode_ratio_if_only_matmuls" not in throughput.matmul_floor([5.0], {"decode_ms_per_step": None})


def test_itt_linear_floor_times_the_selected_rows_of_every_thinking_pass(tmp_path):
    import argparse

    import depth_sweep
    from tests.depth_helpers import tiny_llm

    model = tiny_llm(tiny.make_tiny("itt", tmp_path / "itt", seed=1)).engine.model
    layers = model.itt_layers()
    seen = _count_matmul_rows(model, layers)
    assert depth_sweep.thinking_matmuls_ms(model, 5, lambda: None) > 0
    assert len(seen) == 4 * model.spec.steps * len(layers) and {n for _, n in seen} == {5}

    # (a) of the matmuls alone: ms per row at ratio 0.5's selection over ms per row at 1.0's.
    fake_ms = lambda model, n, sync: 10.0 + n  # noqa: E731
    steps = model.spec.steps
    rows = [{"knobs": {"selection_ratios": [r] * steps}, "decode_selected_fraction_mean": f}
            for r, f in ((0.5, 0.52), (1.0, 1.0))] + [{"knobs": {"thinking_steps": 0}}]
    ns = argparse.Namespace(concurrency=32, decode_steps=3)
    floor = depth_sweep.itt_linear_floor(model, rows, ns, lambda: None, fake_ms)
    assert floor["rows"] == {"0.5": 17, "1.0": 32}
    assert floor["a_linear_layers_only"] == pytest.approx((27.0 / 17) / (42.0 / 32))
    assert depth_sweep.itt_linear_floor(model, rows[1:], ns, lambda: None, fake_ms) == {}


def test_step_breakdown_counts_each_parts_own_time_and_removes_its_timers_afterwards():
    import time

    import step_breakdown

    class Owner:
        def outer(self, x):
            time.sleep(0.02)
            return self.inner(x) + 1

        def inner(self, x):
            time.sleep(0.03)
            return x + 1

    owner = Owner()
    originals = Owner.outer, Owner.inner
    clock = step_breakdown.PartClock()
    with step_breakdown.timed_parts({"outer part": [(Owner, "outer")], "inner part": [(Owner, "inner")]}, clock):
        assert owner.outer(1) == 3 and owner.inner(1) == 2
    assert (Owner.outer, Owner.inner) == originals  # restored
    # outer's own time excludes the nested inner call, which counts to the inner part only
    assert 0.02 <= clock.totals["outer part"] < 0.045
    assert 0.06 <= clock.totals["inner part"] < 0.1
    before = dict(clock.totals)
    owner.outer(0)
    assert dict(clock.totals) == before


def test_step_breakdown_splits_each_parts_extra_time_into_fixed_and_per_selected_share():
    import step_breakdown

    assert step_breakdown.fixed_and_variable(70.0, 120.0, 0.5, 1.0) == pytest.approx((20.0, 100.0))

    def row(name, knobs, parts, fraction=None, baseline=False):
        out = {"setting": name, "knobs": knobs, "is_baseline": baseline, "step_ms": sum(parts.values()),
               "parts_ms": {"weight matmuls": 0.0, "ITT routing": 0.0, "rest": 0.0, **parts}}
        if fraction is not None:
            out["decode_selected_fraction_mean"] = fraction
        return out

    rows = [row("thinking_steps=0", {"thinking_steps": 0}, {"weight matmuls": 80.0, "rest": 20.0}, baseline=True),
            row("ratios=0.5", {"selection_ratios": [0.5] * 3}, {"weight matmuls": 150.0, "rest": 30.0}, 0.5),
            row("ratios=1", {"selection_ratios": [1.0] * 3}, {"weight matmuls": 200.0, "rest": 31.0}, 1.0)]
    derived = step_breakdown.itt_parts(rows)
    matmuls = derived["parts"]["weight matmuls"]
    assert matmuls["extra_ms"] == {"0.5": 70.0, "1.0": 120.0}
    assert matmuls["fixed_ms"] == pytest.approx(20.0) and matmuls["per_selected_share_ms"] == pytest.approx(100.0)
    assert matmuls["a_of_this_part"] == pytest.approx((70.0 / 0.5) / 120.0)
    assert derived["parts"]["rest"]["a_of_this_part"] == pytest.approx((10.0 / 0.5) / 11.0)
    assert derived["parts"]["ITT routing"]["a_of_this_part"] is None  # no extra time at all
    assert derived["parts"]["step"]["extra_ms"] == {"0.5": 80.0, "1.0": 131.0}  # no samples: medians' difference
    assert step_breakdown.extra_by_part(rows)["ratios=0.5"] == {"weight matmuls": 70.0, "ITT routing": 0.0,
                                                                "rest": 10.0, "step": 80.0}


@pytest.mark.parametrize("arch", ["itt", "sgt", "dreamer", "put"])
@pytest.mark.slow
def test_step_breakdown_times_every_part_of_real_decode_steps(tmp_path, arch):
    import step_breakdown

    path = tiny.make_tiny(arch, tmp_path / arch, seed=1)
    ns = step_breakdown.parse_args(["--arch", arch, "--checkpoint", str(path), "--concurrency", "3",
                                    "--input-len", "8", "--decode-steps", "2", "--warmup-steps", "1"])
    ns.kv_cache_memory_gib = 1 / 16  # the bench holds an engine per setting (1 GiB each by default)
    rows = step_breakdown.run(ns)
    mechanism = set(step_breakdown.part_targets(arch, [])) - {"weight matmuls", "paged attention"}
    assert mechanism, "every depth architecture times its own mechanism"
    assert rows[0]["is_baseline"] and len(rows) >= 2
    for row in rows:
        assert set(row["parts_ms"]) == set(step_breakdown.part_targets(arch, [])) | {"rest"}
        assert len(row["parts_ms_samples"]) == 2
        assert row["parts_ms"]["weight matmuls"] > 0 and row["parts_ms"]["paged attention"] > 0
    deepest = rows[-1]
    assert all(deepest["parts_ms"][part] > 0 for part in mechanism)
    if arch == "itt":
        assert [r["setting"] for r in rows] == ["thinking_steps=0", "ratios=0.5", "ratios=1"]
        assert rows[0]["parts_ms"]["ITT routing"] == 0
        assert set(step_breakdown.itt_parts(rows)["parts"]) == set(rows[0]["parts_ms"]) | {"step"}
    assert set(step_breakdown.extra_by_part(rows)) == {r["setting"] for r in rows[1:]}


def test_the_decode_anchor_generates_what_the_engine_generates(tmp_path):
    """bench/anchor.py (the plain static-cache decoder bench/throughput.py --anchor times) is the same
    model as the engine's: greedy tokens equal on a tiny GQA Llama, in fp32 on CPU."""
    import torch
    from anchor import AnchorGenerator

    from depthserve import SamplingParams
    from tests.depth_helpers import tiny_llm

    path = tiny.make_tiny("llama", tmp_path / "llama", seed=3, num_kv_heads=2)
    prompts = common.random_prompts(3, 11, 256, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    expected = [out.token_ids for out in tiny_llm(path).generate(prompts, params)]
    hf = common.load_hf_model(str(path), torch.float32, "cpu")
    anchor = AnchorGenerator(hf, max_batch=3, max_len=24, compile_decode=False)
    assert anchor.generate(prompts, 9).tolist() == expected


def test_kernel_bench_checks_and_times_every_variant_against_the_fallback_and_sdpa():
    """bench/kernels.py on a tiny shape (interpreted Triton on CPU): every kernel variant, the
    torch fallback and contiguous SDPA compute the same attention, each row timed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH / "kernels.py")  # not the kernels/ package
    kernel_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_bench)
    ns = kernel_bench.parse_args(["--quick"])
    assert kernel_bench.parse_variants("tile=32,64;warps=4") == [{"tile": 32, "num_warps": 4}, {"tile": 64, "num_warps": 4}]
    result = kernel_bench.bench_shape("4/2/16", ns, __import__("torch").device("cpu"), copy_rate=None)
    names = [row["name"] for row in result["rows"]]
    assert names[0] == "triton (default)" and names[-2:] == ["torch fallback (gather)", "sdpa, contiguous K/V"]
    assert len(names) == 2 + 2 + 1  # default, two variants, fallback, sdpa
    assert all(row["relative_error"] < 1e-5 and row["ms"] > 0 for row in result["rows"])
    assert result["bytes_moved"] == 2 * 2 * 2 * 64 * 16 * 4


@pytest.mark.parametrize("prefix", [0, 24])
def test_prefill_kernel_bench_lays_out_every_form_alike(prefix, monkeypatch):
    """bench/kernels.py --prefill on tiny chunks (interpreted Triton on CPU), with flash varlen
    attention stood in by its documented semantics in torch: the engine's Triton kernel, the torch
    fallback, padded SDPA and both flash layouts (contiguous, and the page pool through a block table,
    one element per sequence and KV head) compute the same attention, fresh chunks and chunks after
    cached keys, and so does the engine's own flash call on fresh chunks; xformers, absent here, is
    recorded as failed and never timed."""
    import importlib.util

    import torch.nn.attention.varlen

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", flash_varlen_on_cpu)
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH / "kernels.py")  # not the kernels/ package
    kernel_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_bench)
    ns = kernel_bench.parse_args(["--prefill", "--quick", "--prefix", str(prefix)])
    result = kernel_bench.bench_prefill_shape("4/2/16", ns, torch.device("cpu"))
    rows = {row["name"]: row for row in result["rows"]}
    names = ["triton varlen (the engine's over cached keys)", "torch fallback (gather, SDPA per sequence)",
             "sdpa, padded batch, contiguous K/V", "flash varlen, contiguous K/V"]
    names += ["flash varlen (the engine's for fresh chunks)"] if prefix == 0 else []
    names += ["flash varlen, paged (block table)"]
    assert list(rows)[:len(names)] == names
    for name in names:
        assert rows[name]["status"] == "ok" and rows[name]["relative_error"] < 1e-5, (name, rows[name])
        assert rows[name]["ms"] > 0 and rows[name]["tflops"] > 0
    xformers = rows["xformers, block-diagonal causal"]
    assert xformers["status"] == "ok" if importlib.util.find_spec("xformers") else xformers["status"] == "failed"


def test_depth_elastic_compares_the_policies_at_twice_the_rate_fixed_sustains():
    """fixed sustains a rate while at least 90% of its requests meet the TPOT target at it and every
    lower rate (a dip above does not count); the p99 reading is kept beside it."""
    import depth_elastic

    def summary(good, p99, goodput):
        return {"summary": {"good_requests": good, "completed": 100, "failed": 0, "tpot_ms": {"p99": p99},
                            "goodput": goodput, "mean_depth": 3.0}}

    runs = [{"request_rate": rate, "fixed": summary(good, p99, rate * good / 100), "slo": summary(100, 50, rate)}
            for rate, good, p99 in ((2, 100, 55), (3, 95, 62), (4, 92, 70), (5, 80, 90), (6, 91, 95), (8, 30, 150))]
    result = depth_elastic.comparison(runs, 60.0)
    assert result["fixed_sustained_rate"] == 4 and result["fixed_sustained_rate_by_p99"] == 2
    twice = result["at_twice_the_rate"]
    assert twice["request_rate"] == 8 and twice["goodput_ratio"] == pytest.approx(8 / 2.4)
    assert twice["fixed"]["slo_attainment"] == 0.3 and twice["slo"]["p99_tpot_ms"] == 50
    assert result["at_twice_the_rate_by_p99"]["request_rate"] == 4
    assert depth_elastic.comparison(runs[3:], 60.0)["at_twice_the_rate"] is None  # fixed sustains no rate run


def test_decode_profile_counts_busy_time_once_and_subtracts_the_prefill_run():
    import profile_decode

    assert profile_decode.busy_us([(0, 4), (2, 6), (10, 11), (3, 5)]) == 7  # overlaps counted once
    short = {"wall_us": 1000.0, "busy_us": 400.0, "launches": 10, "graph_launches": 1,
             "per_name": {"gemm": [4, 200.0], "attn": [2, 100.0]}}
    long = {"wall_us": 5000.0, "busy_us": 2400.0, "launches": 14, "graph_launches": 5,
            "per_name": {"gemm": [12, 1000.0], "attn": [6, 500.0], "argmax": [4, 40.0]}}
    step = profile_decode.per_step(long, short, 4, on_device=True)
    assert step["wall_ms_per_step"] == pytest.approx(1.0) and step["gpu_busy_ms_per_step"] == pytest.approx(0.5)
    assert step["gpu_busy_fraction"] == pytest.approx(0.5)
    assert step["kernels_per_step"] == 4 and step["graph_launch_calls_per_step"] == 1
    assert [k["name"] for k in step["top_kernels"]] == ["gemm", "attn", "argmax"]
    assert step["top_kernels"][0]["ms_per_step"] == pytest.approx(0.2)


def test_the_ab_ratio_cancels_which_side_steps_first():
    """bench/ab.py: B truly 10% slower, and whichever side steps second 30% slower still: each
    order's median is off by 1.3x, their geometric mean is 1.1 exactly, and its interval holds it."""
    import ab

    true_ratio, second_penalty = 1.1, 1.3
    a_first = [math.log(true_ratio * second_penalty * (1 + 0.01 * (i % 5 - 2))) for i in range(50)]
    b_first = [math.log(true_ratio / second_penalty * (1 + 0.01 * (i % 7 - 3))) for i in range(50)]
    assert ab.order_balanced_ratio(a_first, b_first) == pytest.approx(true_ratio, rel=1e-9)
    low, high = ab.bootstrap_interval(a_first, b_first, seed=0, rounds=400)
    assert low <= true_ratio <= high and high / low < 1.05


def _git_ignores(path: Path) -> bool:
    repo = Path(__file__).resolve().parents[1]
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout: nothing to ignore")
    import subprocess

    return subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=repo).returncode == 0


def test_quick_results_and_their_charts_go_to_a_git_ignored_folder():
    """`make bench` (every --quick run, then plot.py --quick) never writes over a committed result or chart."""
    import plot

    quick = common.result_path("throughput-cpu-quick")
    assert quick.parent == common.QUICK_RESULTS_DIR and _git_ignores(quick)
    assert _git_ignores(common.QUICK_RESULTS_DIR / "plots" / "throughput-cpu-quick.png")
    committed = common.result_path("throughput-cpu-xeon-2core")
    assert committed.parent == common.RESULTS_DIR and not _git_ignores(committed)
    assert plot.parse_args(["--quick"]).results_dir == common.QUICK_RESULTS_DIR
    assert plot.parse_args([]).results_dir == common.RESULTS_DIR


def test_write_result_puts_a_quick_run_beside_no_committed_result(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(common, "QUICK_RESULTS_DIR", tmp_path / "quick")
    assert common.write_result("depth-elastic-cpu-2core-quick", {"a": 1}) == tmp_path / "quick" / "depth-elastic-cpu-2core-quick.json"
    assert json.loads((tmp_path / "quick" / "depth-elastic-cpu-2core-quick.json").read_text()) == {"a": 1}
    assert [path.name for path in tmp_path.iterdir()] == ["quick"]


def test_quick_depth_elastic_needs_no_data_set():
    """Without --model, --quick serves the built-in demo-dreamer on held-out demo problems, not ../shared/data."""
    import depth_elastic

    ns = depth_elastic.parse_args(["--quick", "--dataset", "/nonexistent/prompts.jsonl"])
    assert ns.model == "demo-dreamer" and ns.demo_task
    from depthserve.loading.registry import BUILTIN_MODELS

    assert ns.model in BUILTIN_MODELS


def test_quick_throughput_decodes_more_tokens_than_each_prompt_prefills():
    """Decode is t(output + 1) - t(1): a quick run whose decode is small beside its prefill loses it in
    the 1-token runs' spread (8 sequences: t(17 tokens) <= t(1 token))."""
    import throughput

    ns = throughput.parse_args(["--quick"])
    assert ns.output_len >= ns.input_len and ns.repeats >= 3
    assert [int(b) for b in ns.batch_sizes.split(",")] == [1, 8]
