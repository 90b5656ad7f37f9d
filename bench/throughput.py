"""Offline throughput: prefill and decode tokens/s, engine vs transformers, same weights, one run.

    python bench/throughput.py                      # SmolLM2, concurrency 1, 8, 32, input 128, output 64
    python bench/throughput.py --quick              # a fast smoke version (make bench)
    python bench/throughput.py --model DIR --batch-sizes 1,64,256 --device cuda
    python bench/throughput.py --device cuda --dtype bfloat16 --compiled --hf-compiled --anchor \
        --batch-sizes 1,8,32,64,256                # the GPU comparison (docs/gpu.md)

Method (the same for both systems): a batch of `concurrency` prompts of `input_len` random
tokens is generated greedily with EOS ignored, once with 1 new token and once with
`output_len + 1`. Prefill tokens/s = prompt tokens / t(1). Decode tokens/s =
concurrency * output_len / (t(output_len + 1) - t(1)), so prefill is subtracted out the same
way for both. Each time is the median of `--repeats` runs after one warm-up run; the two
systems take turns within each repeat, so a slow spell of the machine hits both.
After the two systems in each repeat, the engine's weight matmuls of one decode step (every
layer's projections and the LM head on `concurrency` rows) are timed alone, 3 times: transformers'
decode step time over their median gives the decode ratio that the engine could reach if
everything else in its step were free.

Optional systems, each taking its turn in the same repeats: `--compiled` (the engine's decode
steps compiled at static shapes, on CUDA replayed as CUDA graphs), `--hf-compiled` (transformers'
static cache, which its generate compiles on CUDA), `--anchor` (bench/anchor.py: a plain Llama
with a static KV cache, its decode step compiled with CUDA graphs, gpt-fast style: the speed
paging, continuous batching and depth support should not cost). On CUDA the result also gives the
batch-1 bandwidth floor: the weights' bytes over the device's measured copy rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PROBE_SAMPLES = 3  # matmul-floor readings per repeat


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads for both systems (CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine per-step token budget")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--compiled", action="store_true",
                   help="also time the engine with decode steps compiled at static shapes (enforce_eager=False), "
                        "taking turns with the eager engine and transformers")
    p.add_argument("--hf-compiled", action="store_true",
                   help="also time transformers with its static cache (compiled by its generate on CUDA)")
    p.add_argument("--anchor", action="store_true",
                   help="also time bench/anchor.py, a plain static-cache decoder of the same weights, compiled")
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 8, output 16, 2 repeats")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result name under bench/results (default: throughput-<device>)")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.batch_sizes, ns.output_len, ns.repeats = "1,8", 16, 2
    return ns


class EngineRunner:
    def __init__(self, ns: argparse.Namespace, max_batch: int, compiled: bool = False):
        from depthserve import LLM

        self.name = "engine_compiled" if compiled else "engine"

        extra = {}
        if ns.max_num_batched_tokens:
            extra["max_num_batched_tokens"] = ns.max_num_batched_tokens
        # Prefix caching off: every repeat must prefill its prompts again.
        self.llm = LLM(ns.model, dtype=ns.dtype, device=ns.device, num_threads=ns.threads,
                       max_num_seqs=max(max_batch, 1), enable_prefix_caching=False,
                       max_model_len=ns.input_len + ns.output_len + 8, load_progress=False,
                       enforce_eager=not compiled, **extra)
        self.device = self.llm.engine.device
        self.dtype = self.llm.engine.dtype
        self.vocab_size = self.llm.engine.vocab_size

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        from depthserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        outs = self.llm.generate(prompts, params)
        assert all(len(o.token_ids) == new_tokens for o in outs)


class HFRunner:
    """transformers' generate; with `static_cache`, its static KV cache (which generate compiles on CUDA)."""

    def __init__(self, model, device: torch.device, static_cache: bool = False):
        self.name = "hf_compiled" if static_cache else "hf"
        self.model, self.device = model, device
        self.options = {"cache_implementation": "static"} if static_cache else {}

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(prompts, device=self.device)  # equal lengths: no padding needed
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
                                  **self.options)
        assert out.shape[1] == ids.shape[1] + new_tokens


class AnchorRunner:
    """bench/anchor.py on the same weights: one generator (static cache, compiled step) per batch size."""

    name = "anchor"

    def __init__(self, hf_model, max_len: int):
        self.hf_model, self.max_len = hf_model, max_len
        self.generators: dict[int, object] = {}

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        from anchor import AnchorGenerator

        batch = len(prompts)
        if batch not in self.generators:
            self.generators.clear()  # one batch size's caches at a time
            self.generators[batch] = AnchorGenerator(self.hf_model, batch, self.max_len, compile_decode=True)
        out = self.generators[batch].generate(prompts, new_tokens)
        assert out.shape == (batch, new_tokens)


def bandwidth_floor(model: torch.nn.Module, device: torch.device) -> dict:
    """The fastest a batch-1 decode step can be: every weight read once at the measured copy rate."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    weight_bytes = sum(storages.values())
    rate = common.device_copy_rate(device)
    return {"weight_bytes": weight_bytes, "copy_rate_bytes_per_s": rate,
            "batch1_floor_ms_per_step": 1000 * weight_bytes / rate, "batch1_floor_tok_s": rate / weight_bytes}


def measure(runners: list, prompts: list[list[int]], output_len: int, repeats: int, sync,
            probe: Callable[[], float] | None = None) -> tuple[dict[str, dict], list[float]]:
    """Time every runner on the same prompts, the runners taking turns within each repeat, and
    take `PROBE_SAMPLES` readings of `probe` (a figure in ms) after them in each repeat.

    Taking turns (engine, transformers, engine, ...) rather than timing one system's repeats
    and then the other's keeps a slow spell of the machine from landing on one side only.
    """
    for runner in runners:
        runner.generate(prompts, output_len + 1)  # warm-up (allocations, kernel choice)
    first = {runner.name: [] for runner in runners}
    full = {runner.name: [] for runner in runners}
    probed: list[float] = []
    for _ in range(repeats):
        for runner in runners:
            first[runner.name].append(common.timed(lambda: runner.generate(prompts, 1), sync))
            full[runner.name].append(common.timed(lambda: runner.generate(prompts, output_len + 1), sync))
        if probe is not None:
            probed.extend(probe() for _ in range(PROBE_SAMPLES))
    figures = {runner.name: _figures(runner.name, first[runner.name], full[runner.name], len(prompts),
                                     len(prompts[0]), output_len) for runner in runners}
    return figures, probed


def _figures(name: str, first: list[float], full: list[float], concurrency: int, input_len: int, output_len: int) -> dict:
    t_first, t_full = statistics.median(first), statistics.median(full)
    decode_seconds = t_full - t_first
    measured = decode_seconds > 0  # not so after a slow spell of the machine in the 1-token runs
    if not measured:
        print(f"warning: t({output_len + 1} tokens) <= t(1 token) for {name} at concurrency {concurrency}; "
              "decode not measured (use more --repeats)", file=sys.stderr)
    return {
        "prefill_tok_s": concurrency * input_len / t_first,
        "decode_tok_s": concurrency * output_len / decode_seconds if measured else None,
        "decode_ms_per_step": 1000 * decode_seconds / output_len if measured else None,
        "t_1_token_s": first,
        f"t_{output_len + 1}_tokens_s": full,
    }


def matmul_probe(engine: EngineRunner, concurrency: int, sync) -> Callable[[], float]:
    """One reading of the engine's weight matmuls of a decode step (every layer's projections and
    the LM head on `concurrency` rows) timed alone, in ms."""
    model = engine.llm.engine.model
    return lambda: common.layer_matmuls_ms(model, list(model.layers), concurrency, 1, sync, lm_head=True)


def matmul_floor(samples: list[float], hf: dict | None) -> dict:
    """The median matmul time of a decode step, and the decode ratio the engine would reach if all
    the rest of its step took no time: how much room the matmul kernels leave."""
    floor_ms = statistics.median(samples)
    out = {"engine_decode_matmul_ms_per_step": floor_ms, "engine_decode_matmul_ms_samples": samples}
    if hf is not None and hf["decode_ms_per_step"]:
        out["decode_ratio_if_only_matmuls"] = hf["decode_ms_per_step"] / floor_ms
    return out


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    batch_sizes = [int(b) for b in ns.batch_sizes.split(",")]
    engine = EngineRunner(ns, max(batch_sizes))
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    compiled = EngineRunner(ns, max(batch_sizes), compiled=True) if ns.compiled else None
    hf_model = (common.load_hf_model(ns.model, engine.dtype, str(engine.device))
                if not ns.no_hf or ns.hf_compiled or ns.anchor else None)
    hf = None if ns.no_hf else HFRunner(hf_model, engine.device)
    extra = ([HFRunner(hf_model, engine.device, static_cache=True)] if ns.hf_compiled else []) + (
        [AnchorRunner(hf_model, ns.input_len + ns.output_len + 1)] if ns.anchor else [])
    runners = [r for r in (engine, compiled, hf) if r is not None] + extra

    rows = []
    for concurrency in batch_sizes:
        prompts = common.random_prompts(concurrency, ns.input_len, engine.vocab_size, ns.seed + concurrency)
        row: dict = {"concurrency": concurrency}
        figures, matmul_ms = measure(runners, prompts, ns.output_len, ns.repeats, sync,
                                     probe=matmul_probe(engine, concurrency, sync))
        e = figures["engine"]
        row.update({"engine_decode_tok_s": e["decode_tok_s"], "engine_prefill_tok_s": e["prefill_tok_s"]})
        if hf is not None:
            h = figures["hf"]
            row.update({
                "hf_decode_tok_s": h["decode_tok_s"], "hf_prefill_tok_s": h["prefill_tok_s"],
                "decode_ratio": e["decode_tok_s"] / h["decode_tok_s"] if e["decode_tok_s"] and h["decode_tok_s"] else None,
                "prefill_ratio": e["prefill_tok_s"] / h["prefill_tok_s"],
            })
        if compiled is not None:
            c = figures["engine_compiled"]
            row.update({"compiled_decode_tok_s": c["decode_tok_s"], "compiled_prefill_tok_s": c["prefill_tok_s"]})
            if hf is not None and c["decode_tok_s"] and h["decode_tok_s"]:
                row["compiled_decode_ratio"] = c["decode_tok_s"] / h["decode_tok_s"]
        for runner in extra:  # hf_compiled, anchor: their figures, and the engine's best decode against them
            f = figures[runner.name]
            row.update({f"{runner.name}_decode_tok_s": f["decode_tok_s"], f"{runner.name}_prefill_tok_s": f["prefill_tok_s"]})
            best = max((x for x in (e["decode_tok_s"], row.get("compiled_decode_tok_s")) if x), default=None)
            if best and f["decode_tok_s"]:
                row[f"engine_best_decode_over_{runner.name}"] = best / f["decode_tok_s"]
        row.update(matmul_floor(matmul_ms, h if hf is not None else None))
        row["raw"] = figures
        rows.append(row)
        print(_format_row(row), flush=True)

    payload = {
        "benchmark": "throughput",
        "settings": {k: v for k, v in vars(ns).items()},
        "engine": {"device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", "")},
        "environment": common.environment(str(engine.device), ns.threads),
        "rows": rows,
    }
    if engine.device.type == "cuda":
        payload["bandwidth_floor"] = bandwidth_floor(engine.llm.engine.model, engine.device)
        print(f"batch-1 bandwidth floor: {payload['bandwidth_floor']['batch1_floor_tok_s']:.0f} tok/s "
              f"({payload['bandwidth_floor']['batch1_floor_ms_per_step'] * 1000:.0f} us per step)")
    name = ns.out or f"throughput-{common.device_slug(str(engine.device))}" + ("-quick" if ns.quick else "")
    print(f"wrote {common.write_result(name, payload)}")
    return 0


def _format_row(row: dict) -> str:
    text = (f"concurrency {row['concurrency']:>3}: engine prefill {row['engine_prefill_tok_s']:8.1f} tok/s, "
            f"decode {_figure(row['engine_decode_tok_s'], 7, 1)} tok/s")
    if "hf_decode_tok_s" in row:
        text += (f" | transformers prefill {row['hf_prefill_tok_s']:8.1f}, decode {_figure(row['hf_decode_tok_s'], 7, 1)}"
                 f" | decode ratio {_figure(row['decode_ratio'], 0, 2)}, prefill ratio {row['prefill_ratio']:.2f}"
                 f" (matmuls alone {row['engine_decode_matmul_ms_per_step']:.1f} ms/step: decode ratio"
                 f" <= {_figure(row.get('decode_ratio_if_only_matmuls'), 0, 2)})")
    if "compiled_decode_tok_s" in row:
        text += (f"\n                 compiled: prefill {row['compiled_prefill_tok_s']:8.1f} tok/s, decode "
                 f"{_figure(row['compiled_decode_tok_s'], 7, 1)} tok/s, decode ratio "
                 f"{_figure(row.get('compiled_decode_ratio'), 0, 2)}")
    for name in ("hf_compiled", "anchor"):
        if f"{name}_decode_tok_s" in row:
            text += (f"\n                 {name}: prefill {row[f'{name}_prefill_tok_s']:8.1f} tok/s, decode "
                     f"{_figure(row[f'{name}_decode_tok_s'], 7, 1)} tok/s; engine's best decode / {name}: "
                     f"{_figure(row.get(f'engine_best_decode_over_{name}'), 0, 2)}")
    return text


def _figure(value: float | None, width: int, decimals: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{decimals}f}"


if __name__ == "__main__":
    sys.exit(main())
