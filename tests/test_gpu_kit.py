"""The GPU-host kit on CPU (bench/gpu: prepare.sh, run.sh, kit.py; docs/gpu.md): the checks of the
carried wheels against the host's packages, run.sh refusing to start without its kit, a dry run of
every stage (DRY_RUN=1: each stage's set-up and imports, no CUDA) with a kit built offline from this
machine's packages; and bench/kernels.py going on past a variant that fails or is wrong."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPU_KIT = ROOT / "bench" / "gpu"
RUN_SH, PREPARE_SH = GPU_KIT / "run.sh", GPU_KIT / "prepare.sh"
# Environment that would change what the scripts import (the dry run stands in for a bare host).
FOREIGN_ENV = ("PYTHON", "PYTHONPATH", "PYTHONSAFEPATH", "KIT", "OUT", "GPU_WORK", "DRY_RUN", "HOST_PYTHON")


def load_script(path: Path, name: str) -> ModuleType:
    """A script of bench/ as a module under its own name (bench/kernels.py would clash with kernels/)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


kit = load_script(GPU_KIT / "kit.py", "gpu_kit")
kernel_bench = load_script(ROOT / "bench" / "kernels.py", "bench_kernels")


def clean_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    return {**env, **settings}


def write_wheel(directory: Path, name: str, version: str, requires: list[str]) -> Path:
    """A wheel holding only its metadata: what the kit's checks read."""
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {requirement}" for requirement in requires]
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return wheel


def test_the_wheel_check_names_what_neither_the_kit_nor_the_host_holds(tmp_path):
    host = {"anyio", "torch", "typing-extensions"}
    write_wheel(tmp_path, "fastapi", "0.165.0", ["starlette>=0.40", "anyio>=4", "opentelemetry-api>=1.44",
                                                 "pytest; extra == 'test'", "exceptiongroup; python_version < '3.11'"])
    write_wheel(tmp_path, "starlette", "0.30.0", ["typing-extensions"])
    problems = kit.wheel_problems(tmp_path, host, roots=["fastapi>=0.115", "torch>=2.4", "uvicorn"])
    assert sorted(problems) == sorted([
        "fastapi 0.165.0 needs opentelemetry-api>=1.44, which the host lacks and the kit does not carry",
        "fastapi 0.165.0 needs starlette>=0.40; the kit carries starlette 0.30.0",
        "pyproject.toml needs uvicorn, which the host lacks and the kit does not carry",
    ])

    (tmp_path / "starlette-0.30.0-py3-none-any.whl").unlink()
    for name, version in [("starlette", "0.41.0"), ("opentelemetry_api", "1.45.2"), ("uvicorn", "0.54.0")]:
        write_wheel(tmp_path, name, version, [])
    assert kit.wheel_problems(tmp_path, host, roots=["fastapi>=0.115", "torch>=2.4", "uvicorn"]) == []
    write_wheel(tmp_path, "Uvicorn", "0.53.0", [])
    assert kit.wheel_problems(tmp_path, host, roots=[]) == ["uvicorn is carried twice (0.53.0 and 0.54.0)"]


def test_the_kit_carries_everything_the_project_needs_beyond_the_host():
    """What `kit.py missing` lists is closed under requirements: each requirement of a listed
    distribution (as installed here) is the host's or listed too, and nothing listed is the host's."""
    from packaging.requirements import Requirement

    host = kit.host_packages()
    needed = kit.missing_on_host(kit.project_requirements(), host)
    assert {"fastapi", "pydantic", "uvicorn", "gguf"} <= set(needed) and not set(needed) & host
    for name, dist in needed.items():
        for requirement in map(Requirement, dist.requires or []):
            if kit.applies_on_host(requirement, set()):
                assert kit.normalize(requirement.name) in host | set(needed), (name, str(requirement))


SCRIPT = '''
import argparse
import json

try:
    import no_such_accelerator
except ImportError:
    no_such_accelerator = None


def run():
    from depthserve.lab.make_tiny import make_tiny
    import no_such_optional_baseline


if __name__ == "__main__":
    argparse.ArgumentParser().parse_args()
'''


def test_the_import_check_reaches_lazy_imports_and_leaves_out_optional_ones(tmp_path):
    script = tmp_path / "bench_script.py"
    script.write_text(SCRIPT)
    assert kit.imported_modules(script) == ["argparse", "json", "depthserve.lab.make_tiny.make_tiny",
                                            "no_such_optional_baseline"]
    failures = kit.check_imports([script], optional=set())
    assert len(failures) == 1 and "no_such_optional_baseline: ModuleNotFoundError" in failures[0]
    assert kit.check_imports([script], optional={"no_such_optional_baseline"}) == []


def test_run_sh_stops_at_once_without_its_kit(tmp_path):
    """.gpu/ is git-ignored: a device call without carry [".gpu"] must end at once, saying so."""
    env = clean_env(KIT=str(tmp_path / "no-kit"), OUT=str(tmp_path / "out"))
    done = subprocess.run(["bash", str(RUN_SH), "kernels"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert 'carry [".gpu"]' in done.stdout and "prepare.sh" in done.stdout
    assert 'carry [".gpu"]' in (tmp_path / "out" / "run.log").read_text()

    done = subprocess.run(["bash", str(RUN_SH), "kernel"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "unknown stage 'kernel'" in done.stdout


@pytest.mark.slow
def test_a_dry_run_of_every_stage_passes_with_an_offline_kit(tmp_path):
    """prepare.sh builds a kit from this machine's packages (for its own Python, no index), then
    DRY_RUN=1 run.sh runs every stage's set-up and imports against a stand-in for the host's python3
    (this Python with only the host's distributions): ~1 minute on 2 cores."""
    from depthserve.loading.registry import DEFAULT_MODEL, resolve_model

    try:
        resolve_model(DEFAULT_MODEL)
    except Exception as missing:  # noqa: BLE001 - any reason the model's package is absent
        pytest.skip(f"SmolLM2's package (the kit's tokenizer) is not installed: {missing}")
    kit_dir, out, work = tmp_path / "kit", tmp_path / "out", tmp_path / "work"
    prepared = subprocess.run(["bash", str(PREPARE_SH)], capture_output=True, text=True, timeout=300,
                              env=clean_env(HOST_PYTHON="local", KIT=str(kit_dir), PYTHON=sys.executable))
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    stages = ["tests", "kernels", "serve", "throughput", "profile", "depth"]
    env = clean_env(DRY_RUN="1", KIT=str(kit_dir), OUT=str(out), GPU_WORK=str(work), LOCAL_PYTHON=sys.executable)
    done = subprocess.run(["bash", str(RUN_SH), *stages], env=env, capture_output=True, text=True, timeout=600)
    try:
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert f"every stage passed: {' '.join(stages)}" in done.stdout
        assert "depthserve from " + str(work / "root") in done.stdout and "depthserve.server imports" in done.stdout
        collected = re.search(r"(\d+) tests collected", (out / "tests.log").read_text())
        assert collected and int(collected.group(1)) > 0
        assert (work / "ckpt" / "llama-smollm2-shaped" / "config.json").is_file()
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the SmolLM2-shaped checkpoint: about 0.5 GB


def test_a_kernel_variant_that_raises_or_is_wrong_is_recorded_and_never_wins():
    reference = torch.randn(4, 8)
    calls = []

    def wrong():
        calls.append("wrong")
        return reference * 1.5

    def too_much_shared_memory():
        raise RuntimeError("out of resource: shared memory, Required: 196608, Hardware limit: 232448")

    device = torch.device("cpu")
    assert kernel_bench.measure(wrong, reference, 2e-2, device) == {
        "status": "wrong", "relative_error": pytest.approx(0.5), "error_bound": 2e-2}
    assert calls == ["wrong"], "a wrong kernel is not timed"
    failed = kernel_bench.measure(too_much_shared_memory, reference, 2e-2, device)
    assert failed["status"] == "failed" and "shared memory" in failed["error"]
    nan = kernel_bench.measure(lambda: reference * float("nan"), reference, 2e-2, device)
    assert nan["status"] == "wrong"
    ok = kernel_bench.measure(lambda: reference.clone(), reference, 2e-2, device)
    assert ok["status"] == "ok" and ok["ms"] > 0 and ok["relative_error"] == 0

    rows = [{"name": "triton (default)", "status": "ok", "ms": 2.0},
            {"name": "triton tile=128", "status": "wrong", "relative_error": 1.0},
            {"name": "triton tile=64", "status": "failed", "error": "x"},
            {"name": "triton tile=32", "status": "ok", "ms": 1.5},
            {"name": "sdpa, contiguous K/V", "status": "ok", "ms": 0.5}]
    assert kernel_bench.fastest_triton(rows) == "triton tile=32"
    assert kernel_bench.fastest_triton(rows[1:3]) is None


def test_the_kernel_benchmark_goes_on_past_a_failed_variant_and_writes_as_it_goes(tmp_path, monkeypatch):
    """Variants through the torch fallback (no interpreter), one raising as a compile failure would,
    one wrong; then an interrupt: the JSON holds every row measured, each with its status."""
    from depthserve.kernels import paged as torch_paged
    from depthserve.kernels.triton import paged as triton_paged

    def variant(q, k, v, table, lens, scale, tile=64, num_warps=4, num_stages=1):
        if num_stages == 3:
            raise RuntimeError("out of resource: shared memory")
        out = torch_paged.paged_decode_attention(q, k, v, table, lens, scale)
        return out * 2 if num_warps == 8 else out

    monkeypatch.setattr(triton_paged, "paged_decode_attention", variant)
    monkeypatch.setattr(kernel_bench.common, "RESULTS_DIR", tmp_path)
    args = ["--batch", "2", "--context", "64", "--shapes", "4/2/16", "--dtype", "float32",
            "--variants", "tile=32;warps=4,8;stages=1,3", "--out", "kernels-guard"]
    assert kernel_bench.main(args) == 0
    result = json.loads((tmp_path / "kernels-guard.json").read_text())
    rows = {row["name"]: row["status"] for row in result["shapes"][0]["rows"]}
    assert result["status"] == "complete" and rows == {
        "triton (default)": "ok", "triton tile=32 warps=4 stages=1": "ok", "triton tile=32 warps=4 stages=3": "failed",
        "triton tile=32 warps=8 stages=1": "wrong", "triton tile=32 warps=8 stages=3": "failed",
        "torch fallback (gather)": "ok", "sdpa, contiguous K/V": "ok"}
    assert result["shapes"][0]["fastest_triton"] in {"triton (default)", "triton tile=32 warps=4 stages=1"}

    def interrupted(*args, num_warps=4, **kwargs):
        if num_warps == 8:
            raise KeyboardInterrupt  # run.sh's time limit (SIGINT)
        return torch_paged.paged_decode_attention(*args)

    monkeypatch.setattr(triton_paged, "paged_decode_attention", interrupted)
    assert kernel_bench.main(args) == 130
    result = json.loads((tmp_path / "kernels-guard.json").read_text())
    assert result["status"] == "interrupted" and len(result["shapes"][0]["rows"]) == 3


def test_the_cuda_graph_check_passes_on_every_bucket_and_level_and_fails_on_a_missing_one():
    from tests.test_cuda import every_bucket_and_level

    static = SimpleNamespace(buckets=(2, 4, 8), levels=(0, 1, 2))
    static._graphs = {(size, level): None for size in (2, 4, 8) for level in (0, 1, 2)}
    assert set(static._graphs) == every_bucket_and_level(static)
    del static._graphs[4, 1]
    assert set(static._graphs) != every_bucket_and_level(static)
    plain = SimpleNamespace(buckets=(2, 4), levels=(None,), _graphs={(2, None): None, (4, None): None})
    assert set(plain._graphs) == every_bucket_and_level(plain)
