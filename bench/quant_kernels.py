"""Which kernel a quantized linear layer should run at each row count (depthserve/layers/quantized.py).

    python bench/quant_kernels.py --threads 2

For every distinct linear shape of a model (SmolLM2-135M's by default: the qkv, o, gate_up and down
projections and the 49152-row LM head), at each row count, the time of one call of:
    kernel         the weight-only kernel on the codes (int4 groups of 32; int8 rows for the head): the
                   native one (kernels/cpu_native.py) where it loads, else torch's
    dequant+gemm   the codes dequantized into a reused buffer, then a bf16 GEMM (oneDNN)
    bf16 dense     a bf16 GEMM on a resident bf16 weight (what dequant+gemm would be without the
                   dequantization; needs 4x the memory of int4)
    fp32 dense     the fp32 engine's layer (layers/linear.py CpuLinear)
each the median of `--repeats` calls after warm-up, weights of the layer's size cycled so that
successive calls do not find the weight in cache (as in a decode step, where 30 layers' weights
pass through between two calls of the same layer). Writes bench/results/quant-kernels-<tag>.json
with the crossover: the largest row count at which the kernel beats dequant+gemm on every shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from depthserve.kernels import cpu_native  # noqa: E402
from depthserve.layers.linear import CpuLinear  # noqa: E402
from depthserve.layers.quantized import DequantScratch, QuantLinear, QuantPolicy, quantize_rtn  # noqa: E402
from depthserve.loading.quantization import cpu_features  # noqa: E402

SMOLLM2_SHAPES = {"qkv": (960, 576, 4), "o": (576, 576, 4), "gate_up": (3072, 576, 4), "down": (576, 1536, 4),
                  "lm_head": (49152, 576, 8)}
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 512)
CACHE_BYTES = 160 << 20  # more than the last-level cache: copies cycled so each call reads from memory


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--tag", default="cpu-2core", help="machine tag in the result file name")
    p.add_argument("--quick", action="store_true", help="rows 1, 4, 32; 5 repeats")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.rows, ns.repeats = "1,4,32", 5
    ns.rows = [int(r) for r in ns.rows.split(",")]
    return ns


def _copies(layer_bytes: int) -> int:
    return max(2, min(64, CACHE_BYTES // max(layer_bytes, 1)))


def _median_ms(calls: list, repeats: int) -> float:
    for call in calls[: min(len(calls), 3)]:
        call()
    times = []
    for i in range(repeats):
        call = calls[i % len(calls)]
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_shape(out_features: int, in_features: int, bits: int, rows_list: list[int], repeats: int) -> dict:
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features) * 0.02
    codes = quantize_rtn(weight, bits)
    scratch = DequantScratch()
    n = _copies(out_features * in_features * bits // 8)
    never, always = QuantPolicy(kernel_max_rows=0, native_max_rows=0), QuantPolicy(1 << 30, 1 << 30)
    kernel = [QuantLinear(codes, None, torch.bfloat16, scratch, always) for _ in range(n)]
    dequant = [QuantLinear(codes, None, torch.bfloat16, scratch, never) for _ in range(n)]
    dense_bf16 = [weight.bfloat16().clone() for _ in range(min(n, _copies(out_features * in_features * 2)))]
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    dense_fp32 = [CpuLinear(linear) for _ in range(min(n, _copies(out_features * in_features * 4)))]
    rows_out = {}
    with torch.no_grad():
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            xb = x.bfloat16()
            rows_out[rows] = {
                "kernel": _median_ms([lambda m=m: m(xb) for m in kernel], repeats),
                "dequant+gemm": _median_ms([lambda m=m: m(xb) for m in dequant], repeats),
                "bf16 dense": _median_ms([lambda w=w: torch.nn.functional.linear(xb, w) for w in dense_bf16], repeats),
                "fp32 dense": _median_ms([lambda m=m: m(x) for m in dense_fp32], repeats),
            }
            print(f"{out_features}x{in_features} int{bits} rows {rows:4d}: "
                  + "  ".join(f"{k} {v:7.3f}" for k, v in rows_out[rows].items()) + " ms", flush=True)
    return rows_out


def crossover(shapes: dict[str, dict]) -> int:
    """The largest row count up to which the kernel is at least as fast as dequant+gemm on every shape."""
    rows_sorted = sorted(next(iter(shapes.values())))
    best = 0
    for rows in rows_sorted:
        if all(s[rows]["kernel"] <= s[rows]["dequant+gemm"] for s in shapes.values()):
            best = rows
        else:
            break
    return best


def main(argv: list[str] | None = None) -> dict:
    ns = parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    shapes = {name: time_shape(o, i, b, ns.rows, ns.repeats) for name, (o, i, b) in SMOLLM2_SHAPES.items()}
    per_layer = {rows: {kind: sum(shapes[n][rows][kind] for n in SMOLLM2_SHAPES if n != "lm_head")
                        for kind in ("kernel", "dequant+gemm", "bf16 dense", "fp32 dense")} for rows in ns.rows}
    result = {
        "benchmark": "quant_kernels",
        **common.environment("cpu", ns.threads),
        "cpu_features": cpu_features(),
        "kernel": "native" if cpu_native.unavailable_reason() is None else f"torch ({cpu_native.unavailable_reason()})",
        "shapes": {name: {"out": o, "in": i, "bits": b} for name, (o, i, b) in SMOLLM2_SHAPES.items()},
        "ms": shapes,
        "decoder_layer_ms": per_layer,
        "kernel_max_rows": crossover(shapes),
    }
    print(f"kernel wins up to {result['kernel_max_rows']} rows on every shape")
    name = f"quant-kernels-{ns.tag}{'-quick' if ns.quick else ''}"
    print(f"wrote {common.write_result(name, result)}")
    return result


if __name__ == "__main__":
    main()
