"""ARC-Easy through lm-evaluation-harness: the server (`local-completions`) vs lm-eval's `hf` model.

    make eval                                    # sets up .venv-eval, then runs this with defaults
    .venv/bin/python bench/lm_eval_arc.py --limit 100 --batch-size 8

Both runs score the same local JSON task over the first `--limit` questions of
`--data` (ARC-Easy validation rows: id, question, choices{text,label}, answerKey) with the
standard arc_easy prompt: context "Question: {question}\\nAnswer:", continuation " {choice}",
metrics acc and acc_norm. The same checkpoint feeds both sides:

  * `local-completions`: `depthserve serve --model MODEL --dtype float32 --device cpu` on a free
    loopback port; lm-eval tokenizes with the checkpoint's own tokenizer (saved once to a temp
    dir) and sends token ids (`--string-requests` sends text instead), `echo` + `logprobs` +
    `max_tokens: 1`, `--batch-size` prompts per request.
  * `hf`: lm-eval's transformers model on CPU in float32; a GGUF checkpoint is loaded with
    `pretrained=<dir>,gguf_file=<name>` (transformers' own dequantizer), an HF directory as is.

lm-eval runs from its own virtual environment (`--eval-venv`, default .venv-eval; `make
eval-install` builds it), never from the main one. The server runs from this interpreter's
environment (the one with depthserve installed). Result: bench/results/lm-eval-arc-easy.json with
the settings, both runs' acc / acc_norm, per-question agreement from `--log_samples`, the
machine and library versions. Exit status 1 when the two runs' acc or acc_norm differ.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = common.ARC_EASY_VALIDATION
TASK_NAME = "arc_easy_local"
METRICS = ("acc", "acc_norm")

TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
validation_split: validation
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices.label.index(answerKey)}}}}"
doc_to_choice: "{{{{choices.text}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

# Run inside the eval venv: the checkpoint's tokenizer, saved as a plain HF tokenizer directory.
SAVE_TOKENIZER = """\
import sys
from transformers import AutoTokenizer
source, gguf_file, out = sys.argv[1], sys.argv[2] or None, sys.argv[3]
kwargs = {"gguf_file": gguf_file} if gguf_file else {}
AutoTokenizer.from_pretrained(source, **kwargs).save_pretrained(out)
"""

VERSIONS = """\
import json, platform
from importlib import metadata
out = {"python": platform.python_version()}
for name in ("lm_eval", "torch", "transformers", "gguf", "accelerate", "datasets", "tokenizers", "numpy"):
    try:
        out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
print(json.dumps(out))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="built-in name, .gguf file or HF checkpoint dir")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="ARC-Easy JSON lines")
    p.add_argument("--limit", type=int, default=100, help="the first N questions of --data")
    p.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size (both models)")
    p.add_argument("--num-concurrent", type=int, default=1, help="local-completions: requests in flight")
    p.add_argument("--max-retries", type=int, default=3, help="local-completions: retries per request")
    p.add_argument("--string-requests", action="store_true",
                   help="local-completions: send text prompts (tokenized_requests=False) instead of token ids")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the server and the hf run")
    p.add_argument("--eval-venv", type=Path, default=REPO / ".venv-eval", help="virtual env with lm-eval installed")
    p.add_argument("--server-start-timeout", type=float, default=600.0)
    p.add_argument("--output", type=Path, default=common.RESULTS_DIR / "lm-eval-arc-easy.json")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temp dir (task, samples, logs)")
    return p.parse_args(argv)


# ---- the pieces ----------------------------------------------------------------------------------
def eval_python(venv: Path) -> Path:
    python = venv / "bin" / "python"
    probe = (subprocess.run([str(python), "-c", "import lm_eval"], capture_output=True, cwd=tempfile.gettempdir())
             if python.exists() else None)
    if probe is None or probe.returncode != 0:
        raise SystemExit(f"lm-eval is not installed in {venv}: run `make eval-install` first")
    return python


def write_task(workdir: Path, data: Path, limit: int) -> tuple[Path, list[dict]]:
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()][:limit]
    if not rows:
        raise SystemExit(f"no rows in {data}")
    subset = workdir / "arc_easy_subset.jsonl"
    subset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tasks = workdir / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK_NAME}.yaml").write_text(TASK_YAML.format(task=TASK_NAME, data=json.dumps(str(subset))))
    return tasks, rows


def http_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def served(model: str, threads: int | None, timeout: float, log_path: Path) -> Iterator[tuple[str, str]]:
    """`depthserve serve` on a free loopback port; yields (base URL, served model id)."""
    port = common.free_port()
    exe = Path(sys.executable).with_name("depthserve")
    command = [str(exe) if exe.exists() else "depthserve", "serve", "--model", model, "--dtype", "float32",
               "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if threads:
        command += ["--num-threads", str(threads)]
    print(f"$ {shlex.join(command)}", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with code {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                if urllib.request.urlopen(f"{base_url}/health", timeout=2.0).status == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the server was not healthy within {timeout:.0f}s (log: {log_path})")
            time.sleep(0.5)
        yield base_url, http_json(f"{base_url}/v1/models")["data"][0]["id"]
    finally:
        common.stop_process(proc)


def run_lm_eval(python: Path, model_type: str, model_args: dict, tasks: Path, out: Path,
                batch_size: int, threads: int | None, log_path: Path) -> float:
    """One `lm-eval run`; returns its wall seconds. Its output goes to `log_path`."""
    lm_eval = python.with_name("lm_eval")
    command = [str(lm_eval) if lm_eval.exists() else str(python), *([] if lm_eval.exists() else ["-m", "lm_eval"]),
               "run", "--model", model_type,
               "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
               "--tasks", TASK_NAME, "--include_path", str(tasks), "--batch_size", str(batch_size),
               "--output_path", str(out), "--log_samples", "--seed", "1234"]
    if model_type == "hf":
        command += ["--device", "cpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_CACHE": str(out.parent / "hf-datasets-cache")}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    print(f"$ {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out.parent).returncode
    seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"lm-eval ({model_type}) failed with exit code {code}:\n{log_path.read_text()[-4000:]}")
    print(f"  done in {seconds:.0f}s", flush=True)
    return seconds


def read_outputs(out: Path) -> tuple[dict, dict[int, dict]]:
    """(the task's metrics, {doc_id: sample}) from one run's --output_path."""
    results = sorted(out.rglob("results_*.json"))
    samples = sorted(out.rglob(f"samples_{TASK_NAME}_*.jsonl"))
    if not results or not samples:
        raise SystemExit(f"no results/samples files under {out}")
    metrics = json.loads(results[-1].read_text())["results"][TASK_NAME]
    by_doc = {}
    for line in samples[-1].read_text().splitlines():
        if line.strip():
            sample = json.loads(line)
            by_doc[int(sample["doc_id"])] = sample
    return metrics, by_doc


def choice_scores(sample: dict) -> list[float]:
    """The per-choice log-likelihoods lm-eval recorded for one question."""
    resps = sample.get("filtered_resps") or sample["resps"]
    scores = []
    for resp in resps:
        while isinstance(resp, list) and resp and isinstance(resp[0], list):
            resp = resp[0]
        scores.append(float(resp[0]) if isinstance(resp, list) else float(resp))
    return scores


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def compare(api: dict[int, dict], hf: dict[int, dict], rows: list[dict]) -> dict:
    """Per-question predictions of both runs and how far apart their log-likelihoods are."""
    per_question = []
    max_diff = 0.0
    for doc_id in sorted(set(api) | set(hf)):
        a, h = api.get(doc_id), hf.get(doc_id)
        entry = {"doc_id": doc_id, "id": rows[doc_id].get("id") if doc_id < len(rows) else None}
        if a is None or h is None:
            entry["missing_in"] = "local-completions" if a is None else "hf"
            per_question.append(entry)
            continue
        sa, sh = choice_scores(a), choice_scores(h)
        choices = rows[doc_id]["choices"]["text"]
        lengths = [len(c) for c in choices]  # acc_norm divides by the choice's length in characters
        entry.update({
            "target": int(a["target"]),
            "pred_local_completions": argmax(sa), "pred_hf": argmax(sh),
            "pred_norm_local_completions": argmax([s / n for s, n in zip(sa, lengths)]),
            "pred_norm_hf": argmax([s / n for s, n in zip(sh, lengths)]),
            "acc": [a.get("acc"), h.get("acc")], "acc_norm": [a.get("acc_norm"), h.get("acc_norm")],
            "max_abs_loglik_diff": max(abs(x - y) for x, y in zip(sa, sh)) if len(sa) == len(sh) else None,
            "loglik_local_completions": sa, "loglik_hf": sh,
        })
        if entry["max_abs_loglik_diff"] is not None:
            max_diff = max(max_diff, entry["max_abs_loglik_diff"])
        per_question.append(entry)
    paired = [e for e in per_question if "missing_in" not in e]
    return {
        "questions_compared": len(paired),
        "same_prediction_acc": sum(e["pred_local_completions"] == e["pred_hf"] for e in paired),
        "same_prediction_acc_norm": sum(e["pred_norm_local_completions"] == e["pred_norm_hf"] for e in paired),
        "max_abs_loglik_diff": max_diff,
        "disagreements": [e for e in paired if e["pred_local_completions"] != e["pred_hf"]
                          or e["pred_norm_local_completions"] != e["pred_norm_hf"]],
        "per_question": per_question,
    }


def metric(metrics: dict, name: str) -> tuple[float, float | None]:
    value = metrics.get(f"{name},none", metrics.get(name))
    stderr = metrics.get(f"{name}_stderr,none", metrics.get(f"{name}_stderr"))
    return float(value), (float(stderr) if isinstance(stderr, (int, float)) else None)


def versions(python: Path) -> dict:
    out = {"main_env": {"python": platform.python_version()}, "eval_env": {}}
    for name in ("depthserve", "torch", "transformers", "gguf", "numpy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out["main_env"][name] = metadata.version(name)
    probe = subprocess.run([str(python), "-c", VERSIONS], capture_output=True, text=True, cwd=tempfile.gettempdir())
    if probe.returncode == 0:
        out["eval_env"] = json.loads(probe.stdout)
    return out


# ---- main ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from depthserve.loading.registry import resolve_model

    python = eval_python(ns.eval_venv.absolute())
    source = resolve_model(ns.model)
    if source.format == "gguf":
        pretrained, gguf_file = source.path.parent, source.path.name
    else:
        pretrained, gguf_file = source.path, None
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="lm-eval-arc-"))
    print(f"model {ns.model} ({source.format}: {source.path}); work dir {workdir}", flush=True)
    try:
        tasks, rows = write_task(workdir, ns.data, ns.limit)
        tokenizer_dir = workdir / "tokenizer"
        subprocess.run([str(python), "-c", SAVE_TOKENIZER, str(pretrained), gguf_file or "", str(tokenizer_dir)],
                       check=True, cwd=workdir, env={**os.environ, "HF_HUB_OFFLINE": "1"})

        with served(ns.model, ns.threads, ns.server_start_timeout, workdir / "server.log") as (base_url, model_id):
            api_args = {
                "model": model_id, "base_url": f"{base_url}/v1/completions",
                "tokenizer_backend": "huggingface", "tokenizer": tokenizer_dir,
                "tokenized_requests": not ns.string_requests, "num_concurrent": ns.num_concurrent,
                "max_retries": ns.max_retries,
            }
            api_seconds = run_lm_eval(python, "local-completions", api_args, tasks, workdir / "out-api",
                                      ns.batch_size, ns.threads, workdir / "lm-eval-api.log")

        hf_args = {"pretrained": pretrained, "dtype": "float32"}
        if gguf_file:
            hf_args["gguf_file"] = gguf_file
        hf_seconds = run_lm_eval(python, "hf", hf_args, tasks, workdir / "out-hf", ns.batch_size, ns.threads,
                                 workdir / "lm-eval-hf.log")

        api_metrics, api_samples = read_outputs(workdir / "out-api")
        hf_metrics, hf_samples = read_outputs(workdir / "out-hf")
    except BaseException:
        print(f"work dir kept: {workdir}", file=sys.stderr)
        raise
    runs = {}
    for name, metrics, seconds in (("local-completions", api_metrics, api_seconds), ("hf", hf_metrics, hf_seconds)):
        runs[name] = {"seconds": round(seconds, 1)}
        for m in METRICS:
            value, stderr = metric(metrics, m)
            runs[name][m], runs[name][f"{m}_stderr"] = value, stderr
    agreement = compare(api_samples, hf_samples, rows)
    same = all(runs["local-completions"][m] == runs["hf"][m] for m in METRICS)

    import torch  # the main env's, only to describe the machine

    payload = {
        "benchmark": "lm-eval-arc-easy",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "model": ns.model, "checkpoint": str(source.path), "checkpoint_format": source.format,
            "data": str(ns.data), "questions": len(rows), "limit": ns.limit,
            "prompt": {"context": "Question: {question}\\nAnswer:", "continuation": " {choice}"},
            "metrics": list(METRICS), "batch_size": ns.batch_size, "dtype": "float32", "device": "cpu",
            "local_completions_model_args": {k: ("<the checkpoint's tokenizer, saved to a temp dir>" if k == "tokenizer"
                                                 else str(v)) for k, v in api_args.items() if k != "base_url"},
            "hf_model_args": {k: str(v) for k, v in hf_args.items()},
            "threads": ns.threads or torch.get_num_threads(),
        },
        "results": runs,
        "same_accuracy": same,
        "agreement": agreement,
        "machine": f"{common.cpu_model()} ({os.cpu_count()} logical CPUs)",
        "platform": platform.platform(),
        "versions": versions(python),
        "git_commit": common.git_commit(),
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    ns.output.parent.mkdir(parents=True, exist_ok=True)
    ns.output.write_text(json.dumps(payload, indent=2) + "\n")

    print(f"\nARC-Easy, first {len(rows)} questions of {ns.data.name} ({ns.model}, CPU, float32)")
    print(f"{'model':<20}{'acc':>8}{'acc_norm':>10}{'seconds':>9}")
    for name, run in runs.items():
        print(f"{name:<20}{run['acc']:>8.3f}{run['acc_norm']:>10.3f}{run['seconds']:>9.0f}")
    n = agreement["questions_compared"]
    print(f"same prediction: acc {agreement['same_prediction_acc']}/{n}, "
          f"acc_norm {agreement['same_prediction_acc_norm']}/{n}; "
          f"max |loglik diff| {agreement['max_abs_loglik_diff']:.2e}")
    print(f"{'SAME' if same else 'DIFFERENT'} accuracy; wrote {ns.output}")
    if ns.keep_workdir:
        print(f"work dir kept: {workdir}")
    else:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
