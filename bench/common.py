"""Shared pieces of the benchmark scripts: machine description, timing, the transformers baseline."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{cpu_model()} ({os.cpu_count()} logical CPUs)"


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


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


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


def median_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> tuple[float, list[float]]:
    samples = [timed(fn, sync) for _ in range(repeats)]
    return statistics.median(samples), samples


def write_result(name: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
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
