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

With `--prefill` the attention timed is a prefill step's instead: `--batch` prompt chunks of
`--chunk` queries each, packed as the engine packs them, over `--prefix` earlier keys of their
sequence already in the pool (0: fresh prompts) and their own:

- the Triton varlen prefill kernel (the engine's on CUDA for chunks over cached keys) and the torch
  fallback (per sequence: gather its pages, SDPA);
- SDPA on the same chunks as a padded batch of contiguous K/V (what an eager transformers prefill
  runs);
- torch's flash varlen attention (`torch.nn.attention.varlen.varlen_attn`, CUDA only) on the packed
  chunks with contiguous K/V, and on the page pool itself through a block table (one batch element
  per sequence and KV head, as the pool holds one head per page); with fresh chunks also as the
  engine calls it for a step of them in fp16/bf16 (kernels/flash.py: the keys are the step's own);
- xformers' memory-efficient attention with a block-diagonal causal mask, where xformers is installed.

A form that cannot run here (no CUDA, a page size the flash kernel refuses) is recorded as failed,
so one run says which of the field's kernels could take more of the hand-written one's work, and at what
speed (TFLOP/s: 4 x query-key pairs x head dim x query heads).

Each time is the median of `triton.testing.do_bench` on CUDA (a wall-clock median elsewhere). The
bytes a decode attention must move are its keys and values, read once (queries and outputs are
negligible); over the time they give the achieved bandwidth, reported against the device's
device-to-device copy rate measured in the same run. Every kernel's output is checked first against
the torch fallback in fp32 on the same inputs: one outside the error bound of its dtype is recorded
as wrong and not timed, one that raises (a variant that does not compile, say: too much shared
memory) as failed with its error, and the run goes on; only rows within the bound are timed and can
be the fastest. Result: bench/results/kernels-<device>.json (kernels-prefill-<device>[-after-<prefix>].json),
rewritten after every row (its "status": running, complete or interrupted).
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
    p.add_argument("--prefill", action="store_true", help="time prefill attention instead (module docstring)")
    p.add_argument("--chunk", type=int, default=128, help="--prefill: queries per prompt chunk")
    p.add_argument("--prefix", type=int, default=0, help="--prefill: earlier keys of each sequence in the pool")
    p.add_argument("--quick", action="store_true", help="batch 2, context 64, one small shape, two variants")
    p.add_argument("--out", default=None, help="result name under bench/results (default: kernels-<device>)")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.batch, ns.context, ns.shapes, ns.variants, ns.dtype = 2, 64, "4/2/16", "tile=32;warps=4;stages=1,2", "float32"
        ns.chunk = 16
    if ns.prefill:
        ns.context = ns.prefix + ns.chunk
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
    if "tflops" in row:
        return (f"  {row['name']:<44} {row['ms'] * 1000:9.1f} us  {row['tflops']:7.2f} TFLOP/s"
                f"  rel. error {row['relative_error']:.1e}")
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


def packed_chunks(x: dict[str, torch.Tensor], chunk: int) -> dict[str, torch.Tensor]:
    """paged_inputs laid out as a prefill step: each sequence's last `chunk` positions are its chunk's
    queries (packed [batch * chunk, query heads, head dim]), its keys and values those of the pool
    (the chunk's own packed [batch * chunk, KV heads, head dim] too), with the boundaries as the
    engine's packed prefills and flash varlen attention take them."""
    batch, kv_heads, context, head_dim = x["k"].shape
    q_heads = x["q"].shape[1]
    gen = torch.Generator(device="cpu").manual_seed(1)
    device = x["k"].device
    q = torch.randn(batch * chunk, q_heads, head_dim, generator=gen).to(device, x["k"].dtype)
    starts = torch.arange(0, batch * chunk + 1, chunk, device=device, dtype=torch.int32)
    key_starts = torch.arange(0, batch * context + 1, context, device=device, dtype=torch.int32)
    return {"q": q, "query_starts": starts, "key_starts": key_starts,
            "context_lens": torch.full((batch,), context, device=device, dtype=torch.int32),
            "k_packed": x["k"].transpose(1, 2).reshape(batch * context, kv_heads, head_dim),
            "v_packed": x["v"].transpose(1, 2).reshape(batch * context, kv_heads, head_dim)}


def flash_varlen_paged(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: torch.Tensor,
                       context_lens: torch.Tensor, chunk: int, scale: float) -> torch.Tensor:
    """varlen_attn on the page pool through a block table: the pool's pages hold one KV head each, so
    each (sequence, KV head) is one batch element of one KV head, its queries that head's group."""
    from torch.nn.attention.varlen import varlen_attn

    batch, kv_heads, _ = table.shape
    q_heads, head_dim = q.shape[1:]
    group = q_heads // kv_heads
    grouped = q.view(batch, chunk, kv_heads, group, head_dim).transpose(1, 2).reshape(-1, group, head_dim)
    starts = torch.arange(0, batch * kv_heads * chunk + 1, chunk, device=q.device, dtype=torch.int32)
    pages = (k_pages[:, :, None, :], v_pages[:, :, None, :])
    out = varlen_attn(grouped, *pages, starts, None, chunk, int(context_lens.max()), scale=scale,
                      window_size=(-1, 0), enable_gqa=group > 1, block_table=table.reshape(batch * kv_heads, -1).int(),
                      seqused_k=context_lens.repeat_interleave(kv_heads))
    return out.view(batch, kv_heads, chunk, group, head_dim).transpose(1, 2).reshape(q.shape)


def xformers_block_diagonal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, context: int,
                            scale: float) -> torch.Tensor:
    """xformers' memory-efficient attention over the packed chunks, each query seeing its own
    sequence's keys up to its position (the mask aligned to the keys' end), K/V heads repeated to the
    query heads."""
    from xformers.ops import fmha

    batch = q.shape[0] // chunk
    mask = fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens([chunk] * batch, [context] * batch)
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    return fmha.memory_efficient_attention(q[None], k[None], v[None], attn_bias=mask, scale=scale)[0]


def bench_prefill_shape(shape: str, ns: argparse.Namespace, device: torch.device,
                        report: dict[str, Any] | None = None, save: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Every prefill attention form on `shape` (module docstring), filled into `report` row by row."""
    from depthserve.kernels import flash
    from depthserve.kernels import paged as torch_paged
    from depthserve.kernels.triton import paged as triton_paged

    report = {"shape": shape} if report is None else report
    q_heads, kv_heads, head_dim = (int(x) for x in shape.split("/"))
    chunk, context, batch = ns.chunk, ns.context, ns.batch
    x = paged_inputs(batch, q_heads, kv_heads, head_dim, context, ns.block_size, DTYPES[ns.dtype], device)
    p = packed_chunks(x, chunk)
    scale = head_dim ** -0.5
    args = (p["q"], x["k_pages"], x["v_pages"], x["table"], p["query_starts"], p["context_lens"], scale)
    reference = torch_paged.paged_prefill_attention_varlen(p["q"].float(), x["k_pages"].float(), x["v_pages"].float(),
                                                           *args[3:])
    pairs = batch * chunk * (context - chunk) + batch * chunk * (chunk + 1) // 2  # causal query-key pairs
    report.update(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, chunk=chunk, prefix=ns.prefix, rows=[])
    bound = error_bound(ns.dtype)

    def record(name: str, fn: Callable[[], torch.Tensor]) -> None:
        row = {"name": name, **measure(fn, reference, bound, device)}
        if row["status"] == "ok":
            row["tflops"] = 4 * pairs * head_dim * q_heads / (row["ms"] / 1000) / 1e12
        print(describe(row, None), flush=True)
        report["rows"].append(row)
        save()

    def padded_sdpa() -> torch.Tensor:
        query = p["q"].view(batch, chunk, q_heads, head_dim).transpose(1, 2)
        positions = torch.arange(context, device=device)
        mask = positions[None, :] <= positions[context - chunk:, None]  # query i is at position prefix + i
        out = F.scaled_dot_product_attention(query, x["k"], x["v"], attn_mask=None if ns.prefix == 0 else mask,
                                             is_causal=ns.prefix == 0, scale=scale, enable_gqa=q_heads != kv_heads)
        return out.transpose(1, 2).reshape(p["q"].shape)

    def flash_contiguous() -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(p["q"], p["k_packed"], p["v_packed"], p["query_starts"], p["key_starts"], chunk, context,
                           scale=scale, window_size=(-1, 0), enable_gqa=q_heads != kv_heads)

    print(f"prefill, shape {shape} (query heads / KV heads / head dim), {batch} chunks of {chunk} queries after "
          f"{ns.prefix} cached keys, {ns.dtype}:")
    record("triton varlen (the engine's over cached keys)", lambda: triton_paged.paged_prefill_attention_varlen(
        *args, max_queries=chunk))
    record("torch fallback (gather, SDPA per sequence)", lambda: torch_paged.paged_prefill_attention_varlen(*args))
    record("sdpa, padded batch, contiguous K/V", padded_sdpa)
    record("flash varlen, contiguous K/V", flash_contiguous)
    if ns.prefix == 0:  # the engine's call for a step of fresh chunks (kernels/flash.py)
        record("flash varlen (the engine's for fresh chunks)", lambda: flash.fresh_prefill_attention(
            p["q"], p["k_packed"], p["v_packed"], p["query_starts"], chunk, scale))
    record("flash varlen, paged (block table)", lambda: flash_varlen_paged(
        p["q"], x["k_pages"], x["v_pages"], x["table"], p["context_lens"], chunk, scale))
    record("xformers, block-diagonal causal", lambda: xformers_block_diagonal(
        p["q"], p["k_packed"], p["v_packed"], chunk, context, scale))
    return report


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    device = torch.device(common.resolve_device(ns.device))
    name = ns.out or (f"kernels-{'prefill-' if ns.prefill else ''}{common.device_slug(str(device))}"
                      + (f"-after-{ns.prefix}" if ns.prefill and ns.prefix else "") + ("-quick" if ns.quick else ""))
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
                if ns.prefill:
                    bench_prefill_shape(shape, ns, device, report, save)
                else:
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
