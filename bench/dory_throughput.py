"""Dory decode throughput at its real shapes on the CPU, engine against transformers, in one run
(docs/benchmarks.md, "Serving looped models").

A random-weight checkpoint with transformers' DoryConfig() widths (the 4B model: hidden 2560, 16
heads, 4 KV heads, head_dim 256, intermediate 7168, vocab 131072; 8 + 20 + 8 layers, or that layer
count times `--layers-fraction`) is written once in bf16 safetensors into `--cache-dir` and reused.
Then, each in its own subprocess, one after the other (no two copies of the weights in memory at
once): the engine with bf16 activations serving the weights as bf16, int8 and int4
(`--quantization`), and transformers' DoryForCausalLM in bf16 (`generate` with its cache). Each
decodes 1 and 8 greedy sequences at loops 1, 2 and 4 with the same threads: the engine's step is the
median of `--rounds` x `--steps` timed steps, the loop counts taken in turn in each round (so that a
drift of the machine's speed over minutes, which a shared VM shows, falls on every loop count
alike), transformers' the median of three (generate 1 + steps tokens minus generate 1) / steps
samples.

Reported per format: decode tok/s and step time; the load's peak RSS and the resident weights;
the weight bytes one step reads ((prelude + coda + loops x recurrent layers) + the LM head) and
the floor they set at the read bandwidth probed in the same process right before each round of
that row's steps (a timed `torch.sum` over a 1 GiB buffer, the median of the row's probes; the VM's
rate drifts over minutes, so a run-wide figure would misplace the floors of some processes); the
step time that loops = 1 predicts for the other loop counts (the LM head's time, measured in each
step, held fixed; the rest scaled by the layers run, whose weight bytes and FLOPs are proportional
to their count); the KV bytes per token of both cache modes. Writes
bench/results/dory-throughput-<device>.json and its chart under bench/results/plots/.

    python bench/dory_throughput.py [--layers-fraction 1.0] [--steps 4] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUICK_SUFFIX, RESULTS_DIR, byte_prompts, cpu_kind_tag, environment, peak_rss_bytes, write_result  # noqa: E402
from looped_decode import (  # noqa: E402
    PROMPT_TOKENS, BandwidthProbe, HeadClock, anon_huge_page_bytes, time_decode)

FULL_LAYERS = (8, 20, 8)  # DoryConfig(): prelude, recurrent, coda
FORMATS = {"bf16": "none", "int8": "int8", "int4": "int4"}  # engine format -> --quantization
TRANSFORMERS_REPEATS = 3
BATCHES = (1, 8)
LOOPS = (1, 2, 4)
DEFAULT_CACHE = Path.home() / ".cache" / "depthserve"
SHARD_BYTES = 1 << 30


# ---- the checkpoint -------------------------------------------------------------------------------
def layer_counts(fraction: float) -> tuple[int, int, int]:
    return tuple(max(1, round(n * fraction)) for n in FULL_LAYERS)


def random_value(name: str, shape: tuple[int, ...], init: float, generator: torch.Generator) -> torch.Tensor:
    """Weights of the scale a trained model has (rows of norm ~1), the per-channel scales near
    their initial values, so that the activations stay finite."""
    if len(shape) == 2:
        return torch.randn(shape, generator=generator) / shape[1] ** 0.5
    low, high = {"lambda_1": (2 * init, 8 * init), "lambda_2": (2 * init, 8 * init), "sqk": (0.5 * init, 1.5 * init),
                 "s_gate": (0.5 * init, 1.5 * init), "logit_scale": (0.8 * init, 1.2 * init)}.get(
        name.rsplit(".", 1)[-1], (0.5, 1.5))
    return low + (high - low) * torch.rand(shape, generator=generator)


def make_checkpoint(out: Path, fraction: float) -> None:
    """config.json (transformers' own, dtype bf16), sharded bf16 safetensors with an index, a byte tokenizer."""
    from safetensors.torch import save_file
    from transformers import DoryConfig, DoryForCausalLM

    from depthserve.loading.tokenizer import byte_tokenizer

    n_in, n_rec, n_out = layer_counts(fraction)
    tokenizer = byte_tokenizer()
    config = DoryConfig(num_hidden_layers=n_in + n_rec + n_out, n_input_layers=n_in, n_recurrent_layers=n_rec,
                        n_output_layers=n_out, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                        bos_token_id=tokenizer.bos_token_id)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in DoryForCausalLM(config).state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shards, shard, size = [], {}, 0
    for name, shape in shapes.items():
        shard[name] = random_value(name, shape, config.initializer_range, generator).to(torch.bfloat16)
        size += shard[name].numel() * 2
        if size >= SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
    shards.append(shard)
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    total = sum(math.prod(shape) * 2 for shape in shapes.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


# ---- measurements (each in its own process) -------------------------------------------------------
def read_bandwidth(threads: int, repeats: int = 5) -> float:
    torch.set_num_threads(threads)
    return BandwidthProbe(repeats)()


def engine_worker(path: Path, quantization: str, steps: int, rounds: int, batches, loops_list) -> dict:
    from depthserve import LLM, DepthParams
    from depthserve.loading.quantization import resident_bytes

    start = time.perf_counter()
    llm = LLM(str(path), device="cpu", dtype="bfloat16", quantization=quantization, load_progress=False,
              max_model_len=PROMPT_TOKENS + steps + 8, block_size=16, enable_prefix_caching=False)
    load = {"seconds": time.perf_counter() - start, "peak_rss_bytes": peak_rss_bytes()}
    engine, model = llm.engine, llm.engine.model
    head = HeadClock(model.compute_logits)
    model.compute_logits = head
    weights = {"resident_bytes": engine.quantization.resident_bytes, "huge_page_bytes": anon_huge_page_bytes(),
               "layer_bytes": resident_bytes(model.layers[0]), "head_bytes": resident_bytes(model.lm_head),
               "summary": engine.quantization.summary()}
    probe = BandwidthProbe()
    rows = []
    for batch in batches:
        samples = {loops: ([], [], []) for loops in loops_list}  # step times, head times, bandwidth probes
        for round_index in range(rounds):  # the loop counts interleaved: the VM's drift hits each alike
            for loops in loops_list:
                samples[loops][2].append(probe())
                timing = time_decode(engine, batch, DepthParams(loops=loops), steps, f"b{batch}-l{loops}-r{round_index}",
                                     head)
                samples[loops][0].extend(timing.times)
                samples[loops][1].extend(timing.head_times)
                kv_bytes_per_token = timing.kv_bytes_per_token
        for loops, (times, head_times, probes) in samples.items():
            step = median(times)
            rows.append({"batch": batch, "loops": loops, "step_seconds": step, "step_seconds_all": times,
                         "head_seconds": median(head_times), "tokens_per_second": batch / step,
                         "kv_bytes_per_token": kv_bytes_per_token, "bandwidth_bytes_per_second": median(probes),
                         "bandwidth_probes": probes})
            print(f"  {quantization} batch {batch} loops {loops}: {1000 * step:.0f} ms/step", file=sys.stderr)
    return {"load": load, "weights": weights, "rows": rows}


@torch.inference_mode()
def transformers_worker(path: Path, steps: int, batches, loops_list) -> dict:
    from transformers import DoryForCausalLM

    start = time.perf_counter()
    model, info = DoryForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        raise RuntimeError(f"transformers did not read the checkpoint as written: {info}")
    load = {"seconds": time.perf_counter() - start, "peak_rss_bytes": peak_rss_bytes()}
    model.eval()
    head = HeadClock(model.lm_head.forward)
    model.lm_head.forward = head
    probe = BandwidthProbe()
    rows = []
    for batch in batches:
        for loops in loops_list:
            model.config.n_recurrent_loops = loops
            ids = torch.tensor(byte_prompts(batch, PROMPT_TOKENS))

            def generate(new_tokens: int) -> tuple[float, float]:
                head.seconds = 0.0
                begin = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
                return time.perf_counter() - begin, head.seconds

            generate(2)  # warm-up
            # decode steps alone: generating 1 + steps tokens against 1 (the prompt's forward), the median
            # of TRANSFORMERS_REPEATS such pairs (one pair is one sample; the engine's is a median of steps)
            samples, probes = [], []
            for _ in range(TRANSFORMERS_REPEATS):
                probes.append(probe())
                (many, many_head), (one, one_head) = generate(1 + steps), generate(1)
                samples.append(((many - one) / steps, (many_head - one_head) / steps))
            step, head_step = median(sample[0] for sample in samples), median(sample[1] for sample in samples)
            rows.append({"batch": batch, "loops": loops, "step_seconds": step, "step_seconds_all": [s[0] for s in samples],
                         "head_seconds": head_step, "tokens_per_second": batch / step,
                         "bandwidth_bytes_per_second": median(probes), "bandwidth_probes": probes})
            print(f"  transformers batch {batch} loops {loops}: {1000 * step:.0f} ms/step", file=sys.stderr)
    return {"load": load, "rows": rows}


def run_worker(args: argparse.Namespace, role: str) -> dict:
    """One measurement in a fresh process (its JSON on the last line of stdout)."""
    command = [sys.executable, __file__, "--worker", role, "--checkpoint", str(args.checkpoint), "--steps",
               str(args.steps), "--rounds", str(args.rounds), "--threads", str(args.threads), "--batches", ",".join(map(str, args.batches)),
               "--loops", ",".join(map(str, args.loops))]
    print(f"{role} ...", file=sys.stderr)
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    role = args.worker
    if role == "bandwidth":
        result = {"bytes_per_second": read_bandwidth(args.threads)}
    elif role == "transformers":
        result = transformers_worker(args.checkpoint, args.steps, args.batches, args.loops)
    else:
        result = engine_worker(args.checkpoint, FORMATS[role], args.steps, args.rounds, args.batches, args.loops)
    print(json.dumps(result))


# ---- the model of a step ---------------------------------------------------------------------------
def kv_bytes_per_token(counts: tuple[int, int, int], loops: int, mode: str, kv_width: int, dtype_bytes: int = 2) -> int:
    """Keys and values one token holds: every slot of its cache layout (format.plan)."""
    n_in, n_rec, n_out = counts
    slots = n_in + n_out + (loops * n_rec if mode == "per_loop" else n_rec)
    return slots * 2 * kv_width * dtype_bytes


def layers_run(counts: tuple[int, int, int], loops: int) -> int:
    n_in, n_rec, n_out = counts
    return n_in + n_out + loops * n_rec


def step_bytes(counts: tuple[int, int, int], loops: int, weights: dict) -> int:
    """Weight bytes one decode step reads: every layer it runs, the LM head (the embedding: one row)."""
    return layers_run(counts, loops) * weights["layer_bytes"] + weights["head_bytes"]


def analyse(counts, engines: dict, hf: dict, bandwidth: float) -> None:
    """Adds to each row its floor, the prediction from loops = 1 and the ratios docs/benchmarks.md reports."""
    for name, result in [*engines.items(), ("transformers", hf)]:
        weights = engines["bf16"]["weights"] if name == "transformers" else result["weights"]
        by_batch = {}
        for row in result["rows"]:
            by_batch.setdefault(row["batch"], {})[row["loops"]] = row
        for batch, rows in by_batch.items():
            base = rows.get(1)
            for loops, row in rows.items():
                row["weight_bytes_per_step"] = step_bytes(counts, loops, weights)
                row["floor_seconds"] = row["weight_bytes_per_step"] / row.get("bandwidth_bytes_per_second", bandwidth)
                row["step_over_floor"] = row["step_seconds"] / row["floor_seconds"]
                if base is not None:  # the head's time fixed, the layers' scaled by their count
                    layers = base["step_seconds"] - base["head_seconds"]
                    predicted = base["head_seconds"] + layers * layers_run(counts, loops) / layers_run(counts, 1)
                    row["predicted_from_loops_1_seconds"] = predicted
                    row["step_over_prediction"] = row["step_seconds"] / predicted
                hf_row = next((r for r in hf["rows"] if r["batch"] == batch and r["loops"] == loops), None)
                if hf_row is not None and name != "transformers":
                    row["speedup_over_transformers"] = hf_row["step_seconds"] / row["step_seconds"]


# ---- the chart ------------------------------------------------------------------------------------
def plot(payload: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plot import machine_line, save

    batches = payload["setup"]["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    results = {**payload["results"]["engine"], "transformers": payload["results"]["transformers"]}
    for ax, batch in zip(axes[0], batches):
        for name, result in results.items():
            rows = [r for r in result["rows"] if r["batch"] == batch]
            label = f"engine {name}" if name != "transformers" else "transformers bf16"
            ax.plot([r["loops"] for r in rows], [r["tokens_per_second"] for r in rows], marker="o", label=label)
            if name != "transformers" and batch == 1:
                ax.plot([r["loops"] for r in rows], [1 / r["floor_seconds"] for r in rows], ls=":", color="gray",
                        alpha=0.6)
        ax.set_xlabel("loops")
        ax.set_xticks(payload["setup"]["loops"])
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{batch} sequence{'s' if batch > 1 else ''}" + (" (dotted: bandwidth floors)" if batch == 1 else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Dory, {payload['setup']['checkpoint']}\n{machine_line(payload)}", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save(fig, path)


# ---- main -----------------------------------------------------------------------------------------
def numbers(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers-fraction", type=float, default=1.0,
                   help="prelude, recurrent and coda layer counts times this (widths stay the 4B model's)")
    p.add_argument("--steps", type=int, default=4, help="decode steps timed per setting and round")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds over the loop counts (each round times every loop count in turn)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default=",".join(FORMATS), help="engine weight formats, of " + ", ".join(FORMATS))
    p.add_argument("--batches", type=numbers, default=list(BATCHES))
    p.add_argument("--loops", type=numbers, default=list(LOOPS))
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the random checkpoint is kept")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 + 1 + 1 layers, 2 steps, written under results/quick")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers_fraction, args.steps, args.rounds = 0.05, 2, 1
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    counts = layer_counts(args.layers_fraction)
    args.checkpoint = args.cache_dir / f"dory-4b-random-{counts[0]}-{counts[1]}-{counts[2]}"
    if not (args.checkpoint / "config.json").is_file():
        print(f"writing {args.checkpoint} ...", file=sys.stderr)
        make_checkpoint(args.checkpoint, args.layers_fraction)
    formats = [f for f in args.formats.split(",") if f]
    bandwidth_runs = [run_worker(args, "bandwidth")["bytes_per_second"]]
    engines = {name: run_worker(args, name) for name in formats}
    bandwidth_runs.append(run_worker(args, "bandwidth")["bytes_per_second"])
    hf = run_worker(args, "transformers")
    bandwidth_runs.append(run_worker(args, "bandwidth")["bytes_per_second"])
    bandwidth = median(bandwidth_runs)
    if "bf16" in engines:
        analyse(counts, engines, hf, bandwidth)
    from transformers import DoryConfig

    reference = DoryConfig()
    kv_width = reference.num_key_value_heads * reference.head_dim
    kv = {mode: {loops: kv_bytes_per_token(counts, loops, mode, kv_width) for loops in args.loops}
          for mode in ("per_loop", "last_loop")}
    kv_full = {mode: {loops: kv_bytes_per_token(FULL_LAYERS, loops, mode, kv_width) for loops in args.loops}
               for mode in ("per_loop", "last_loop")}
    payload = {
        "benchmark": "dory_throughput", "environment": environment("cpu", args.threads),
        "setup": {"checkpoint": f"random weights, DoryConfig() widths, {counts[0]} + {counts[1]} + {counts[2]} layers"
                                f" (the 4B model: {' + '.join(map(str, FULL_LAYERS))})",
                  "layers": counts, "layers_fraction": args.layers_fraction, "prompt_tokens": PROMPT_TOKENS,
                  "decode_steps": args.steps, "rounds": args.rounds, "batches": args.batches, "loops": args.loops,
                  "activations": "bfloat16", "engine_formats": formats, "threads": args.threads,
                  "command": "python bench/dory_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])},
        "read_bandwidth_bytes_per_second": bandwidth, "read_bandwidth_runs": bandwidth_runs,
        "kv_bytes_per_token_bf16": {"measured_layers": kv, "full_4b": kv_full},
        "results": {"engine": engines, "transformers": hf},
    }
    kind = cpu_kind_tag()
    part = "" if counts == FULL_LAYERS else f"-{counts[0]}-{counts[1]}-{counts[2]}-layers"
    name = f"dory-throughput-cpu-{kind}{os.cpu_count()}core{part}" + (QUICK_SUFFIX if args.quick else "")
    out = write_result(name, payload)
    plots = (RESULTS_DIR / "quick" if args.quick else RESULTS_DIR) / "plots"
    print(out, plot(payload, plots / f"{name}.png"))
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    for fmt, result in [*engines.items(), ("transformers", hf)]:
        for row in result["rows"]:
            extra = "".join(f", {key} {row[key]:.2f}" for key in ("speedup_over_transformers", "step_over_floor",
                                                                   "step_over_prediction") if key in row)
            print(f"{fmt:12s} batch {row['batch']} loops {row['loops']}: {row['tokens_per_second']:.2f} tok/s{extra}")


if __name__ == "__main__":
    main()
