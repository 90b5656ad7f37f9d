"""How many rows a dense bf16 linear layer should run on the native kernel (depthserve/layers/linear.py).

    python bench/bf16_kernels.py --threads 2
    ONEDNN_MAX_CPU_ISA=AVX512_CORE python bench/bf16_kernels.py --threads 2   # oneDNN without bf16 instructions

At each row count, the rate at which one call reads its bf16 weight (GB/s: weight bytes over the
call's time; the median of `--repeats` passes) for:
    F.linear   torch's bf16 GEMM (oneDNN: on the CPU's bf16 instructions where it has AVX-512 BF16 or
               AMX, else emulated with fp32 arithmetic)
    native     the native kernel (kernels/csrc/bf16_gemm.cpp, cpu_native.bf16_gemm)
over `--weights` distinct [out, in] weights (Dory-4B's MLP shape by default: 8 x 14336 x 2560, 587 MB,
far past the last-level cache), called in turn as a decode step calls its layers, so every call
reads its weight from memory. `torch.sum` over the same weights is the read rate's reference.
oneDNN reads ONEDNN_MAX_CPU_ISA when it starts: with AVX512_CORE a CPU with AVX-512 BF16 runs torch's
bf16 GEMM as a CPU without it does, which is what the kernel's row limit on such CPUs is decided
from. Writes bench/results/bf16-kernels-<tag>[-<isa>].json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from depthserve.kernels import cpu_native  # noqa: E402
from depthserve.layers.linear import native_bf16_max_rows  # noqa: E402
from depthserve.loading.quantization import cpu_features  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--shape", default="14336,2560", help="out,in of each weight")
    p.add_argument("--weights", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tag", default=None, help="machine tag in the result file name (default: cpu-<cpu kind>-2core)")
    ns = p.parse_args(argv)
    ns.rows = [int(r) for r in ns.rows.split(",")]
    ns.shape = tuple(int(n) for n in ns.shape.split(","))
    return ns


def pass_rate(call, weights: list[torch.Tensor], repeats: int) -> float:
    """GB/s of the weights' bytes over the median time of one pass calling `call` on each weight."""
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    for w in weights[:2]:
        call(w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            call(w)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> dict:
    ns = parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if cpu_native.unavailable_reason() is not None:
        raise SystemExit(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(ns.shape, generator=generator).bfloat16() for _ in range(ns.weights)]
    read = [pass_rate(lambda w: w.sum(), weights, ns.repeats)]
    rows = {}
    for count in ns.rows:
        x = torch.randn(count, ns.shape[1], generator=generator).bfloat16()
        rows[count] = {"F.linear": pass_rate(lambda w: F.linear(x, w), weights, ns.repeats),
                       "native": pass_rate(lambda w: cpu_native.bf16_gemm(x, w), weights, ns.repeats)}
        print(f"{count:4d} rows: F.linear {rows[count]['F.linear']:5.1f} GB/s, native {rows[count]['native']:5.1f} GB/s",
              flush=True)
    read.append(pass_rate(lambda w: w.sum(), weights, ns.repeats))
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    result = {
        "benchmark": "bf16_kernels",
        **common.environment("cpu", ns.threads),
        "cpu_features": cpu_features(),
        "onednn_max_cpu_isa": isa,
        "setup": {"weights": ns.weights, "shape": list(ns.shape), "repeats": ns.repeats,
                  "command": "python bench/bf16_kernels.py " + " ".join(sys.argv[1:])},
        "read_bandwidth_gb_per_s": read,
        "weight_read_gb_per_s": rows,
        "native_wins_at": [count for count, rates in rows.items() if rates["native"] > rates["F.linear"]],
        "engine_native_max_rows": native_bf16_max_rows(),
    }
    tag = ns.tag or f"cpu-{common.cpu_kind_tag()}2core"
    name = f"bf16-kernels-{tag}" + (f"-{isa.lower()}" if isa else "")
    print(f"wrote {common.write_result(name, result)}")
    return result


if __name__ == "__main__":
    main()
