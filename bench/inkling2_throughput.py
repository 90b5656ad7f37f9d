"""Inkling-2 loop text model: decode throughput on the CPU at its real widths and a stated fraction
of its layers and experts, engine against transformers, in one run (docs/depth-semantics.md,
"Public looped models: Inkling-2").

A random-weight checkpoint with Inkling2LoopTextConfig()'s widths (hidden 2304, 24 query and 8 KV
heads of 128 in both layer types, d_rel 16, expert width 1152, 8 experts per token, vocabulary
201024) but `--layers` layers (half before the looped band, half in it; attention-residual blocks
of half that many layers, so the band is one block) and `--experts` routed experts instead of
Inkling-2-Mini's 24 layers and 128 experts (whose bf16 weights, ~50 GB, exceed this machine's
memory), written once in bf16 by transformers itself into `--cache-dir`. Then, each in its own
subprocess, one after the other: the engine with bf16 activations serving the weights as bf16 and
as int4 (`--quantization int4`: every linear layer whose shape the codes allow, the routed experts'
included) and transformers' Inkling2LoopForCausalLM in bf16 (`generate` with its cache), each
decoding 1 and 8 greedy sequences at each loop setting with the same threads. Reported: decode tok/s and step time, and the engine's KV cache bytes per
token (every slot of the request's layout, as admission prices it, over a 16-token prompt).
Writes bench/results/inkling2-throughput-<device>.json.

    python bench/inkling2_throughput.py [--layers 4] [--experts 16] [--steps 6] [--quick]
"""

from __future__ import annotations

import argparse
import json
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

FORMATS = {"bf16": "none", "int4": "int4"}  # engine format -> --quantization
BATCHES = (1, 8)
LOOPS = (1, 2, 3)
DEFAULT_CACHE = Path.home() / ".cache" / "depthserve"


def make_checkpoint(out: Path, layers: int, experts: int) -> None:
    from transformers import Inkling2LoopForCausalLM, Inkling2LoopTextConfig

    from depthserve.lab.tiny.inkling2 import randomize
    from depthserve.loading.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    half = layers // 2
    types = ["hybrid_sliding" if (i + 1) % half else "hybrid" for i in range(layers)]
    config = Inkling2LoopTextConfig(num_hidden_layers=layers, layer_types=types, n_routed_experts=experts,
                                    n_layers_per_attn_res_block=half, loop_layer_index_start=half,
                                    loop_layer_index_end=layers, loop_num_passes=3,
                                    eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = Inkling2LoopForCausalLM(config).to(torch.bfloat16).eval()
    randomize(model, 0)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def engine_worker(path: Path, steps: int, batches, loops_list, quantization: str) -> dict:
    from depthserve import LLM, DepthParams

    start = time.perf_counter()
    llm = LLM(str(path), device="cpu", dtype="bfloat16", quantization=quantization, load_progress=False,
              max_model_len=PROMPT_TOKENS + steps + 8, block_size=16, enable_prefix_caching=False)
    load = {"seconds": time.perf_counter() - start, "peak_rss_bytes": peak_rss_bytes()}
    rows = []
    for batch in batches:
        for loops in loops_list:
            timing = time_decode(llm.engine, batch, DepthParams(loops=loops), steps, f"b{batch}-l{loops}")
            step = median(timing.times)
            rows.append({"batch": batch, "loops": loops, "step_seconds": step, "step_seconds_all": timing.times,
                         "tokens_per_second": batch / step, "kv_bytes_per_token": timing.kv_bytes_per_token})
            print(f"  engine {quantization} batch {batch} loops {loops}: {1000 * step:.0f} ms/step", file=sys.stderr)
    return {"load": load, "rows": rows}


@torch.inference_mode()
def transformers_worker(path: Path, steps: int, batches, loops_list) -> dict:
    from transformers import Inkling2LoopForCausalLM

    rows, load = [], None
    for loops in loops_list:
        start = time.perf_counter()
        model = Inkling2LoopForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, loop_num_passes=loops).eval()
        load = load or {"seconds": time.perf_counter() - start}
        for batch in batches:
            ids = torch.tensor(byte_prompts(batch, PROMPT_TOKENS))

            def generate(new_tokens: int) -> float:
                begin = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
                return time.perf_counter() - begin

            generate(2)  # warm-up
            # decode steps alone: generating 1 + steps tokens against 1 (the prompt's forward)
            step = (generate(1 + steps) - generate(1)) / steps
            rows.append({"batch": batch, "loops": loops, "step_seconds": step, "tokens_per_second": batch / step})
            print(f"  transformers batch {batch} loops {loops}: {1000 * step:.0f} ms/step", file=sys.stderr)
        del model
    load["peak_rss_bytes"] = peak_rss_bytes()
    return {"load": load, "rows": sorted(rows, key=lambda r: (r["batch"], r["loops"]))}


def run_worker(args: argparse.Namespace, role: str) -> dict:
    command = [sys.executable, __file__, "--worker", role, "--checkpoint", str(args.checkpoint), "--steps",
               str(args.steps), "--threads", str(args.threads), "--batches", ",".join(map(str, args.batches)),
               "--loops", ",".join(map(str, args.loops))]
    print(f"{role} ...", file=sys.stderr)
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def numbers(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="decoder layers (even; half of them looped)")
    p.add_argument("--experts", type=int, default=16, help="routed experts per layer (8 run per token)")
    p.add_argument("--steps", type=int, default=6, help="decode steps timed per setting")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=numbers, default=list(BATCHES))
    p.add_argument("--loops", type=numbers, default=list(LOOPS))
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the random checkpoint is kept")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 steps, written under results/quick")
    p.add_argument("--replot", type=Path, help="only draw the chart of a result JSON written before")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 2
    return args


def plot(payload: dict, path: Path) -> Path:
    from plot import plot_looped_decode

    return plot_looped_decode(payload, path, "Inkling-2 looped text model", "loops")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.replot:
        print(plot(json.loads(args.replot.read_text()), RESULTS_DIR / "plots" / f"{args.replot.stem}.png"))
        return
    if args.worker:
        torch.set_num_threads(args.threads)
        if args.worker == "transformers":
            result = transformers_worker(args.checkpoint, args.steps, args.batches, args.loops)
        else:
            result = engine_worker(args.checkpoint, args.steps, args.batches, args.loops, FORMATS[args.worker])
        print(json.dumps(result))
        return
    args.checkpoint = args.cache_dir / f"inkling2-mini-random-{args.layers}-layers-{args.experts}-experts"
    if not (args.checkpoint / "config.json").is_file():
        print(f"writing {args.checkpoint} ...", file=sys.stderr)
        make_checkpoint(args.checkpoint, args.layers, args.experts)
    engines = {name: run_worker(args, name) for name in FORMATS}
    hf = run_worker(args, "transformers")
    for engine in engines.values():
        for row in engine["rows"]:
            theirs = next(r for r in hf["rows"] if (r["batch"], r["loops"]) == (row["batch"], row["loops"]))
            row["speedup_over_transformers"] = theirs["step_seconds"] / row["step_seconds"]
    payload = {
        "benchmark": "inkling2_throughput", "environment": environment("cpu", args.threads),
        "setup": {"checkpoint": f"random weights, Inkling2LoopTextConfig() widths, {args.layers} layers "
                                f"({args.layers // 2} looped), {args.experts} experts (Inkling-2-Mini: 24 layers, "
                                "12 looped, 128 experts)",
                  "layers": args.layers, "experts": args.experts, "trained_loops": 3, "prompt_tokens": PROMPT_TOKENS,
                  "decode_steps": args.steps, "batches": args.batches, "loops": args.loops,
                  "activations": "bfloat16", "engine_formats": list(FORMATS), "threads": args.threads,
                  "command": "python bench/inkling2_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])},
        "load_average_at_end": os.getloadavg(),
        "results": {"engine": engines, "transformers": hf},
    }
    kind = cpu_kind_tag()
    name = f"inkling2-throughput-cpu-{kind}{os.cpu_count()}core" + (QUICK_SUFFIX if args.quick else "")
    plots = (RESULTS_DIR / "quick" if args.quick else RESULTS_DIR) / "plots"
    print(write_result(name, payload), plot(payload, plots / f"{name}.png"))
    for who, result in [*((f"engine {name}", engine) for name, engine in engines.items()), ("transformers", hf)]:
        for row in result["rows"]:
            extra = f", {row['speedup_over_transformers']:.2f}x transformers" if "speedup_over_transformers" in row else ""
            kv = f", KV {row['kv_bytes_per_token'] / 1024:.0f} KiB/token" if "kv_bytes_per_token" in row else ""
            print(f"{who:13s} batch {row['batch']} loops {row['loops']}: {row['tokens_per_second']:.2f} tok/s{extra}{kv}")


if __name__ == "__main__":
    main()
