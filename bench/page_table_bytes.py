"""Page-table bytes per decode step of the compiled static decode: updated by what changed
(depthserve/engine/page_tables.py) against rebuilt whole every step (the engine before it).

A Llama with SmolLM2-135M's table layout (30 layers x 3 KV heads: 90 columns; 8,192 positions in
blocks of 16: 512 blocks a row) and tiny widths (the bytes depend on the layout, not the model),
fp32 on CPU, compiled decode steps, `--requests` requests at most `--concurrency` at a time
(admissions and finishes all along). Per static decode step, on average:

- before: the host fill of the int64 tables (every row's remapped table built by the runner, the
  bucket's table region reset to the scratch page, each row copied in) and, on CUDA, the
  host-to-device copy of the bucket's tables at full width (bucket x 512 x 90 x 8 bytes);
- after: the page ids written (new blocks, rows new to their index, padding rows' first block),
  what CUDA would send (the staged update: moves, block indices, page ids) and the bytes moved
  between rows on the device.

    python bench/page_table_bytes.py [--concurrency 64] [--requests 96] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from depthserve import LLM, SamplingParams
from depthserve.archs.llama.format import LlamaSpec, to_section
from depthserve.lab.tiny.llama import TINY, base_config, llama_weights
from depthserve.loading.checkpoint import write_checkpoint
from depthserve.lab.make_tiny import load_default_tokenizer

LAYOUT = dict(num_hidden_layers=30, hidden_size=48, intermediate_size=96, num_attention_heads=3, num_key_value_heads=3,
              max_position_embeddings=8192)


def checkpoint(out: Path) -> Path:
    tokenizer = load_default_tokenizer()
    cfg = base_config(tokenizer, TINY | LAYOUT, tied=False)
    cfg["depth"] = to_section(LlamaSpec())
    return write_checkpoint(out, cfg, llama_weights(cfg, torch.Generator().manual_seed(0)), tokenizer)


def measure(model: Path, concurrency: int, requests: int, max_tokens: int) -> dict[str, float]:
    llm = LLM(str(model), device="cpu", dtype="float32", load_progress=False, max_model_len=8192,
              block_size=16, max_num_seqs=concurrency, enforce_eager=False, kv_cache_memory_gib=1.0,
              max_num_batched_tokens=8192)
    static = llm.engine.runner.static
    tables = static.tables
    width, max_blocks = static.width, static.max_blocks
    steps: list[dict[str, int]] = []
    run, update = static.run, tables.update

    def counted_update(row_tables, size):
        result = update(row_tables, size)
        steps[-1]["cuda_sent"] = 8 * result.staged_words(width)
        return result

    def counted_run(rows):
        size = static.bucket(len(rows))
        used = [row.table.num_blocks for row in rows]
        longest = max(used)
        cpu_blocks = min(max_blocks, max(2, 1 << (longest - 1).bit_length()))
        written, moved = tables.bytes_written, tables.bytes_moved
        steps.append({
            "rows": len(rows),
            # the runner's remap (int32 gather + int64 where), the reset of the region, the row copies
            "before_cpu_fill": 8 * width * (sum(used) + size * cpu_blocks + sum(used)) + 4 * width * sum(used),
            "before_cuda_fill": 8 * width * (sum(used) + size * max_blocks + sum(used)) + 4 * width * sum(used),
            "before_cuda_copy": 8 * width * size * max_blocks,
        })
        out = run(rows)
        steps[-1]["after_written"] = tables.bytes_written - written
        steps[-1]["after_moved"] = tables.bytes_moved - moved
        return out

    static.run, tables.update = counted_run, counted_update
    stream = np.random.default_rng(0).integers(100, 40_000, 20_000).tolist()
    lengths = np.random.default_rng(1).integers(16, 600, requests).tolist()
    prompts = [stream[i * 97: i * 97 + n] for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True)
              for n in np.random.default_rng(2).integers(max_tokens // 2, max_tokens, requests)]
    llm.generate(prompts, params)
    full = [s for s in steps if s["rows"] == concurrency]
    mean = {key: float(np.mean([s[key] for s in steps])) for key in steps[0]}
    mean["steps"], mean["steps_at_concurrency"] = len(steps), len(full)
    for key in ("before_cuda_copy", "cuda_sent", "after_written"):
        mean[f"{key}_at_concurrency"] = float(np.mean([s[key] for s in full])) if full else 0.0
    return mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = measure(checkpoint(Path(tmp) / "layout"), args.concurrency, args.requests, args.max_tokens)
    kib = 1024
    print(f"{figures['steps']} static decode steps ({figures['steps_at_concurrency']} at {args.concurrency} "
          f"sequences), mean rows {figures['rows']:.1f}; bytes per step:")
    print(f"  before: host fill {figures['before_cpu_fill'] / kib:,.0f} KiB (CPU tables) / "
          f"{figures['before_cuda_fill'] / kib:,.0f} KiB (CUDA tables); host-to-device copy "
          f"{figures['before_cuda_copy'] / kib:,.0f} KiB ({figures['before_cuda_copy_at_concurrency'] / kib:,.0f} KiB "
          f"at {args.concurrency})")
    print(f"  after:  page ids written {figures['after_written'] / kib:,.1f} KiB "
          f"({figures['after_written_at_concurrency'] / kib:,.1f} at {args.concurrency}); host-to-device copy on CUDA "
          f"{figures['cuda_sent'] / kib:,.1f} KiB ({figures['cuda_sent_at_concurrency'] / kib:,.1f} at "
          f"{args.concurrency}); moved on the device {figures['after_moved'] / kib:,.1f} KiB")


if __name__ == "__main__":
    main()
