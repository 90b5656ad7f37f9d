"""Step time of one prompt chunk against the context it attends to: what the scheduler's
long-prefill knobs (docs/server.md, "Scheduling") are chosen from.

    python bench/prefill_chunks.py --threads 2                       # chunks 32..512 at contexts 0..7424
    python bench/prefill_chunks.py --threads 2 --chunks 64,256 --contexts 0,4096 --repeats 1

Method: one engine (prefix caching on, a step budget of the largest chunk) prefills a prompt of
`max(contexts) + max(chunks)` random tokens once, so every block of it is cached. For each context
L and chunk C, a request whose prompt is the first L tokens of that prompt followed by C tokens it
does not share then finds its first L tokens cached and computes the C others in one step (one
new token, EOS ignored): that step's wall time is the time of a C-token chunk at context L. Each
figure is the median of `--repeats` such steps (the request's own blocks are forgotten between
them). A 4-token prompt alone gives the short request's own step for comparison.
Result: bench/results/prefill-chunks-<label>.json.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--chunks", default="32,64,128,256,512", help="chunk sizes, comma-separated")
    p.add_argument("--contexts", default="0,2048,4096,7424", help="cached context lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default=None, help="result name: prefill-chunks-<label>.json (default: the device)")
    return p.parse_args(argv)


def timed_step_ms(engine, request_id: str, prompt: list[int]) -> float:
    """Wall milliseconds of the one step that computes `prompt`'s uncached tokens and samples one token."""
    from depthserve.sampling_params import SamplingParams

    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    engine.step()
    elapsed = 1000 * (time.perf_counter() - start)
    if engine.has_unfinished_requests():
        raise SystemExit(f"request {request_id} took more than one step: raise the step budget")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from depthserve.config import EngineArgs
    from depthserve.engine.llm_engine import LLMEngine

    chunks = [int(c) for c in common.parse_number_list(ns.chunks)]
    contexts = [int(c) for c in common.parse_number_list(ns.contexts)]
    engine = LLMEngine(EngineArgs(model=ns.model, device=ns.device, num_threads=ns.threads, load_progress=False,
                                  max_num_batched_tokens=max(chunks) + 16, max_num_seqs=4,
                                  long_prefill_token_threshold=0))  # every chunk in one step, uncapped
    rng = random.Random(ns.seed)
    vocab = [t for t in range(1000, engine.vocab_size) if t not in engine.eos_token_ids]
    base = [rng.choice(vocab) for _ in range(max(contexts) + max(chunks))]
    engine.warm_up()
    prefill(engine, base)
    rows = []
    short_ms = statistics.median(timed_step_ms(engine, f"short-{i}", [rng.choice(vocab) for _ in range(4)])
                                 for i in range(max(ns.repeats, 3)))
    print(f"a 4-token prompt alone: {short_ms:.1f} ms", flush=True)
    for context in contexts:
        for chunk in chunks:
            times = []
            for repeat in range(ns.repeats):
                tail = [rng.choice(vocab) for _ in range(chunk)]
                times.append(timed_step_ms(engine, f"c{context}-{chunk}-{repeat}", base[:context] + tail))
            rows.append({"context": context, "chunk": chunk, "step_ms": statistics.median(times), "samples_ms": times})
            print(f"context {context:>5} chunk {chunk:>4}: {rows[-1]['step_ms']:8.1f} ms", flush=True)
    device = common.resolve_device(ns.device)
    payload = {"benchmark": "prefill_chunks", "settings": vars(ns), "short_prompt_step_ms": short_ms, "steps": rows,
               "environment": common.environment(device, ns.threads)}
    print(f"wrote {common.write_result(f'prefill-chunks-{ns.label or common.device_slug(device)}', payload)}")
    return 0


def prefill(engine, prompt: list[int]) -> None:
    """Compute `prompt` in steps of the engine's budget, leaving its blocks in the prefix cache."""
    from depthserve.sampling_params import SamplingParams

    engine.add_request("prefill", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


if __name__ == "__main__":
    sys.exit(main())
