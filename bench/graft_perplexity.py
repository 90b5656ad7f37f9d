"""Perplexity of a training-free SGT graft (`depthserve graft-sgt`) at several loop counts.

    python bench/graft_perplexity.py                 # SmolLM2-135M, N=3 layers, H=2 heads, K=1
    python bench/graft_perplexity.py --threads 2 --eval-loops 0,1,2,3

Method: the first `--calib-docs` documents of c4_sample.jsonl calibrate the graft (entropies of
paper 000 Eq. 4/5, documents cut every `--max-len` tokens); the remaining documents, each
truncated to its first `--max-len` tokens, are scored through the engine's prompt log-probs
(`LLM.score`), once per `loops` value and once on the ungrafted source model. Perplexity =
exp(mean negative log-probability over every scored token, i.e. positions 1..n-1 of each
document). The source's numbers must equal the graft's at loops = 0 (same weights). Not a
timing benchmark.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--layers", type=int, default=3, help="N looped layers")
    p.add_argument("--heads", type=int, default=2, help="H looped heads per layer")
    p.add_argument("--loops", type=int, default=1, help="K, the graft's default loop count")
    p.add_argument("--eval-loops", default="0,1,2", help="comma-separated loop counts to score")
    p.add_argument("--data", default=str(common.C4_SAMPLE))
    p.add_argument("--calib-docs", type=int, default=15, help="the first this many documents calibrate")
    p.add_argument("--max-len", type=int, default=512, help="tokens per evaluation document (and calibration cut)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--graft-dir", default=None, help="keep the grafted checkpoint here (default: a temp dir)")
    p.add_argument("--out", default="graft-perplexity", help="result name under bench/results")
    return p.parse_args(argv)


def perplexity(scores: list[list[float | None]]) -> tuple[float, int, float]:
    """(perplexity, scored tokens, summed negative log-prob) over every non-None entry."""
    values = [v for row in scores for v in row[1:]]
    nll = -math.fsum(values)
    return math.exp(nll / len(values)), len(values), nll


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    torch.set_num_threads(ns.threads)
    from depthserve import LLM, DepthParams
    from depthserve.lab.sgt_graft import GRAFT_FILE, graft
    from depthserve.loading.registry import resolve_model
    from depthserve.loading.tokenizer import load_tokenizer

    data = Path(ns.data)
    if not data.is_file():
        print(f"error: {data} does not exist", file=sys.stderr)
        return 2
    texts = common.read_jsonl_texts(data)
    calib_texts, eval_texts = texts[: ns.calib_docs], texts[ns.calib_docs :]
    eval_loops = [int(v) for v in ns.eval_loops.split(",")]
    tokenizer = load_tokenizer(resolve_model(ns.model))
    eval_ids = [tokenizer.encode(t, add_special_tokens=False)[: ns.max_len] for t in eval_texts]

    tmp = tempfile.TemporaryDirectory(prefix="graft-ppl-")
    out = Path(ns.graft_dir) if ns.graft_dir else Path(tmp.name) / "graft"
    start = time.perf_counter()  # the graft of `depthserve graft-sgt ... --calib DATA --calib-docs N`
    graft(ns.model, out, ns.layers, ns.heads, ns.loops, data, max_len=ns.max_len, num_sequences=None,
          max_loops=max(eval_loops + [ns.loops, 2]), progress=True, num_documents=ns.calib_docs)
    graft_seconds = time.perf_counter() - start
    meta = json.loads((out / GRAFT_FILE).read_text())
    for entry in meta["selected"]:
        print(f"layer {entry['layer']} (entropy {entry['layer_entropy']:.4f}): heads {entry['heads']} "
              f"{[round(e, 4) for e in entry['head_entropies']]}")

    engine_args = dict(device=ns.device, dtype="float32", load_progress=False, num_threads=ns.threads,
                       max_model_len=max(len(s) for s in eval_ids) + 8)
    results = {}
    source_scores = LLM(ns.model, **engine_args).score(eval_ids)
    ppl, count, nll = perplexity(source_scores)
    results["source"] = {"perplexity": ppl, "tokens": count, "nll": nll}
    print(f"source model: perplexity {ppl:.4f} over {count} tokens")
    grafted = LLM(str(out), **engine_args)
    identical = None
    for k in eval_loops:
        scores = grafted.score(eval_ids, DepthParams(loops=k))
        ppl, count, nll = perplexity(scores)
        results[f"loops={k}"] = {"loops": k, "perplexity": ppl, "tokens": count, "nll": nll}
        if k == 0:
            identical = scores == source_scores
            results["loops=0"]["identical_to_source"] = identical
        print(f"graft, loops {k}: perplexity {ppl:.4f} over {count} tokens")
    del grafted

    payload = {
        "benchmark": "graft-perplexity",
        "description": "training-free SGT graft (no weight changes): perplexity on held-out c4 documents "
                       "through the engine's prompt log-probs, per `loops` value",
        "settings": {
            "model": ns.model, "layers": ns.layers, "heads": ns.heads, "graft_loops": ns.loops,
            "eval_loops": eval_loops, "max_len": ns.max_len, "device": ns.device, "dtype": "float32",
            "data": str(data), "calibration_documents": f"0..{len(calib_texts) - 1}",
            "evaluation_documents": f"{len(calib_texts)}..{len(texts) - 1}",
            "evaluation_tokens_per_document": [len(s) for s in eval_ids],
        },
        "graft": {
            "looped_layers": [e["layer"] for e in meta["selected"]],
            "selected": meta["selected"],
            "layer_entropy": meta["layer_entropy"],
            # graft.json names the file; name the documents too
            "calibration": {**meta["calibration"], "source": f"{data.name} documents 0..{len(calib_texts) - 1}"},
            "seconds": graft_seconds,
        },
        "results": results,
        "loops0_identical_to_source": identical,
        "environment": common.environment(ns.device, ns.threads),
    }
    print(f"wrote {common.write_result(ns.out, payload)}")
    tmp.cleanup()
    if not identical:
        print("error: loops = 0 differs from the source model", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
