"""Held-out fidelity of the CPU weight formats against the fp32 path (issue 34's "Done when").

    python bench/quant_fidelity.py                   # full run: 570 ARC-Easy questions, 30 C4 docs, 32 prompts
    python bench/quant_fidelity.py --quick           # a small subset (smoke run), writes ...-quick.json
    python bench/quant_fidelity.py --machine cpu-2core --formats fp32,default

Formats (each one `LLM(model, dtype=..., quantization=...)`, loaded one after the other):

  fp32     dtype float32,  quantization none   the reference: weights dequantized from the file to fp32
  default  dtype auto,     quantization auto   the new CPU default (bf16 activations + the GGUF's own
                                               Q4_1 codes and its Q8_0 table, on the native kernels where
                                               they load, else torch's with the table in bf16)
  bf16     dtype bfloat16, quantization none   bf16 activations, dense bf16 weights
  int8     dtype bfloat16, quantization int8   bf16 activations, int8 per-row weights quantized at load
  int4     dtype bfloat16, quantization int4   (optional) int4 groups of 32 re-rounded at load

Four measurements, every format on the same token ids, scheduled the same way:

1. ARC-Easy validation (`--arc`, 570 questions), lm-eval's "arc_easy" formulation: context
   "Question: {question}\\nAnswer:", continuation " {choice}", tokenized as lm-eval's HF model does
   (context alone, then the continuation's tokens = those of context+continuation past the context's;
   no BOS). Each choice's log-likelihood is the sum of the engine's prompt log-probs
   (`SamplingParams(prompt_logprobs=0, max_tokens=0)`) over the continuation tokens; acc picks the
   highest sum, acc_norm the highest sum divided by the choice's length in characters (first on
   ties, as numpy's argmax). The question x choice requests go through `llm.generate` in chunks of
   `--arc-chunk` questions (60: ~240 requests a call, batched by the engine; each chunk is saved with
   --raw-dir, so an interrupted run resumes from the last chunk). (Prompt log-probs need every position computed, so the engine does not
   reuse cached prefixes for them: each request runs its full context.) Checked once: the fp32
   path's 400 log-likelihoods of the first 100 questions are within 1.7e-4 of lm-eval's own `hf` run
   in bench/results/lm-eval-arc-easy.json, with the same acc (0.48) and acc_norm (0.36).
2. C4 perplexity (`--c4`, 30 documents): each document's first `--window` tokens (512; shorter
   documents whole), perplexity = exp(mean negative log-prob of tokens 1..n-1, pooled over all
   documents); per-document perplexities are recorded too.
3. Greedy agreement with fp32: `--prompts` prompts of `--prompt-len` tokens cut from the C4 documents
   (`common.token_windows`), `--new-tokens` (64) tokens each at temperature 0 with ignore_eos. Per
   format: the fraction of fp32's generated tokens matched before the first divergence (summed over
   prompts), and the fraction of prompts identical over all of them.
4. The same at batch 1 (`--batch1-prompts`, the first 4 of those prompts, each generated alone).

Which kernels these exercise: a quantized layer runs the weight-only kernel (the native one where it
loads, else torch's) up to a row count set per kind of CPU (`QuantPolicy.for_this_cpu`, recorded per
format in the result as `kernel_max_rows`, null where unlimited) and dequantizes into a bf16 GEMM
above that. With AMX (limit 96) prefill steps (the engine's 512-token budget) take the dequantize +
GEMM path; without AMX every step runs the native kernel, so prefill activations are rounded to int8
per group too. The LM head of prompt scoring (one call per sequence and step, ~20-60 rows for ARC),
the batched greedy run's decode steps (32 rows) and the batch-1 decode steps take the kernel.

Reported against fp32: accuracy differences in points (with the standard error of the paired
difference), the perplexity ratio, the mean |log-prob difference| per scored token. The issue's pass
criteria, checked for the new default (and shown for every format): ARC-Easy acc within 1 point of
fp32, C4 perplexity within 2%. Result: bench/results/quant-fidelity-<machine>[-quick].json with the
machine (CPU model, instruction sets), versions, commit, date and settings. Exit status 1 when the
default misses a criterion in a full run (never in --quick, whose subset is too small to decide),
2 when the data files are missing or a format gives non-finite log-probs.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

DATA_DIR = common.C4_SAMPLE.parent
ARC_DATA = DATA_DIR / "arc_easy_validation.jsonl"

FORMATS: dict[str, dict[str, str]] = {
    "fp32": {"dtype": "float32", "quantization": "none"},
    "default": {"dtype": "auto", "quantization": "auto"},
    "bf16": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "int4": {"dtype": "bfloat16", "quantization": "int4"},
}
DEFAULT_FORMATS = "fp32,default,bf16,int8"
REFERENCE = "fp32"
CRITERIA = {"arc_acc_points": 1.0, "c4_perplexity_ratio": 0.02}  # |acc - fp32| <= 1 point, |ppl/fp32 - 1| <= 2%

CONTEXT_TEMPLATE = "Question: {question}\nAnswer:"
CONTINUATION_TEMPLATE = " {choice}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--machine", default="cpu-2core", help="short tag of this machine, in the result's file name")
    p.add_argument("--formats", default=DEFAULT_FORMATS,
                   help=f"comma-separated, from {', '.join(FORMATS)}; fp32 (the reference) is always run first")
    p.add_argument("--quick", action="store_true",
                   help="a small subset: 40 questions, 4 documents of 256 tokens, 8 prompts x 32 tokens, "
                        "1 of them at batch 1")
    p.add_argument("--arc", type=Path, default=ARC_DATA, help="ARC-Easy validation JSON lines")
    p.add_argument("--c4", type=Path, default=common.C4_SAMPLE, help="C4 sample JSON lines")
    p.add_argument("--limit", type=int, default=None, help="the first N ARC questions (default: all; --quick 40)")
    p.add_argument("--arc-chunk", type=int, default=60, help="ARC questions per llm.generate call")
    p.add_argument("--docs", type=int, default=None, help="the first N C4 documents (default: all; --quick 4)")
    p.add_argument("--window", type=int, default=None, help="tokens per C4 document (default 512; --quick 256)")
    p.add_argument("--prompts", type=int, default=None, help="greedy prompts (default 32; --quick 8)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per greedy prompt")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per prompt (default 64; --quick 32)")
    p.add_argument("--batch1-prompts", type=int, default=None,
                   help="of the greedy prompts, how many also run alone (batch-1 decode; default 4, --quick 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--raw-dir", type=Path, default=None,
                   help="keep each format's raw scores here and reuse them on a rerun with the same inputs and "
                        "engine sources (resumes a long run)")
    p.add_argument("--output", type=Path, default=None,
                   help="result file (default bench/results/quant-fidelity-<machine>[-quick].json)")
    ns = p.parse_args(argv)
    quick = ns.quick
    for name, full, small in (("docs", None, 4), ("window", 512, 256), ("prompts", 32, 8), ("new_tokens", 64, 32),
                              ("batch1_prompts", 4, 1)):
        if getattr(ns, name) is None:
            setattr(ns, name, small if quick else full)
    if ns.limit is None and quick:
        ns.limit = 40
    names = [f.strip() for f in ns.formats.split(",") if f.strip()]
    unknown = [f for f in names if f not in FORMATS]
    if unknown:
        p.error(f"unknown format(s) {unknown}; choose from {', '.join(FORMATS)}")
    ns.batch1_prompts = min(ns.batch1_prompts, ns.prompts)
    ns.format_names = [REFERENCE] + [f for f in dict.fromkeys(names) if f != REFERENCE]
    if ns.output is None:
        ns.output = common.result_path(f"quant-fidelity-{ns.machine}{common.QUICK_SUFFIX if quick else ''}")
    return ns


# ---- pure scoring logic (tests/test_quant_fidelity.py) -------------------------------------------
def read_arc(path: Path, limit: int | None = None) -> list[dict]:
    """ARC rows (id, question, choices{text,label}, answerKey), each with its gold index as "gold"."""
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        row["gold"] = row["choices"]["label"].index(row["answerKey"])
        rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    return rows


def encode_pair(encode, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's HF `_encode_pair`: trailing spaces of the context move to the continuation; the
    continuation's tokens are those of context+continuation past the context's own tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = list(encode(context + continuation))
    context_ids = list(encode(context))
    return context_ids, whole[len(context_ids):]


def arc_requests(rows: Sequence[dict], encode) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """Token ids of every question x choice request, and per request (question, choice, number of
    continuation tokens) in the same order."""
    prompts, index = [], []
    for q, row in enumerate(rows):
        context = CONTEXT_TEMPLATE.format(question=row["question"])
        for c, choice in enumerate(row["choices"]["text"]):
            context_ids, continuation_ids = encode_pair(encode, context, CONTINUATION_TEMPLATE.format(choice=choice))
            if not continuation_ids:
                raise ValueError(f"question {row.get('id', q)}: choice {choice!r} has no tokens of its own")
            prompts.append(context_ids + continuation_ids)
            index.append((q, c, len(continuation_ids)))
    return prompts, index


def chunk_ranges(index: Sequence[tuple[int, int, int]], questions_per_chunk: int) -> list[tuple[int, int]]:
    """[start, end) request ranges holding `questions_per_chunk` whole questions each, in order."""
    bounds = [i for i, (q, c, _) in enumerate(index) if c == 0 and q % questions_per_chunk == 0] + [len(index)]
    return list(zip(bounds[:-1], bounds[1:]))


def continuation_loglik(scores: Sequence[float | None], num_continuation: int) -> float:
    """Sum of the last `num_continuation` prompt log-probs (one row of `LLM.score`'s layout)."""
    tail = scores[len(scores) - num_continuation:]
    if num_continuation < 1 or len(tail) != num_continuation or any(v is None for v in tail):
        raise ValueError(f"cannot take {num_continuation} continuation log-probs from {len(scores)} positions")
    return math.fsum(tail)


def group_logliks(values: Sequence[float], index: Sequence[tuple[int, int, int]], num_questions: int) -> list[list[float]]:
    """Per-request log-likelihoods regrouped as one list per question, in choice order."""
    out: list[list[float]] = [[] for _ in range(num_questions)]
    for value, (q, c, _) in zip(values, index, strict=True):
        if c != len(out[q]):
            raise ValueError(f"question {q}: choice {c} out of order")
        out[q].append(value)
    return out


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value, the first one on ties (numpy's argmax, as lm-eval uses)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def predictions(logliks: Sequence[float], choices: Sequence[str]) -> tuple[int, int]:
    """(acc's pick, acc_norm's pick): the highest log-likelihood, and the highest per character of
    the choice text (lm-eval's acc_norm: len(choice) without the leading space)."""
    return argmax(logliks), argmax([ll / len(text) for ll, text in zip(logliks, choices, strict=True)])


def mean_stderr(values: Sequence[float]) -> float:
    """Standard error of the mean with the sample standard deviation (lm-eval's mean_stderr)."""
    n = len(values)
    if n < 2:
        return float("nan")
    mean = math.fsum(values) / n
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1) / n)


def arc_metrics(question_logliks: Sequence[Sequence[float]], rows: Sequence[dict]) -> dict:
    """acc and acc_norm (with standard errors) and the per-question picks."""
    pred, pred_norm = [], []
    for logliks, row in zip(question_logliks, rows, strict=True):
        a, b = predictions(logliks, row["choices"]["text"])
        pred.append(a)
        pred_norm.append(b)
    correct = [float(p == row["gold"]) for p, row in zip(pred, rows)]
    correct_norm = [float(p == row["gold"]) for p, row in zip(pred_norm, rows)]
    n = len(rows)
    return {
        "questions": n,
        "acc": math.fsum(correct) / n, "acc_stderr": mean_stderr(correct),
        "acc_norm": math.fsum(correct_norm) / n, "acc_norm_stderr": mean_stderr(correct_norm),
        "pred": pred, "pred_norm": pred_norm,
    }


def paired_difference(pred: Sequence[int], ref_pred: Sequence[int], gold: Sequence[int]) -> dict:
    """A format's accuracy minus the reference's, in points, with the standard error of the paired
    per-question difference, and how many questions the two pick differently."""
    diffs = [float(p == g) - float(r == g) for p, r, g in zip(pred, ref_pred, gold, strict=True)]
    return {
        "points": 100 * math.fsum(diffs) / len(diffs),
        "stderr_points": 100 * mean_stderr(diffs),
        "different_picks": sum(p != r for p, r in zip(pred, ref_pred)),
        "gained": sum(d > 0 for d in diffs), "lost": sum(d < 0 for d in diffs),
    }


def perplexity(rows: Sequence[Sequence[float | None]]) -> dict:
    """Pooled perplexity exp(mean NLL) over positions 1.. of every row, its token count and summed
    NLL, and each row's own perplexity."""
    values = [v for row in rows for v in row[1:]]
    if not values or any(v is None for v in values):
        raise ValueError("perplexity needs at least one scored token and no missing log-prob past position 0")
    nll = -math.fsum(values)
    per_row = [math.exp(-math.fsum(row[1:]) / (len(row) - 1)) if len(row) > 1 else None for row in rows]
    return {"perplexity": math.exp(nll / len(values)), "tokens": len(values), "nll": nll, "per_document": per_row}


def logprob_drift(rows: Sequence[Sequence[float | None]], ref_rows: Sequence[Sequence[float | None]]) -> dict:
    """Mean and max |log-prob difference| per scored position between two score layouts."""
    diffs = [abs(a - b) for row, ref in zip(rows, ref_rows, strict=True)
             for a, b in zip(row, ref, strict=True) if a is not None and b is not None]
    return {"mean_abs": math.fsum(diffs) / len(diffs) if diffs else 0.0, "max_abs": max(diffs, default=0.0)}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy_agreement(outputs: Sequence[Sequence[int]], ref_outputs: Sequence[Sequence[int]]) -> dict:
    """Agreement of generated token ids with the reference's: the fraction of the reference's tokens
    matched before each prompt's first divergence (summed over prompts), the fraction of prompts
    identical throughout, and each prompt's first divergence (None when identical)."""
    prefixes, first, total = [], [], 0
    for out, ref in zip(outputs, ref_outputs, strict=True):
        n = common_prefix(out, ref)
        prefixes.append(n)
        identical = n == len(ref) == len(out)
        first.append(None if identical else n)
        total += len(ref)
    return {
        "prompts": len(prefixes),
        "token_agreement": sum(prefixes) / total if total else 1.0,
        "identical_fraction": sum(f is None for f in first) / len(first) if first else 1.0,
        "identical_prompts": sum(f is None for f in first),
        "first_divergence": first,
    }


def criteria(arc_diff: dict | None, ppl_ratio: float | None) -> dict:
    """The issue's checks for one format against fp32 (None where a measurement was not run)."""
    out = {}
    if arc_diff is not None:
        out["arc_acc_within_1_point"] = abs(arc_diff["points"]) <= CRITERIA["arc_acc_points"] + 1e-9
    if ppl_ratio is not None:
        out["c4_perplexity_within_2_percent"] = abs(ppl_ratio - 1) <= CRITERIA["c4_perplexity_ratio"] + 1e-12
    out["pass"] = all(out.values()) if out else None
    return out


def all_finite(rows: Sequence[Sequence[float | None]]) -> bool:
    return all(v is None or math.isfinite(v) for row in rows for v in row)


# ---- the engine runs -----------------------------------------------------------------------------
def score(llm, prompts: list[list[int]]) -> list[list[float | None]]:
    """`LLM.score` (prompt log-probs of every position), all prompts in one `generate` call."""
    return llm.score(prompts)


def generate_greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from depthserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(prompts, params)]


def kernel_max_rows(model) -> int | None:
    """The row count up to which the model's quantized layers run the weight-only kernel (None: every
    row count, or no quantized layer)."""
    from depthserve.layers.quantized import EVERY_ROW_COUNT, QuantLinear

    for module in model.modules():
        if isinstance(module, QuantLinear):
            rows = module.max_kernel_rows
            return None if rows == EVERY_ROW_COUNT else rows
    return None


def run_format(name: str, ns: argparse.Namespace, arc_prompts, arc_chunks, c4_prompts, greedy_prompts,
               done: dict | None = None, save=lambda run: None) -> dict:
    """One format's raw measurements: ARC and C4 prompt log-probs, greedy tokens batched and at batch 1.
    Phases already in `done` (a saved partial run) are kept; `save(run)` is called after each phase."""
    import torch

    from depthserve import LLM

    phases = [("arc_scores", bool(arc_prompts)), ("c4_scores", bool(c4_prompts)),
              ("greedy_tokens", bool(greedy_prompts)), ("greedy_batch1_tokens", bool(greedy_prompts and ns.batch1_prompts))]
    def finished(run: dict, key: str) -> bool:
        return key in run and (key != "arc_scores" or len(run[key]) == len(arc_prompts))

    if done is not None and all(finished(done, key) for key, wanted in phases if wanted):
        print(f"\n[{name}] every measurement kept from a previous run", flush=True)
        return done
    out = dict(done or {})
    spec = FORMATS[name]
    print(f"\n[{name}] LLM({ns.model!r}, dtype={spec['dtype']!r}, quantization={spec['quantization']!r})"
          + (f"; kept from a previous run: {', '.join(k for k, _ in phases if k in out)}"
             f" ({len(out.get('arc_scores', []))} of {len(arc_prompts)} ARC requests)" if done else ""), flush=True)
    start = time.perf_counter()
    llm = LLM(ns.model, **spec, load_progress=False, num_threads=ns.threads)
    engine = llm.engine
    out.update({
        **spec,
        "resolved_dtype": str(engine.dtype).removeprefix("torch."),
        "resolved_quantization": engine.quantization.mode,
        "quantization_summary": engine.quantization.summary(),
        "weight_error": engine.quantization.weight_error,
        "resident_weight_mib": round(engine.quantization.resident_bytes / 2**20, 1),
        "kernel_max_rows": kernel_max_rows(engine.model),
        "seconds": {**out.get("seconds", {}), "load": round(time.perf_counter() - start, 1)},
    })
    print(f"  {out['quantization_summary']} (activations {out['resolved_dtype']}), "
          f"loaded in {out['seconds']['load']:.0f}s", flush=True)
    def arc() -> list:
        scores = out.setdefault("arc_scores", [])
        for start, end in arc_chunks:
            if len(scores) >= end:
                continue
            assert len(scores) == start, "ARC chunks out of step with the saved scores"
            t = time.perf_counter()
            scores += score(llm, arc_prompts[start:end])
            out["seconds"]["arc_chunks"] = out["seconds"].get("arc_chunks", 0.0) + time.perf_counter() - t
            print(f"    ARC requests {start}..{end - 1} in {time.perf_counter() - t:.0f}s", flush=True)
            if end < len(arc_prompts):
                save(out)
        return scores

    runs = {
        "arc_scores": ("arc", arc, f"ARC: {len(arc_prompts)} requests"),
        "c4_scores": ("c4", lambda: score(llm, c4_prompts), f"C4: {len(c4_prompts)} documents"),
        "greedy_tokens": ("greedy", lambda: generate_greedy(llm, greedy_prompts, ns.new_tokens),
                          f"greedy: {len(greedy_prompts)} x {ns.new_tokens} tokens"),
        "greedy_batch1_tokens": ("greedy_batch1",
                                 lambda: [generate_greedy(llm, [prompt], ns.new_tokens)[0]
                                          for prompt in greedy_prompts[: ns.batch1_prompts]],
                                 f"greedy, batch 1: {ns.batch1_prompts} x {ns.new_tokens} tokens"),
    }
    with torch.inference_mode():
        for key, wanted in phases:
            if not wanted or finished(out, key):
                continue
            timer, fn, label = runs[key]
            t = time.perf_counter()
            out[key] = fn()
            out["seconds"][timer] = round(time.perf_counter() - t, 1)
            if key == "arc_scores":  # the chunks' own times add up across resumed runs
                out["seconds"][timer] = round(out["seconds"].pop("arc_chunks"), 1)
            print(f"  {label} in {out['seconds'][timer]:.0f}s", flush=True)
            save(out)
    del llm, engine
    gc.collect()
    return out


def source_digest() -> str:
    """A hash of the engine's sources (depthserve/, kernels/) as this run found them: results made by
    different engine code never get mixed up, in the raw-score cache or in the result files."""
    repo = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted([*(repo / "depthserve").rglob("*.py"), *(repo / "kernels").rglob("*.py")]):
        digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def run_or_reuse(name: str, ns: argparse.Namespace, inputs_key: str, arc_prompts, arc_chunks, c4_prompts,
                 greedy_prompts) -> dict:
    """run_format; with --raw-dir, each phase's raw results are saved as they come and a rerun with the
    same inputs and engine sources picks up what a previous (interrupted) run finished."""
    if ns.raw_dir is None:
        return run_format(name, ns, arc_prompts, arc_chunks, c4_prompts, greedy_prompts)
    key = hashlib.sha256(json.dumps([inputs_key, name, FORMATS[name]]).encode()).hexdigest()[:16]
    path = ns.raw_dir / f"{name}-{key}.json"
    done = json.loads(path.read_text()) if path.is_file() else None

    def save(run: dict) -> None:
        ns.raw_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(run))
        partial.replace(path)

    run = run_format(name, ns, arc_prompts, arc_chunks, c4_prompts, greedy_prompts, done, save)
    if done is not None:
        run = {**run, "reused_from": str(path)}  # some or all of its measurements come from an earlier run
    return run


# ---- the report ----------------------------------------------------------------------------------
def git_state() -> dict:
    repo = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=repo, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip() if commit else None,
            "uncommitted_changes": None if status is None else bool(status.strip()),
            "modified_files": None if status is None else [line[3:] for line in status.splitlines()]}


def machine() -> dict:
    import torch

    from depthserve.loading.quantization import cpu_features

    return {"cpu": common.cpu_model(), "logical_cpus": os.cpu_count(), "instruction_sets": cpu_features(),
            "torch_threads": torch.get_num_threads(), "platform": platform.platform()}


def summarize(runs: dict[str, dict], rows, arc_index) -> dict:
    """Per-format metrics and their differences from fp32 (the raw scores stay out of the file)."""
    ref = runs[REFERENCE]
    gold = [row["gold"] for row in rows]
    ref_arc = ref_ppl = None
    results = {}
    for name, run in runs.items():
        entry = {k: run.get(k) for k in ("dtype", "quantization", "resolved_dtype", "resolved_quantization",
                                         "quantization_summary", "weight_error", "resident_weight_mib",
                                         "kernel_max_rows", "seconds", "reused_from")}
        entry["finite"] = all(all_finite(run.get(k, [])) for k in ("arc_scores", "c4_scores"))
        if "arc_scores" in run:
            logliks = [continuation_loglik(s, n) for s, (_, _, n) in zip(run["arc_scores"], arc_index, strict=True)]
            arc = arc_metrics(group_logliks(logliks, arc_index, len(rows)), rows)
            arc["continuation_tokens"] = sum(n for _, _, n in arc_index)
            if name == REFERENCE:
                ref_arc = {"pred": list(arc["pred"]), "pred_norm": list(arc["pred_norm"])}
            else:
                arc["acc_vs_fp32"] = paired_difference(arc["pred"], ref_arc["pred"], gold)
                arc["acc_norm_vs_fp32"] = paired_difference(arc["pred_norm"], ref_arc["pred_norm"], gold)
                arc["loglik_drift_vs_fp32"] = logprob_drift(
                    [[v] for v in logliks],
                    [[continuation_loglik(s, n)] for s, (_, _, n) in zip(ref["arc_scores"], arc_index)])
            # the picks, one digit per question (compact in the file)
            arc["pred"], arc["pred_norm"] = "".join(map(str, arc["pred"])), "".join(map(str, arc["pred_norm"]))
            entry["arc_easy"] = arc
        if "c4_scores" in run:
            ppl = perplexity(run["c4_scores"])
            if name == REFERENCE:
                ref_ppl = ppl
            else:
                ppl["ratio_vs_fp32"] = ppl["perplexity"] / ref_ppl["perplexity"]
                ppl["logprob_drift_vs_fp32"] = logprob_drift(run["c4_scores"], ref["c4_scores"])
            entry["c4"] = ppl
        if "greedy_tokens" in run and name != REFERENCE:
            entry["greedy_vs_fp32"] = greedy_agreement(run["greedy_tokens"], ref["greedy_tokens"])
        if "greedy_batch1_tokens" in run:
            # against fp32 at batch 1, and (for fp32 itself) its batch-1 tokens against its batched ones
            ref_tokens = (ref["greedy_tokens"][: len(run["greedy_batch1_tokens"])] if name == REFERENCE
                          else ref["greedy_batch1_tokens"])
            entry["greedy_batch1_vs_fp32" if name != REFERENCE else "greedy_batch1_vs_batched"] = \
                greedy_agreement(run["greedy_batch1_tokens"], ref_tokens)
        if name != REFERENCE:
            entry["criteria"] = criteria(entry.get("arc_easy", {}).get("acc_vs_fp32"),
                                         entry.get("c4", {}).get("ratio_vs_fp32"))
        results[name] = entry
    return results


def print_table(results: dict, ns) -> None:
    print(f"\nFidelity against fp32 ({ns.model}; ARC-Easy {results[REFERENCE]['arc_easy']['questions']} questions, "
          f"C4 {len(results[REFERENCE]['c4']['per_document'])} docs x <= {ns.window} tokens, "
          f"greedy {ns.prompts} prompts x {ns.new_tokens} tokens)")
    header = (f"{'format':<9}{'acts':<6}{'weights':<8}{'MiB':>6}{'acc':>7}{'Δacc pt':>14}{'acc_norm':>9}"
              f"{'Δnorm pt':>9}{'C4 ppl':>9}{'ratio':>8}{'greedy tok':>11}{'identical':>10}{'batch-1':>9}{'check':>7}")
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        arc, c4 = r["arc_easy"], r["c4"]
        if name == REFERENCE:
            dacc = dnorm = ratio = greedy = ident = check = "-"
            g1 = r.get("greedy_batch1_vs_batched")
            b1 = f"{g1['identical_prompts']}/{g1['prompts']}*" if g1 else "-"
        else:
            d = arc["acc_vs_fp32"]
            dacc = f"{d['points']:+.2f}±{d['stderr_points']:.2f}"
            dnorm = f"{arc['acc_norm_vs_fp32']['points']:+.2f}"
            ratio = f"{c4['ratio_vs_fp32']:.4f}"
            g = r.get("greedy_vs_fp32")
            greedy = f"{g['token_agreement']:.3f}" if g else "-"
            ident = f"{g['identical_prompts']}/{g['prompts']}" if g else "-"
            g1 = r.get("greedy_batch1_vs_fp32")
            b1 = f"{g1['identical_prompts']}/{g1['prompts']}" if g1 else "-"
            check = "PASS" if r["criteria"]["pass"] else "FAIL"
        print(f"{name:<9}{r['resolved_dtype'].replace('bfloat16', 'bf16').replace('float32', 'fp32'):<6}"
              f"{r['resolved_quantization']:<8}{r['resident_weight_mib']:>6.0f}{100 * arc['acc']:>7.2f}{dacc:>14}"
              f"{100 * arc['acc_norm']:>9.2f}{dnorm:>9}{c4['perplexity']:>9.3f}{ratio:>8}{greedy:>11}{ident:>10}{b1:>9}"
              f"{check:>7}")
    print("Δ in points vs fp32 (± the paired difference's standard error); ratio = perplexity / fp32's; "
          "greedy tok = fraction of fp32's tokens matched before the first divergence; identical = prompts "
          "identical to fp32 over all tokens (batched), batch-1 = the same with each prompt alone (fp32's *: "
          "alone vs batched); "
          f"check: |Δacc| <= {CRITERIA['arc_acc_points']:g} point and |ratio - 1| <= "
          f"{100 * CRITERIA['c4_perplexity_ratio']:g}%")


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    missing = [str(p) for p in (ns.arc, ns.c4) if not p.is_file()]
    if missing:
        print(f"error: data file(s) missing: {', '.join(missing)} (the shared data folder ../shared/data "
              "beside the checkout; or pass --arc / --c4)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    import torch

    if ns.threads:
        torch.set_num_threads(ns.threads)
    from depthserve.loading.registry import resolve_model
    from depthserve.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(ns.model))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    rows = read_arc(ns.arc, ns.limit)
    arc_prompts, arc_index = arc_requests(rows, encode)
    texts = common.read_jsonl_texts(ns.c4)[: ns.docs]
    documents = [encode(t) for t in texts]
    c4_ids = [doc[: ns.window] for doc in documents]
    greedy_prompts = common.token_windows(documents, ns.prompt_len, ns.prompts)
    print(f"ARC-Easy: {len(rows)} questions, {len(arc_prompts)} requests, "
          f"{sum(map(len, arc_prompts))} tokens; C4: {len(c4_ids)} documents, {sum(map(len, c4_ids))} tokens; "
          f"greedy: {len(greedy_prompts)} prompts of {ns.prompt_len} tokens x {ns.new_tokens}", flush=True)

    digest, git = source_digest(), git_state()  # the code as this run found it at its start
    arc_chunks = chunk_ranges(arc_index, ns.arc_chunk)
    inputs_key = hashlib.sha256(json.dumps([ns.model, ns.threads, ns.new_tokens, ns.batch1_prompts, digest, arc_chunks,
                                            arc_prompts, c4_ids, greedy_prompts]).encode()).hexdigest()
    runs = {name: run_or_reuse(name, ns, inputs_key, arc_prompts, arc_chunks, c4_ids, greedy_prompts)
            for name in ns.format_names}
    results = summarize(runs, rows, arc_index)
    bad = [name for name, r in results.items() if not r["finite"]]

    default_checks = results.get("default", {}).get("criteria")
    payload = {
        "benchmark": "quant-fidelity",
        "description": "held-out fidelity of CPU weight formats against the fp32 path: ARC-Easy validation "
                       "accuracy (log-likelihood of each choice), C4 perplexity, greedy agreement over "
                       f"{ns.new_tokens} tokens",
        "quick": ns.quick,
        "machine_tag": ns.machine,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": common.library_versions(),
        "git": git,
        "engine_source_digest": digest,
        "settings": {
            "model": ns.model, "checkpoint": str(resolve_model(ns.model).path), "device": "cpu",
            "formats": {name: FORMATS[name] for name in ns.format_names}, "reference": REFERENCE,
            "arc": {"data": str(ns.arc), "questions": len(rows), "limit": ns.limit,
                    "context": CONTEXT_TEMPLATE, "continuation": CONTINUATION_TEMPLATE,
                    "requests": len(arc_prompts), "tokens": sum(map(len, arc_prompts)),
                    "questions_per_generate_call": ns.arc_chunk,
                    "tokenization": "lm-eval HF _encode_pair, no BOS",
                    "metrics": "acc: argmax summed continuation log-prob; acc_norm: divided by len(choice) chars"},
            "c4": {"data": str(ns.c4), "documents": len(c4_ids), "window": ns.window,
                   "tokens_per_document": [len(d) for d in c4_ids],
                   "metric": "exp(mean NLL of tokens 1..n-1), pooled over documents; no BOS"},
            "greedy": {"prompts": len(greedy_prompts), "prompt_len": ns.prompt_len, "new_tokens": ns.new_tokens,
                       "batch1_prompts": ns.batch1_prompts,
                       "source": "common.token_windows over the C4 documents", "temperature": 0.0,
                       "ignore_eos": True},
            "engine": {"threads": ns.threads, "other_args": "engine defaults (prefix caching on, chunked prefill); one "
                                                            "llm.generate call per ARC chunk, for C4, for the batched "
                                                            "greedy run, per batch-1 prompt"},
            "criteria": {"arc_acc_within_points": CRITERIA["arc_acc_points"],
                         "c4_perplexity_within_fraction": CRITERIA["c4_perplexity_ratio"],
                         "applies_to": "default"},
        },
        "results": results,
        "default_criteria": default_checks,
        "non_finite_formats": bad,
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    ns.output.parent.mkdir(parents=True, exist_ok=True)
    ns.output.write_text(json.dumps(payload, indent=2) + "\n")
    print_table(results, ns)
    print(f"machine: {payload['machine']['cpu']} ({payload['machine']['instruction_sets']}); "
          f"{payload['total_seconds']:.0f}s in all; wrote {ns.output}")
    if bad:
        print(f"error: non-finite log-probs in {', '.join(bad)}", file=sys.stderr)
        return 2
    if default_checks is not None:
        verdict = "PASS" if default_checks["pass"] else "FAIL"
        print(f"new default vs fp32: {verdict} ({', '.join(f'{k}={v}' for k, v in default_checks.items() if k != 'pass')})"
              + (" [quick subset: not enforced]" if ns.quick else ""))
        if not default_checks["pass"] and not ns.quick:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
