"""One side of bench/ab.py: an engine of the checkout on PYTHONPATH, stepped one decode step per
line read from stdin (`step`), each step's wall time written back; `tokens` writes every request's
generated token ids; `quit` ends it. Uses only the public API both sides of a comparison share
(`LLM`, `SamplingParams`, `DepthParams`, `engine.add_request` / `step` / `abort_request`)."""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    config = json.loads(sys.argv[1])
    import torch

    import depthserve
    from depthserve import LLM, DepthParams, SamplingParams

    torch.manual_seed(config["seed"])
    llm = LLM(config["model"], dtype=config["dtype"], num_threads=config["threads"], max_num_seqs=config["concurrency"],
              enable_prefix_caching=False, max_model_len=config["input_len"] + config["max_tokens"] + 16,
              load_progress=False, enforce_eager=not config["compiled"], quantization=config["quantization"],
              max_num_batched_tokens=config["step_token_budget"])
    engine = llm.engine
    vocab = engine.vocab_size  # ids below 100: SmolLM2's special tokens, left out
    generator = torch.Generator().manual_seed(config["seed"])
    ids = [f"ab-{i}" for i in range(config["concurrency"])]
    params = SamplingParams(temperature=0.0, max_tokens=config["max_tokens"], ignore_eos=True)
    depth = DepthParams(**config["depth"]) if config["depth"] else None
    for request_id in ids:
        prompt = torch.randint(100, vocab, (config["input_len"],), generator=generator).tolist()
        engine.add_request(request_id, prompt, params, depth)
    latest: dict = {}

    def step() -> None:
        for out in engine.step():
            latest[out.request_id] = out

    def generated() -> list[int]:
        return [len(latest[r].token_ids) if r in latest else 0 for r in ids]

    while min(generated()) < 1:  # prefill, chunked under the step budget
        step()
    for _ in range(config["warmup_steps"]):
        step()
    reply({"ready": True, "depthserve": str(depthserve.__path__[0])})
    for line in sys.stdin:
        command = line.strip()
        if command == "step":
            before = generated()
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            if [b + 1 for b in before] != generated():
                reply({"error": "a timed step did not decode one token for every request"})
                return
            reply({"seconds": elapsed})
        elif command == "tokens":
            reply({"tokens": [list(latest[r].token_ids) for r in ids]})
        elif command == "quit":
            for request_id in ids:
                engine.abort_request(request_id)
            return


def reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
