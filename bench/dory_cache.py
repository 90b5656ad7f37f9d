"""Dory's KV cache and step time against its `loops` knob, in both cache modes, on tiny random
checkpoints (docs/depth-semantics.md, "Public looped models: Dory").

For each mode (per_loop, last_loop) and loops in 1, 2, 4, 8: the KV pages one sequence holds
after its prompt and its first decode step (read from the block manager, as bytes per token of its
context; by then both modes have given back the sliding layers' pages behind the window, which
last_loop, whose prompt runs in fixed 32-token chunks, starts doing a step earlier), and the wall time
of one greedy request (a 64-token prompt, 32 generated tokens, one thread), best of `--repeats`.
Writes bench/results/dory-cache-<device>.json.

    python bench/dory_cache.py [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUICK_SUFFIX, device_slug, environment, write_result  # noqa: E402
from depthserve import LLM, DepthParams, SamplingParams  # noqa: E402
from depthserve.lab.tiny.dory import make_tiny  # noqa: E402

LOOPS = (1, 2, 4, 8)
PROMPT_TOKENS, GENERATED = 64, 32
BLOCK_SIZE = 16


def measure(path: Path, loops: int, repeats: int) -> dict:
    llm = LLM(str(path), device="cpu", dtype="float32", load_progress=False, max_model_len=256,
              block_size=BLOCK_SIZE, enable_prefix_caching=False)
    engine, depth = llm.engine, DepthParams(loops=loops)
    prompt = torch.randint(1, 257, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=GENERATED, ignore_eos=True)
    engine.add_request("probe", prompt, params, depth)
    seq = engine._requests["probe"].seqs[0]
    while seq.num_computed_tokens <= PROMPT_TOKENS:
        engine.step()
    pages, context = engine.block_manager.pages_held(seq), seq.num_computed_tokens
    engine.abort_request("probe")
    page_bytes = engine.block_manager.page_bytes
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([prompt], params, depth)
        seconds.append(time.perf_counter() - start)
    return {"loops": loops, "context_tokens": context, "kv_pages": pages,
            "kv_bytes_per_token": pages * page_bytes / context,
            "request_seconds_best": min(seconds), "request_seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat, written under results/quick")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory() as root:
        for mode in ("per_loop", "last_loop"):
            path = make_tiny(Path(root) / mode, seed=0, loops=2, cache_mode=mode, sliding_window=16)
            rows[mode] = [measure(path, loops, repeats) for loops in LOOPS]
    payload = {"benchmark": "dory_cache", "environment": environment("cpu", 1),
               "setup": {"checkpoint": "dory tiny (hidden 64, 2 + 2 + 2 layers, trained loops 2, window 16)",
                         "prompt_tokens": PROMPT_TOKENS, "generated_tokens": GENERATED, "block_size": BLOCK_SIZE,
                         "dtype": "float32", "repeats": repeats},
               "results": rows}
    name = f"dory-cache-{device_slug('cpu')}" + (QUICK_SUFFIX if args.quick else "")
    print(write_result(name, payload))
    for mode, measured in rows.items():
        for row in measured:
            print(f"{mode:9s} loops {row['loops']}: {row['kv_bytes_per_token']:.0f} KV bytes/token, "
                  f"{row['request_seconds_best']:.3f} s per request")


if __name__ == "__main__":
    main()
