"""Shared pieces of the benchmark scripts: machine description, timing, the transformers baseline."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PLOTS_DIR = RESULTS_DIR / "plots"
# The smoke runs (`--quick`, `make bench`) and their charts: git-ignored, so that they never mix with
# or overwrite the committed results.
QUICK_SUFFIX = "-quick"
QUICK_RESULTS_DIR = RESULTS_DIR / "quick"
# The data sets the benchmarks and tests read (never committed): the folder DEPTHSERVE_DATA_DIR names,
# else ../shared/data beside the checkout (README, "Tests").
DATA_DIR_ENV = "DEPTHSERVE_DATA_DIR"


def data_dir() -> Path:
    """The data folder: $DEPTHSERVE_DATA_DIR, else ../shared/data beside the checkout."""
    configured = os.environ.get(DATA_DIR_ENV)
    return Path(configured) if configured else Path(__file__).resolve().parents[2] / "shared" / "data"


C4_SAMPLE = data_dir() / "c4_sample.jsonl"
ARC_EASY_VALIDATION = data_dir() / "arc_easy_validation.jsonl"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_kind_tag() -> str:
    """'xeon-' or 'epyc-' (the two kinds of CPU the figures were measured on), for result names."""
    return next((f"{kind.lower()}-" for kind in ("Xeon", "EPYC") if kind in cpu_model()), "")


def device_description(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    from depthserve.loading.quantization import cpu_features

    return f"{cpu_model()} ({os.cpu_count()} logical CPUs; {cpu_features()})"


def device_slug(device: str) -> str:
    """Short file-name tag for a device: 'cpu-2core', 'h100', ..."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(device)).lower()
        for tag in ("h200", "h100", "a100", "l40s", "l4", "a10g"):
            if tag in name:
                return tag
        return "cuda"
    return f"cpu-{os.cpu_count()}core"


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "triton", "xformers", "depthserve", "gguf", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return versions


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_commit() -> str | None:
    """The commit the results are of: DEPTHSERVE_GIT_COMMIT where set (a GPU host's copy of the
    checkout carries the working tree but not necessarily its current .git: docs/gpu.md), else
    HEAD, marked "+dirty" where tracked files differ from it."""
    if named := os.environ.get("DEPTHSERVE_GIT_COMMIT"):
        return named
    head = _git("rev-parse", "--short", "HEAD")
    if head is None:
        return None
    return head + "+dirty" if _git("status", "--porcelain", "--untracked-files=no") else head


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu' (the engine's own rule)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def environment(device: str, threads: int | None) -> dict:
    import torch

    return {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": device_description(device),
        "platform": platform.platform(),
        "torch_threads": threads or torch.get_num_threads(),
        "versions": library_versions(),
        "git_commit": git_commit(),
    }


def timed(fn: Callable[[], object], sync: Callable[[], None] = lambda: None) -> float:
    """Wall seconds of one call, with the device synchronised on both sides."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def device_copy_rate(device) -> float | None:
    """Bytes per second of a 1 GiB device-to-device copy, counting bytes read and written (the
    median of triton's do_bench); None off CUDA, where no such ceiling is measured."""
    if device.type != "cuda":
        return None
    import torch
    import triton

    source = torch.empty(1 << 29, dtype=torch.bfloat16, device=device).normal_()
    target = torch.empty_like(source)
    ms = triton.testing.do_bench(lambda: target.copy_(source), warmup=25, rep=200, return_mode="median")
    return 2 * source.numel() * source.element_size() / (ms / 1000)


def layer_matmuls_ms(model, layers, num_rows: int, passes: int, sync, lm_head: bool = False) -> float:
    """Milliseconds that the weight matmuls of `layers` (qkv, o, gate_up and down projections; the
    LM head too if asked) take alone on `num_rows` random rows, each layer run `passes` times in a
    row, as a decode step runs them: the floor that the matmul kernels set under a step's time."""
    import torch

    weight = layers[0].input_layernorm.weight  # the hidden width and activation dtype (the embedding may be quantized)
    attn, mlp = layers[0].self_attn, layers[0].mlp
    x = torch.randn(num_rows, weight.shape[0], device=weight.device, dtype=weight.dtype)
    attended = torch.randn(num_rows, attn.o_proj.in_features, device=weight.device, dtype=weight.dtype)
    inner = torch.randn(num_rows, mlp.down_proj.in_features, device=weight.device, dtype=weight.dtype)

    @torch.inference_mode()
    def run() -> None:
        for layer in layers:
            for _ in range(passes):
                layer.self_attn.qkv_proj(x)
                layer.self_attn.o_proj(attended)
                layer.mlp.gate_up_proj(x)
                layer.mlp.down_proj(inner)
        if lm_head:
            model.lm_head(x)

    return 1000 * timed(run, sync)


def result_path(name: str) -> Path:
    """Where the result `name` is written: a smoke run's (name ending in QUICK_SUFFIX) under
    QUICK_RESULTS_DIR, any other under RESULTS_DIR."""
    return (QUICK_RESULTS_DIR if name.endswith(QUICK_SUFFIX) else RESULTS_DIR) / f"{name}.json"


def write_result(name: str, payload: dict) -> Path:
    path = result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def load_hf_model(model: str, dtype, device: str):
    """transformers' own model on the same checkpoint (its own GGUF dequantizer for GGUF files)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from depthserve.loading.registry import resolve_model

    hf_logging.set_verbosity_error()
    source = resolve_model(model)
    if source.format == "gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype)
    return hf.to(device).eval()


# ---- prompts and statistics shared by the scripts -----------------------------------------------
def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM). Not getrusage's ru_maxrss: that survives exec, so a
    worker started by a parent that once held more reports the parent's peak."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) * 1024


def byte_prompts(batch: int, tokens: int) -> list[list[int]]:
    """`batch` prompts of `tokens` ids in 1..256 (the looped benchmarks' byte tokenizers), seeded by the batch."""
    import torch

    generator = torch.Generator().manual_seed(batch)
    return [torch.randint(1, 257, (tokens,), generator=generator).tolist() for _ in range(batch)]


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` uniformly random token ids (ids below 100 left out: SmolLM2
    keeps its special tokens there)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (count, length), generator=gen).tolist()


def read_jsonl_texts(path: Path) -> list[str]:
    """The non-empty "text" fields of a JSON-lines file, in file order."""
    texts = []
    for line in path.read_text().splitlines():
        if line.strip():
            text = json.loads(line).get("text", "")
            if text:
                texts.append(text)
    return texts


def token_windows(documents: Sequence[Sequence[int]], length: int, count: int) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens: the first `length` tokens of each long-enough
    document, then (if more are needed) each document's next `length` tokens, and so on.
    Cycles through them again if the documents run out (with prefix caching on, a repeated
    prompt is cheaper, so keep `count` within what the documents hold)."""
    windows: list[list[int]] = []
    offset = 0
    while True:
        found = [list(doc[offset:offset + length]) for doc in documents if len(doc) >= offset + length]
        if not found:
            break
        windows += found
        offset += length
    if not windows:
        raise ValueError(f"no document has {length} tokens")
    return [windows[i % len(windows)] for i in range(count)]


def parse_number_list(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf]."""
    return [float(part) for part in text.split(",") if part.strip()]


def summarize(values: Iterable[float], percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, float | None]:
    """mean, std, median and the given percentiles (linear interpolation) of `values`; None when empty."""
    data = sorted(values)
    keys = ["mean", "std", "median"] + [f"p{p:g}" for p in percentiles]
    if not data:
        return dict.fromkeys(keys)
    out = {"mean": statistics.fmean(data), "std": statistics.pstdev(data), "median": statistics.median(data)}
    for p in percentiles:
        out[f"p{p:g}"] = percentile(data, p)
    return out


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) of already sorted values, interpolating linearly between ranks."""
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    rank = (len(sorted_values) - 1) * p / 100
    low, high = math.floor(rank), math.ceil(rank)
    return float(sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low))


def slug(text: str) -> str:
    """A file-name-safe tag: 'HuggingFaceTB/SmolLM2 135M' -> 'huggingfacetb-smollm2-135m'."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "model"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def stop_process(proc: subprocess.Popen) -> None:
    """Terminate a child process (a launched server), killing it if it does not exit within 30 s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def load_results(kind: str, directory: Path = RESULTS_DIR) -> list[tuple[Path, dict]]:
    """Every <directory>/<kind>-*.json whose "benchmark" is `kind`, as (path, payload), in name
    order; unreadable files are skipped."""
    found = []
    for path in sorted(directory.glob(f"{kind}-*.json")):
        try:
            payload = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if payload.get("benchmark") == kind:
            found.append((path, payload))
    return found
