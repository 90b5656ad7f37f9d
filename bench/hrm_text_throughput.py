"""HRM-Text decode throughput at its real widths on the CPU, engine against transformers, in one run
(docs/depth-semantics.md, "Public looped models: HRM-Text").

A random-weight checkpoint with transformers' HrmTextConfig() widths (HRM-Text-1B: hidden 1536, 12
heads of 128, intermediate 4096, vocab 151808; 16 layers per stack, or that count times
`--layers-fraction`) is written once in bf16 safetensors, under the names transformers saves
(fused `attn.gqkv_proj`, `mlp.gate_up_proj`), into `--cache-dir` and reused. Then, each in its own
subprocess, one after the other: the engine with bf16 activations serving the weights as bf16 (and
the other `--formats`), and transformers' HrmTextForCausalLM in bf16 (`generate` with its cache).
Each decodes 1 and 8 greedy sequences of a causal 16-token prompt at each (h_cycles, l_cycles) of
`--cycles` with the same threads.

Reported: decode tok/s and step time per setting, transformers' over the engine's step time, the
KV bytes per token the engine holds (measured from its pages) and the layout's count
(layers per stack x h_cycles x (l_cycles + 1) slots x keys and values x 12 x 128 x 2 bytes), at
the measured layer count and at the full 16. Writes bench/results/hrm-text-throughput-<device>.json
and its chart under bench/results/plots/ (`--replot JSON` redraws a chart alone).

    python bench/hrm_text_throughput.py [--layers-fraction 0.25] [--steps 4] [--quick]
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
from looped_decode import PROMPT_TOKENS, time_decode  # noqa: E402

FULL_LAYERS_PER_STACK = 16  # HrmTextConfig()
FORMATS = {"bf16": "none", "int8": "int8", "int4": "int4"}  # engine format -> quantization
BATCHES = (1, 8)
CYCLES = ((1, 1), (2, 1), (2, 3))  # (h_cycles, l_cycles); (2, 3) is HrmTextConfig()'s
DEFAULT_CACHE = Path.home() / ".cache" / "depthserve"
SHARD_BYTES = 1 << 30


# ---- the checkpoint -------------------------------------------------------------------------------
def layers_per_stack(fraction: float) -> int:
    return max(1, round(FULL_LAYERS_PER_STACK * fraction))


def tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """The tensors transformers saves for an HRM-Text config (its fused projections)."""
    d, width, inner = config.hidden_size, config.num_attention_heads * config.head_dim, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d), "model.z_L_init": (d,),
              "lm_head.weight": (config.vocab_size, d)}
    for stack in ("L_module", "H_module"):
        for j in range(config.num_layers_per_stack):
            prefix = f"model.{stack}.layers.{j}"
            shapes.update({f"{prefix}.attn.gqkv_proj.weight": (4 * width, d), f"{prefix}.attn.o_proj.weight": (d, width),
                           f"{prefix}.mlp.gate_up_proj.weight": (2 * inner, d),
                           f"{prefix}.mlp.down_proj.weight": (d, inner)})
    return shapes


def random_value(name: str, shape: tuple[int, ...], init: float, generator: torch.Generator) -> torch.Tensor:
    """Rows of norm ~1 for the projections; embeddings at the initializer's scale (the model
    multiplies them by 1 / initializer_range); a unit-normal z_L_init."""
    draw = torch.randn(shape, generator=generator)
    if name == "model.embed_tokens.weight":
        return draw * init
    return draw / shape[1] ** 0.5 if len(shape) == 2 else draw


def make_checkpoint(out: Path, fraction: float) -> None:
    from safetensors.torch import save_file
    from transformers import HrmTextConfig

    from depthserve.loading.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    config = HrmTextConfig(num_hidden_layers=layers_per_stack(fraction), tie_word_embeddings=False,
                           eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    config.dtype = torch.bfloat16
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shapes = tensor_shapes(config)
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
def engine_worker(path: Path, quantization: str, steps: int, batches, cycles) -> dict:
    from depthserve import LLM, DepthParams

    start = time.perf_counter()
    llm = LLM(str(path), device="cpu", dtype="bfloat16", quantization=quantization, load_progress=False,
              max_model_len=PROMPT_TOKENS + steps + 8, block_size=16, enable_prefix_caching=False)
    load = {"seconds": time.perf_counter() - start, "peak_rss_bytes": peak_rss_bytes(),
            "resident_weight_bytes": llm.engine.quantization.resident_bytes}
    rows = []
    for batch in batches:
        for h, l in cycles:
            depth = DepthParams(h_cycles=h, l_cycles=l, prefix_lm=0)
            timing = time_decode(llm.engine, batch, depth, steps, f"b{batch}-h{h}-l{l}")
            step = median(timing.times)
            rows.append({"batch": batch, "h_cycles": h, "l_cycles": l, "step_seconds": step,
                         "step_seconds_all": timing.times, "tokens_per_second": batch / step,
                         "kv_bytes_per_token": timing.kv_bytes_per_token})
            print(f"  {quantization} batch {batch} cycles {h}x{l}: {1000 * step:.0f} ms/step", file=sys.stderr)
    return {"load": load, "rows": rows}


@torch.inference_mode()
def transformers_worker(path: Path, steps: int, batches, cycles) -> dict:
    from transformers import DynamicCache, HrmTextForCausalLM

    start = time.perf_counter()
    model, info = HrmTextForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        raise RuntimeError(f"transformers did not read the checkpoint as written: {info}")
    load = {"seconds": time.perf_counter() - start, "peak_rss_bytes": peak_rss_bytes()}
    model.eval()
    rows = []
    for batch in batches:
        for h, l in cycles:
            model.config.H_cycles, model.config.L_cycles = h, l
            ids = torch.tensor(byte_prompts(batch, PROMPT_TOKENS))

            def generate(new_tokens: int) -> float:
                # a cache with a layer per attention invocation at these cycles (transformers sizes its
                # default one from the config's num_hidden_layers, set for the trained cycles)
                cache = DynamicCache()
                begin = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, cache=cache)
                return time.perf_counter() - begin

            generate(2)  # warm-up
            step = (generate(1 + steps) - generate(1)) / steps
            rows.append({"batch": batch, "h_cycles": h, "l_cycles": l, "step_seconds": step,
                         "tokens_per_second": batch / step})
            print(f"  transformers batch {batch} cycles {h}x{l}: {1000 * step:.0f} ms/step", file=sys.stderr)
    return {"load": load, "rows": rows}


def run_worker(args: argparse.Namespace, role: str) -> dict:
    """One measurement in a fresh process (its JSON on the last line of stdout)."""
    command = [sys.executable, __file__, "--worker", role, "--checkpoint", str(args.checkpoint), "--steps",
               str(args.steps), "--threads", str(args.threads), "--batches", ",".join(map(str, args.batches)),
               "--cycles", ",".join(f"{h}x{l}" for h, l in args.cycles)]
    print(f"{role} ...", file=sys.stderr)
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    if args.worker == "transformers":
        result = transformers_worker(args.checkpoint, args.steps, args.batches, args.cycles)
    else:
        result = engine_worker(args.checkpoint, FORMATS[args.worker], args.steps, args.batches, args.cycles)
    print(json.dumps(result))


# ---- the cache model ------------------------------------------------------------------------------
def kv_bytes_per_token(per_stack: int, h: int, l: int, kv_width: int = 12 * 128, dtype_bytes: int = 2) -> int:
    """Keys and values one token holds: a slot per attention invocation (format.invocation_slots)."""
    return per_stack * h * (l + 1) * 2 * kv_width * dtype_bytes


def compare(engines: dict, hf: dict) -> None:
    for result in engines.values():
        for row in result["rows"]:
            theirs = next(r for r in hf["rows"] if (r["batch"], r["h_cycles"], r["l_cycles"]) ==
                          (row["batch"], row["h_cycles"], row["l_cycles"]))
            row["speedup_over_transformers"] = theirs["step_seconds"] / row["step_seconds"]


# ---- the chart ------------------------------------------------------------------------------------
def plot(payload: dict, path: Path) -> Path:
    """Decode tok/s per cycle setting, one panel per batch size, engine formats and transformers."""
    from plot import plot_looped_decode

    return plot_looped_decode(payload, path, "HRM-Text", "h_cycles x l_cycles")


# ---- main -----------------------------------------------------------------------------------------
def numbers(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def cycle_pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in pair.split("x")) for pair in text.split(",") if pair]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers-fraction", type=float, default=0.25,
                   help="layers per stack: 16 times this (widths stay HRM-Text-1B's)")
    p.add_argument("--steps", type=int, default=4, help="decode steps timed per setting")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default="bf16", help="engine weight formats, of " + ", ".join(FORMATS))
    p.add_argument("--batches", type=numbers, default=list(BATCHES))
    p.add_argument("--cycles", type=cycle_pairs, default=list(CYCLES), help="h_cycles x l_cycles, e.g. 1x1,2x3")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the random checkpoint is kept")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 layer per stack, 1 step, under results/quick")
    p.add_argument("--replot", type=Path, help="only draw the chart of a result JSON written before")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers_fraction, args.steps = 1 / FULL_LAYERS_PER_STACK, 1
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    if args.replot:
        print(plot(json.loads(args.replot.read_text()), RESULTS_DIR / "plots" / f"{args.replot.stem}.png"))
        return
    per_stack = layers_per_stack(args.layers_fraction)
    args.checkpoint = args.cache_dir / f"hrm-text-1b-random-{per_stack}-per-stack"
    if not (args.checkpoint / "config.json").is_file():
        print(f"writing {args.checkpoint} ...", file=sys.stderr)
        make_checkpoint(args.checkpoint, args.layers_fraction)
    formats = [f for f in args.formats.split(",") if f]
    engines = {name: run_worker(args, name) for name in formats}
    hf = run_worker(args, "transformers")
    compare(engines, hf)
    kv = {f"{h}x{l}": {"measured_layers": kv_bytes_per_token(per_stack, h, l),
                       "full_1b": kv_bytes_per_token(FULL_LAYERS_PER_STACK, h, l)} for h, l in args.cycles}
    payload = {
        "benchmark": "hrm_text_throughput", "environment": environment("cpu", args.threads),
        "setup": {"checkpoint": f"random weights, HrmTextConfig() widths, {per_stack} layers per stack "
                                f"(HRM-Text-1B: {FULL_LAYERS_PER_STACK})",
                  "layers_per_stack": per_stack, "layers_fraction": args.layers_fraction,
                  "prompt_tokens": PROMPT_TOKENS, "prompt_attention": "causal (prefix_lm 0)",
                  "decode_steps": args.steps, "batches": args.batches, "cycles": [list(c) for c in args.cycles],
                  "activations": "bfloat16", "engine_formats": formats, "threads": args.threads,
                  "command": "python bench/hrm_text_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])},
        "kv_bytes_per_token_bf16": kv,
        "results": {"engine": engines, "transformers": hf},
    }
    kind = cpu_kind_tag()
    name = f"hrm-text-throughput-cpu-{kind}{os.cpu_count()}core" + (QUICK_SUFFIX if args.quick else "")
    plots = (RESULTS_DIR / "quick" if args.quick else RESULTS_DIR) / "plots"
    print(write_result(name, payload), plot(payload, plots / f"{name}.png"))
    for fmt, result in [*engines.items(), ("transformers", hf)]:
        for row in result["rows"]:
            extra = f", {row['speedup_over_transformers']:.2f}x transformers" if "speedup_over_transformers" in row else ""
            print(f"{fmt:12s} batch {row['batch']} cycles {row['h_cycles']}x{row['l_cycles']}: "
                  f"{row['tokens_per_second']:.2f} tok/s{extra}")


if __name__ == "__main__":
    main()
