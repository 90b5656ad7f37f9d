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
steps compiled at static shapes, on CUDA replayed as CUDA graphs, with its default steps ahead, or
`--scheduler-steps`), `--compiled-one-step` (the same, one decode step per engine step), `--hf-compiled` (transformers'
static cache, which its generate compiles on CUDA), `--anchor` (bench/anchor.py: a plain Llama
with a static KV cache, its decode step compiled with CUDA graphs, gpt-fast style: the speed
paging, continuous batching and depth support should not cost), `--llamacpp` (llama.cpp through
llama-cpp-python on the same GGUF file and the same token ids, with the engine's thread count: the
CPU baseline; build it with `make llamacpp`). On CUDA the result also gives the
batch-1 bandwidth floor: the weights' bytes over the device's measured copy rate.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PROBE_SAMPLES = 3  # matmul-floor readings per repeat


# --quick: decode is t(output + 1) - t(1), so it must outweigh the prompt's prefill in t(1) by a margin
# the machine's noise cannot close (with 128-token prompts and 16 tokens, 8 sequences' decode was
# often lost in the 1-token runs' spread).
QUICK_INPUT_LEN, QUICK_OUTPUT_LEN, QUICK_REPEATS = 32, 32, 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "int8", "int4"],
                   help="the engine's weight format (docs/quantization.md)")
    p.add_argument("--engine-fp32", action="store_true",
                   help="also time the engine with fp32 activations and dequantized weights (the CPU path "
                        "before quantized weights), taking turns with the others")
    p.add_argument("--threads", type=int, default=None, help="torch threads for both systems (CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine per-step token budget")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--compiled", action="store_true",
                   help="also time the engine with decode steps compiled at static shapes (enforce_eager=False), "
                        "taking turns with the eager engine and transformers")
    p.add_argument("--scheduler-steps", type=int, default=None,
                   help="the compiled engine's num_scheduler_steps (decode steps run ahead per engine step; "
                        "default: the engine's, 8 with CUDA graphs)")
    p.add_argument("--compiled-one-step", action="store_true",
                   help="also time the compiled engine one decode step at a time (num_scheduler_steps=1)")
    p.add_argument("--no-eager", action="store_true",
                   help="leave the eager engine out of the timed systems (with --compiled: on CUDA it is launch-bound, "
                        "and its turns take most of a run's time)")
    p.add_argument("--hf-compiled", action="store_true",
                   help="also time transformers with its static cache (compiled by its generate on CUDA)")
    p.add_argument("--anchor", action="store_true",
                   help="also time bench/anchor.py, a plain static-cache decoder of the same weights, compiled")
    p.add_argument("--llamacpp", action="store_true",
                   help="also time llama.cpp (llama-cpp-python, built by `make llamacpp`) on the same GGUF file, "
                        "with the engine's thread count")
    p.add_argument("--llamacpp-gguf", default=None,
                   help="the GGUF file llama.cpp loads (default: the file behind --model, which must be a GGUF)")
    p.add_argument("--quick", action="store_true", help=f"concurrency 1 and 8, input {QUICK_INPUT_LEN}, "
                   f"output {QUICK_OUTPUT_LEN}, {QUICK_REPEATS} repeats")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result name under bench/results (default: throughput-<device>)")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.batch_sizes, ns.input_len, ns.output_len, ns.repeats = "1,8", QUICK_INPUT_LEN, QUICK_OUTPUT_LEN, QUICK_REPEATS
    return ns


class EngineRunner:
    def __init__(self, ns: argparse.Namespace, max_batch: int, compiled: bool = False, fp32: bool = False,
                 one_step: bool = False):
        from depthserve import LLM

        self.name = ("engine_fp32" if fp32 else "engine_compiled_1step" if one_step
                     else "engine_compiled" if compiled else "engine")
        formats = {"dtype": "float32", "quantization": "none"} if fp32 else {"dtype": ns.dtype, "quantization": ns.quantization}

        extra = {}
        if ns.max_num_batched_tokens:
            extra["max_num_batched_tokens"] = ns.max_num_batched_tokens
        if compiled and (one_step or ns.scheduler_steps):
            extra["num_scheduler_steps"] = 1 if one_step else ns.scheduler_steps
        # Prefix caching off: every repeat must prefill its prompts again.
        self.llm = LLM(ns.model, device=ns.device, num_threads=ns.threads,
                       max_num_seqs=max(max_batch, 1), enable_prefix_caching=False,
                       max_model_len=ns.input_len + ns.output_len + 8, load_progress=False,
                       enforce_eager=not compiled, **formats, **extra)
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


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's low-level API, as llama.cpp's own batched tools drive it:
    every prompt its own sequence id in one llama_batch, prefilled together (at most n_batch tokens
    per llama_decode), then one llama_decode per step with one token of every sequence, each picked
    by llama.cpp's greedy sampler. One context per concurrency level, its KV cache emptied before
    each generation."""

    name = "llamacpp"

    def __init__(self, gguf: Path, threads: int, max_len: int):
        import llama_cpp

        # llama-cpp-python's log callback prints llama.cpp's load-time chatter unless its logger is quieter.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self.lib = llama_cpp
        self.threads, self.max_len = threads, max_len
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf}")
        self.sampler = llama_cpp.llama_sampler_init_greedy()
        self.context = None
        self.concurrency = 0
        self.batch = None
        self.n_batch = 0  # the most tokens one llama_decode takes, read from each context
        self.last_tokens: list[list[int]] = []  # the last generation's tokens, per prompt

    def _prepare(self, concurrency: int) -> None:
        if self.concurrency == concurrency:
            return
        self.close_context()
        params = self.lib.llama_context_default_params()
        # llama.cpp pads the context to a multiple of 256 and splits it evenly between the sequences.
        params.n_ctx = concurrency * 256 * math.ceil(self.max_len / 256)
        params.n_seq_max = concurrency
        params.n_threads = params.n_threads_batch = self.threads
        self.context = self.lib.llama_init_from_model(self.model, params)
        if not self.context:
            raise SystemExit(f"llama.cpp could not create a context for {concurrency} sequences")
        self.n_batch = self.lib.llama_n_batch(self.context)
        self.batch = self.lib.llama_batch_init(self.n_batch, 0, 1)
        self.concurrency = concurrency

    def close_context(self) -> None:
        if self.context is not None:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.context)
            self.context, self.batch, self.concurrency = None, None, 0

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        self._prepare(len(prompts))
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.context), False)
        tokens: list[list[int]] = [[] for _ in prompts]
        for chunk in batch_chunks(prefill_entries(prompts), self.n_batch):
            self._decode_and_sample(chunk, tokens)
        for step in range(new_tokens - 1):
            self._decode_and_sample(decode_entries(tokens, [len(p) + step for p in prompts]), tokens)
        assert all(len(t) == new_tokens for t in tokens)
        self.last_tokens = tokens

    def _decode_and_sample(self, entries: list[tuple[int, int, int, bool]], tokens: list[list[int]]) -> None:
        """One llama_decode of `entries` (token, position, sequence, wants logits); the sequences
        whose logits it asked for get their next token appended."""
        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, position, sequence, wants_logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0] = sequence
            batch.logits[i] = wants_logits
        status = self.lib.llama_decode(self.context, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        for i, (_, _, sequence, wants_logits) in enumerate(entries):
            if wants_logits:
                tokens[sequence].append(self.lib.llama_sampler_sample(self.sampler, self.context, i))

    def describe(self) -> dict:
        description = ctypes.create_string_buffer(256)
        self.lib.llama_model_desc(self.model, description, len(description))
        return {"version": self.lib.__version__, "model": description.value.decode(),
                "model_bytes": self.lib.llama_model_size(self.model), "threads": self.threads,
                "system_info": self.lib.llama_print_system_info().decode().strip()}


def prefill_entries(prompts: list[list[int]]) -> list[tuple[int, int, int, bool]]:
    """(token, position, sequence, wants logits) for every prompt token, prompt after prompt;
    logits only at each prompt's last token."""
    return [(token, position, sequence, position == len(prompt) - 1)
            for sequence, prompt in enumerate(prompts) for position, token in enumerate(prompt)]


def decode_entries(tokens: list[list[int]], positions: list[int]) -> list[tuple[int, int, int, bool]]:
    """One decode step: every sequence's newest token at its position, all wanting logits."""
    return [(generated[-1], position, sequence, True)
            for sequence, (generated, position) in enumerate(zip(tokens, positions))]


def batch_chunks(entries: list, size: int) -> list[list]:
    """`entries` in consecutive pieces of at most `size` (llama_decode takes at most n_batch tokens)."""
    return [entries[i:i + size] for i in range(0, len(entries), size)]


def llamacpp_gguf(ns: argparse.Namespace) -> Path:
    """The GGUF file llama.cpp should load: --llamacpp-gguf, else the file the engine's --model names."""
    if ns.llamacpp_gguf:
        return Path(ns.llamacpp_gguf)
    from depthserve.loading.registry import resolve_model

    source = resolve_model(ns.model)
    if source.format != "gguf":
        raise SystemExit(f"--llamacpp needs a GGUF model; {ns.model} is a {source.format} checkpoint "
                         "(pass --llamacpp-gguf FILE)")
    return source.path


def llamacpp_runner(ns: argparse.Namespace, threads: int) -> LlamaCppRunner:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"--llamacpp needs llama-cpp-python ({exc}); build it with `make llamacpp` "
                         "(docs/benchmarks.md)") from exc
    return LlamaCppRunner(llamacpp_gguf(ns), threads, ns.input_len + ns.output_len + 1)


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
    one_step = EngineRunner(ns, max(batch_sizes), compiled=True, one_step=True) if ns.compiled_one_step else None
    hf_model = (common.load_hf_model(ns.model, engine.dtype, str(engine.device))
                if not ns.no_hf or ns.hf_compiled or ns.anchor else None)
    hf = None if ns.no_hf else HFRunner(hf_model, engine.device)
    extra = ([HFRunner(hf_model, engine.device, static_cache=True)] if ns.hf_compiled else []) + (
        [AnchorRunner(hf_model, ns.input_len + ns.output_len + 1)] if ns.anchor else [])
    # The engine set torch's threads (--threads, else torch's default): llama.cpp gets as many.
    llamacpp = llamacpp_runner(ns, torch.get_num_threads()) if ns.llamacpp else None
    extra += [llamacpp] if llamacpp is not None else []
    extra += [EngineRunner(ns, max(batch_sizes), fp32=True)] if ns.engine_fp32 else []
    timed_engine = None if ns.no_eager else engine
    runners = [r for r in (timed_engine, compiled, one_step, hf) if r is not None] + extra

    name = ns.out or f"throughput-{common.device_slug(str(engine.device))}" + ("-quick" if ns.quick else "")
    rows = []
    for concurrency in batch_sizes:
        prompts = common.random_prompts(concurrency, ns.input_len, engine.vocab_size, ns.seed + concurrency)
        row: dict = {"concurrency": concurrency}
        figures, matmul_ms = measure(runners, prompts, ns.output_len, ns.repeats, sync,
                                     probe=matmul_probe(engine, concurrency, sync))
        e = figures.get("engine", {"decode_tok_s": None, "prefill_tok_s": None})
        row.update({"engine_decode_tok_s": e["decode_tok_s"], "engine_prefill_tok_s": e["prefill_tok_s"]})
        if hf is not None:
            h = figures["hf"]
            row.update({
                "hf_decode_tok_s": h["decode_tok_s"], "hf_prefill_tok_s": h["prefill_tok_s"],
                "decode_ratio": e["decode_tok_s"] / h["decode_tok_s"] if e["decode_tok_s"] and h["decode_tok_s"] else None,
                "prefill_ratio": e["prefill_tok_s"] / h["prefill_tok_s"] if e["prefill_tok_s"] else None,
            })
        if compiled is not None:
            c = figures["engine_compiled"]
            row.update({"compiled_decode_tok_s": c["decode_tok_s"], "compiled_prefill_tok_s": c["prefill_tok_s"]})
            if hf is not None and c["decode_tok_s"] and h["decode_tok_s"]:
                row["compiled_decode_ratio"] = c["decode_tok_s"] / h["decode_tok_s"]
                row["compiled_prefill_ratio"] = c["prefill_tok_s"] / h["prefill_tok_s"]
        if one_step is not None:
            o = figures["engine_compiled_1step"]
            row.update({"compiled_1step_decode_tok_s": o["decode_tok_s"], "compiled_1step_prefill_tok_s": o["prefill_tok_s"]})
        for runner in extra:  # hf_compiled, anchor, llamacpp: their figures, and the engine's against them
            row.update(baseline_columns(runner.name, figures[runner.name], e, row.get("compiled_decode_tok_s")))
        row.update(matmul_floor(matmul_ms, h if hf is not None else None))
        row["raw"] = figures
        rows.append(row)
        print(_format_row(row), flush=True)
        # Written after every row: a run interrupted at its time limit keeps the rows it finished.
        common.write_result(name, result_payload(ns, engine, rows, llamacpp, complete=False))

    payload = result_payload(ns, engine, rows, llamacpp, complete=True)
    if engine.device.type == "cuda":
        payload["bandwidth_floor"] = bandwidth_floor(engine.llm.engine.model, engine.device)
        print(f"batch-1 bandwidth floor: {payload['bandwidth_floor']['batch1_floor_tok_s']:.0f} tok/s "
              f"({payload['bandwidth_floor']['batch1_floor_ms_per_step'] * 1000:.0f} us per step)")
    print(f"wrote {common.write_result(name, payload)}")
    return 0


def result_payload(ns: argparse.Namespace, engine: EngineRunner, rows: list[dict],
                   llamacpp: LlamaCppRunner | None, complete: bool) -> dict:
    payload = {
        "benchmark": "throughput",
        "settings": {k: v for k, v in vars(ns).items()},
        "engine": {"device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", ""),
                   "quantization": engine.llm.engine.quantization.summary(),
                   "weights_resident_bytes": engine.llm.engine.quantization.resident_bytes},
        "environment": common.environment(str(engine.device), ns.threads),
        "rows": rows,
        "complete": complete,
    }
    if llamacpp is not None:
        payload["llamacpp"] = {**llamacpp.describe(), "gguf": str(llamacpp_gguf(ns))}
    return payload


def baseline_columns(name: str, baseline: dict, engine: dict, compiled_decode: float | None) -> dict:
    """A baseline's row columns: its prefill and decode tokens/s, the engine's best decode (eager or
    compiled) over its decode, and the engine's prefill over its prefill."""
    columns = {f"{name}_decode_tok_s": baseline["decode_tok_s"], f"{name}_prefill_tok_s": baseline["prefill_tok_s"]}
    best = max((x for x in (engine["decode_tok_s"], compiled_decode) if x), default=None)
    if best and baseline["decode_tok_s"]:
        columns[f"engine_best_decode_over_{name}"] = best / baseline["decode_tok_s"]
    if engine["prefill_tok_s"]:
        columns[f"engine_prefill_over_{name}"] = engine["prefill_tok_s"] / baseline["prefill_tok_s"]
    return columns


def _format_row(row: dict) -> str:
    text = (f"concurrency {row['concurrency']:>3}: engine prefill {_figure(row['engine_prefill_tok_s'], 8, 1)} tok/s, "
            f"decode {_figure(row['engine_decode_tok_s'], 7, 1)} tok/s")
    if "hf_decode_tok_s" in row:
        text += (f" | transformers prefill {row['hf_prefill_tok_s']:8.1f}, decode {_figure(row['hf_decode_tok_s'], 7, 1)}"
                 f" | decode ratio {_figure(row['decode_ratio'], 0, 2)}, prefill ratio {_figure(row['prefill_ratio'], 0, 2)}"
                 f" (matmuls alone {row['engine_decode_matmul_ms_per_step']:.1f} ms/step: decode ratio"
                 f" <= {_figure(row.get('decode_ratio_if_only_matmuls'), 0, 2)})")
    if "compiled_decode_tok_s" in row:
        text += (f"\n                 compiled: prefill {row['compiled_prefill_tok_s']:8.1f} tok/s, decode "
                 f"{_figure(row['compiled_decode_tok_s'], 7, 1)} tok/s, decode ratio "
                 f"{_figure(row.get('compiled_decode_ratio'), 0, 2)}")
    if "compiled_1step_decode_tok_s" in row:
        text += f"; one step at a time: decode {_figure(row['compiled_1step_decode_tok_s'], 7, 1)} tok/s"
    for name in ("hf_compiled", "anchor", "llamacpp"):
        if f"{name}_decode_tok_s" in row:
            text += (f"\n                 {name}: prefill {row[f'{name}_prefill_tok_s']:8.1f} tok/s, decode "
                     f"{_figure(row[f'{name}_decode_tok_s'], 7, 1)} tok/s; engine's best decode / {name}: "
                     f"{_figure(row.get(f'engine_best_decode_over_{name}'), 0, 2)}, engine's prefill / {name}: "
                     f"{_figure(row.get(f'engine_prefill_over_{name}'), 0, 2)}")
    return text


def _figure(value: float | None, width: int, decimals: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{decimals}f}"


if __name__ == "__main__":
    sys.exit(main())
