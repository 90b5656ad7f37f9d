"""What huge pages save on the CPU decode step's two memory streams (depthserve/layers/huge_pages.py).

    python bench/huge_pages.py --threads 2

Two measurements, each the same tensors held twice, on ordinary 4 KiB pages (torch's allocator)
and on transparent huge pages, the two taking turns `--repeats` times (medians reported):
    weights    every native-kernel projection of the model's decoder layers (SmolLM2-135M-Instruct's
               Q4_1 codes by default: 120 matmuls, qkv / o / gate_up / down of 30 layers) at one
               activation row, in layer order, as a batch-1 decode step reads them (the weights do
               not fit in the cache, so each call reads its codes from memory)
    attention  native paged decode attention over `--layers` layers' KV pages, `--sequences`
               sequences of `--context` tokens, SmolLM2's heads (9 query, 3 KV, 64 wide), bf16 pages
               in a random order over the pool (as a long-running engine's free list leaves them)
Writes bench/results/huge-pages-<--tag>.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from depthserve.kernels import cpu_native  # noqa: E402
from depthserve.layers import huge_pages  # noqa: E402
from depthserve.layers.quantized import QuantLinear  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="cpu-2core", help="the machine's tag in the file name (e.g. cpu-epyc-2core)")
    return p.parse_args()


def in_turns(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each run, the runs taking turns in a shuffled order each repeat."""
    for run in runs.values():
        run()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for _ in range(repeats):
        random.shuffle(names)
        for name in names:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def weights(args: argparse.Namespace) -> dict:
    from depthserve import LLM

    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=1, load_progress=False, max_model_len=256)
    layers = [m for m in llm.engine.model.modules()
              if isinstance(m, QuantLinear) and m.native is not None and not m.refine_activations]
    on_huge = [m.native for m in layers]  # the engine's own: moved to huge pages at load where offered
    ordinary = [cpu_native.PackedWeight(w.bits, w.out_features, w.codes.clone(), w.scale.clone(), w.low.clone())
                for w in on_huge]
    inputs = {w.codes.shape[1] * cpu_native.GROUP: torch.randn(1, w.codes.shape[1] * cpu_native.GROUP).bfloat16()
              for w in on_huge}

    def step(packed: list[cpu_native.PackedWeight]) -> Callable[[], None]:
        return lambda: [cpu_native.group_gemm(inputs[w.codes.shape[1] * cpu_native.GROUP], w) for w in packed]

    ms = in_turns({"4k_pages": step(ordinary), "huge_pages": step(on_huge)}, args.repeats)
    megabytes = sum(t.numel() * t.element_size() for w in on_huge for t in (w.codes, w.scale, w.low)) / 1e6
    return {"matmuls": len(on_huge), "megabytes": round(megabytes, 1), "ms": ms,
            "gb_per_s": {k: round(megabytes / v, 1) for k, v in ms.items()},
            "huge_over_4k": round(ms["huge_pages"] / ms["4k_pages"], 3)}


def attention(args: argparse.Namespace) -> dict:
    q_heads, kv_heads, dim, block = 9, 3, 64, 16
    blocks = -(-args.context // block)
    per_layer = args.sequences * kv_heads * blocks
    pages = per_layer * args.layers
    generator = torch.Generator().manual_seed(args.seed)
    ordinary = [torch.randn(pages, block, dim, generator=generator).bfloat16() for _ in range(2)]
    on_huge = [huge_pages.zeros((pages, block, dim), torch.bfloat16) for _ in range(2)]
    for copy, source in zip(on_huge, ordinary, strict=True):
        copy.copy_(source)
    order = torch.randperm(pages, generator=generator)
    tables = [order[i * per_layer:(i + 1) * per_layer].view(args.sequences, kv_heads, blocks).int().contiguous()
              for i in range(args.layers)]
    q = torch.randn(args.sequences, q_heads, dim, generator=generator).bfloat16()
    lengths = torch.full((args.sequences,), args.context, dtype=torch.int32)
    assert torch.equal(cpu_native.paged_decode_attention(q, *ordinary, tables[0], lengths, 0.125),
                       cpu_native.paged_decode_attention(q, *on_huge, tables[0], lengths, 0.125))

    def step(k: torch.Tensor, v: torch.Tensor) -> Callable[[], None]:
        return lambda: [cpu_native.paged_decode_attention(q, k, v, table, lengths, 0.125) for table in tables]

    ms = in_turns({"4k_pages": step(*ordinary), "huge_pages": step(*on_huge)}, args.repeats)
    megabytes = args.layers * args.sequences * kv_heads * args.context * dim * 2 * 2 / 1e6  # K and V, bf16
    return {"sequences": args.sequences, "context": args.context, "layers": args.layers,
            "megabytes": round(megabytes, 1), "ms": ms, "gb_per_s": {k: round(megabytes / v, 1) for k, v in ms.items()},
            "huge_over_4k": round(ms["huge_pages"] / ms["4k_pages"], 3)}


def main() -> None:
    args = parse_args()
    if not cpu_native.available():
        sys.exit(f"the native CPU kernels are unavailable: {cpu_native.unavailable_reason()}")
    if not huge_pages.available():
        sys.exit("transparent huge pages are not offered here (/sys/kernel/mm/transparent_hugepage/enabled)")
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    result = {"benchmark": "huge_pages", "settings": vars(args), "environment": common.environment("cpu", args.threads),
              "thp_setting": huge_pages.THP_SETTING.read_text().strip(),
              "weights": weights(args), "attention": attention(args)}
    for part in ("weights", "attention"):
        r = result[part]
        print(f"{part:9s}: 4 KiB pages {r['ms']['4k_pages']:.2f} ms, huge pages {r['ms']['huge_pages']:.2f} ms "
              f"({r['huge_over_4k']:.3f}x; {r['megabytes']} MB)")
    print(f"wrote {common.write_result(f'huge-pages-{args.tag}', result)}")


if __name__ == "__main__":
    main()
