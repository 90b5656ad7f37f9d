"""Paged decode attention against the memory-bandwidth limit, one run.

    python bench/kernels.py                        # on a GPU: bf16, batch 64, context 4096
    python bench/kernels.py --quick                # tiny shapes (CPU: the Triton interpreter; a smoke run)

For each shape (query heads / KV heads / head dim) a page pool of random keys and values is laid
out as the engine lays it (pages of `--block-size` tokens, one KV head each, scrambled over the
pool) and the decode attention of `--batch` sequences of `--context` keys is timed:

- the Triton kernel (kernels/triton/paged.py) at its default settings, and every variant of its
  tuning knobs in `--variants` (keys per tile, warps, pipeline stages, tiles per split);
- the torch fallback (kernels/paged.py: gather the pages, then matmuls);
- SDPA on contiguous K/V of the same shape (no paging: the kernel a paged kernel is held against).

Each time is the median of `triton.testing.do_bench` on CUDA (a wall-clock median elsewhere). The
bytes a decode attention must move are its keys and values, read once (queries and outputs are
negligible); over the time they give the achieved bandwidth, reported against the device's
device-to-device copy rate measured in the same run. Every kernel's output is checked first against
the torch fallback in fp32 on the same inputs: one outside the error bound of its dtype is recorded
as wrong and not timed, one that raises (a variant that does not compile, say: too much shared
memory) as failed with its error, and the run goes on; only rows within the bound are timed and can
be the fastest. Result: bench/results/kernels-<device>.json, rewritten after every row (its "status":
running, complete or interrupted).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton runs only interpreted on CPU (set before it loads)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ERROR_BOUNDS = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--shapes", default="9/3/64,32/8/64,32/8/128", help="query heads/KV heads/head dim, comma-separated")
    p.add_argument("--variants", default="tile=32,64,128;warps=4,8;stages=1,2,3",
                   help="the kernel's knobs to sweep: tile (keys per step), warps, stages; each list crossed")
    p.add_argument("--quick", action="store_true", help="batch 2, context 64, one small shape, two variants")
    p.add_argument("--out", default=None, help="result name under bench/results (default: kernels-<device>)")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.batch, ns.context, ns.shapes, ns.variants, ns.dtype = 2, 64, "4/2/16", "tile=32;warps=4;stages=1,2", "float32"
    return ns


def parse_variants(text: str) -> list[dict[str, int]]:
    """'tile=32,64;warps=4' -> [{'tile': 32, 'num_warps': 4}, {'tile': 64, 'num_warps': 4}]."""
    names = {"tile": "tile", "warps": "num_warps", "stages": "num_stages"}
    axes = []
    for part in text.split(";"):
        key, values = part.split("=")
        axes.append([(names[key.strip()], int(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def paged_inputs(batch: int, q_heads: int, kv_heads: int, head_dim: int, context: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Queries, a scrambled page pool holding every sequence's keys and values, the page tables
    ([batch, KV heads, blocks], a transposed view as the engine's are) and the same keys and values
    contiguous ([batch, KV heads, context, head dim]) for SDPA."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = -(-context // block_size)
    num_pages = batch * kv_heads * blocks
    k_pages = torch.randn(num_pages, block_size, head_dim, generator=gen).to(device, dtype)
    v_pages = torch.randn(num_pages, block_size, head_dim, generator=gen).to(device, dtype)
    table = torch.randperm(num_pages, generator=gen).view(batch, blocks, kv_heads).to(device).transpose(1, 2)
    q = torch.randn(batch, q_heads, head_dim, generator=gen).to(device, dtype)

    def contiguous(pages: torch.Tensor) -> torch.Tensor:
        return pages[table.reshape(-1)].view(batch, kv_heads, blocks * block_size, head_dim)[:, :, :context]

    return {"q": q, "k_pages": k_pages, "v_pages": v_pages, "table": table,
            "lens": torch.full((batch,), context, device=device), "k": contiguous(k_pages), "v": contiguous(v_pages)}


def time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append(1000 * (time.perf_counter() - start))
    return statistics.median(samples)


def relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got.float() - reference).norm() / reference.norm())


def error_bound(dtype: str) -> float:
    """The largest relative error against the fp32 reference that a correct kernel shows in `dtype`
    (inputs rounded alike, fp32 accumulation: the output's and the probabilities' rounding, ~3e-3 in
    bf16, with margin); a masking or indexing bug gives 1e-1 and more."""
    return ERROR_BOUNDS[dtype]


def measure(fn: Callable[[], torch.Tensor], reference: torch.Tensor, bound: float,
            device: torch.device) -> dict[str, Any]:
    """One kernel's row: its error against the reference, then, if within `bound`, its time. A kernel
    that raises (one that does not compile, say: a tile too large for shared memory) is recorded as
    failed, one outside the bound as wrong (not timed), and the benchmark goes on."""
    try:
        error = relative_error(fn(), reference)
        if not error <= bound:  # NaN included
            return {"status": "wrong", "relative_error": error, "error_bound": bound}
        return {"status": "ok", "relative_error": error, "error_bound": bound, "ms": time_ms(fn, device)}
    except Exception as failure:  # noqa: BLE001 - any failure of one variant is that variant's result
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"status": "failed", "error": f"{type(failure).__name__}: {failure}"[:2000]}


def describe(row: dict[str, Any], copy_rate: float | None) -> str:
    if row["status"] == "failed":
        return f"  {row['name']:<28} FAILED: {row['error'].splitlines()[0][:200]}"
    if row["status"] == "wrong":
        return (f"  {row['name']:<28} WRONG: rel. error {row['relative_error']:.1e} > {row['error_bound']:.0e}"
                " (not timed)")
    share = f"{100 * row['share_of_copy_rate']:5.1f}% of copy rate" if copy_rate else ""
    return (f"  {row['name']:<28} {row['ms'] * 1000:9.1f} us  {row['bandwidth_bytes_per_s'] / 1e9:8.1f} GB/s  {share}"
            f"  rel. error {row['relative_error']:.1e}")


def fastest_triton(rows: list[dict[str, Any]]) -> str | None:
    """The fastest Triton row among those within the error bound (failed and wrong rows never win)."""
    timed = [row for row in rows if row["name"].startswith("triton") and row["status"] == "ok"]
    return min(timed, key=lambda row: row["ms"])["name"] if timed else None


def bench_shape(shape: str, ns: argparse.Namespace, device: torch.device, copy_rate: float | None,
                report: dict[str, Any] | None = None, save: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Every kernel on `shape`, filled into `report` (its rows and the winner) row by row, calling
    `save` after each row; returns the report."""
    from depthserve.kernels import paged as torch_paged
    from depthserve.kernels.triton import paged as triton_paged

    report = {"shape": shape} if report is None else report

    q_heads, kv_heads, head_dim = (int(x) for x in shape.split("/"))
    dtype = DTYPES[ns.dtype]
    x = paged_inputs(ns.batch, q_heads, kv_heads, head_dim, ns.context, ns.block_size, dtype, device)
    scale = head_dim ** -0.5
    args = (x["q"], x["k_pages"], x["v_pages"], x["table"], x["lens"], scale)
    reference = torch_paged.paged_decode_attention(x["q"].float(), x["k_pages"].float(), x["v_pages"].float(),
                                                   x["table"], x["lens"], scale)
    bytes_moved = 2 * ns.batch * kv_heads * ns.context * head_dim * x["k_pages"].element_size()
    report.update(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, bytes_moved=bytes_moved, rows=[])
    bound = error_bound(ns.dtype)

    def record(name: str, fn: Callable[[], torch.Tensor], settings: dict | None = None) -> None:
        row = {"name": name, "settings": settings or {}, **measure(fn, reference, bound, device)}
        if row["status"] == "ok":
            row["bandwidth_bytes_per_s"] = bytes_moved / (row["ms"] / 1000)
            if copy_rate:
                row["share_of_copy_rate"] = row["bandwidth_bytes_per_s"] / copy_rate
        print(describe(row, copy_rate), flush=True)
        report["rows"].append(row)
        report["fastest_triton"] = fastest_triton(report["rows"])
        save()

    print(f"shape {shape} (query heads / KV heads / head dim), batch {ns.batch}, context {ns.context}, {ns.dtype}:")
    record("triton (default)", lambda: triton_paged.paged_decode_attention(*args))
    for variant in parse_variants(ns.variants):
        label = "triton " + " ".join(f"{k.removeprefix('num_')}={v}" for k, v in variant.items())
        record(label, lambda v=variant: triton_paged.paged_decode_attention(*args, **v), variant)
    record("torch fallback (gather)", lambda: torch_paged.paged_decode_attention(*args))
    query = x["q"][:, :, None, :]  # [batch, heads, 1, d]
    record("sdpa, contiguous K/V", lambda: F.scaled_dot_product_attention(
        query, x["k"], x["v"], scale=scale, enable_gqa=q_heads != kv_heads)[:, :, 0])
    print(f"  fastest Triton variant within the error bound: {report['fastest_triton']}")
    return report


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    device = torch.device(common.resolve_device(ns.device))
    name = ns.out or f"kernels-{common.device_slug(str(device))}" + ("-quick" if ns.quick else "")
    payload: dict[str, Any] = {
        "benchmark": "kernels",
        "status": "running",
        "settings": vars(ns),
        "copy_rate_bytes_per_s": None,
        "shapes": [],
        "environment": common.environment(str(device), None),
    }

    def save() -> None:  # after every row: an interrupted or crashed run keeps what it measured
        common.write_result(name, payload)

    try:
        payload["copy_rate_bytes_per_s"] = copy_rate = common.device_copy_rate(device)
        if copy_rate:
            print(f"device-to-device copy rate: {copy_rate / 1e12:.2f} TB/s (read + written)")
        for shape in ns.shapes.split(","):
            report: dict[str, Any] = {"shape": shape}
            payload["shapes"].append(report)
            try:
                bench_shape(shape, ns, device, copy_rate, report, save)
            except Exception as failure:  # noqa: BLE001 - a shape's set-up failing (memory, say) ends that shape only
                report["error"] = f"{type(failure).__name__}: {failure}"[:2000]
                print(f"  shape {shape} FAILED: {report['error'].splitlines()[0][:200]}", flush=True)
        payload["status"] = "complete"
    except KeyboardInterrupt:
        payload["status"] = "interrupted"
        print("interrupted: the result holds the rows measured so far", flush=True)
    finally:
        save()
        print(f"wrote {common.result_path(name)}")
    failed = [row["name"] for report in payload["shapes"] for row in report.get("rows", []) if row["status"] != "ok"]
    if failed:
        print(f"not timed (failed or outside the error bound): {len(failed)} rows; see the result's 'status' fields")
    return 130 if payload["status"] == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
