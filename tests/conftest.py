"""Shared fixtures. Heavy objects (tokenizer, the default model) are built once per session."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import pytest
import torch

from bench.common import DATA_DIR_ENV, data_dir

# The tests that run the Triton kernels (the kernel tests, the engine on kernel_backend="triton")
# run them interpreted where there is no CUDA. The interpreter is chosen when triton is first
# imported, which any test module may do, so it is set here, before all of them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines a test builds without a KV budget of their own get 0.5 GiB on CPU, not the engine's 1 GiB
# (committed at start-up; a test module's few engines then held gigabytes): enough for the suite's
# longest contexts. Server subprocesses the tests start inherit it.
from depthserve.engine.capacity import CPU_CACHE_ENV  # noqa: E402 (after TRITON_INTERPRET: it imports triton)

os.environ.setdefault(CPU_CACHE_ENV, "0.5")

# Under pytest-xdist (`make test` runs two workers) each worker gets its share of the cores, so the
# workers' intra-op threads do not outnumber the cores (more threads than cores spin on each other).
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def shared_data_file(name: str) -> Path:
    """A file of the data folder (bench/common.py's `data_dir`: $DEPTHSERVE_DATA_DIR, else
    ../shared/data beside the checkout), or a skip that says why (a user's clone has no data)."""
    path = data_dir() / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (set {DATA_DIR_ENV} to a folder holding {name}; the default, "
                    f"../shared/data beside the checkout, is only present in the project's CI checkout)")
    return path


@pytest.fixture(scope="session", autouse=True)
def _read_each_gguf_once():
    """The gguf package's reader parses SmolLM2's whole metadata (its 49k-entry vocabulary arrays)
    in 6-10 s on the 2-core machine, and several test modules load that model; the suite reads and
    dequantizes each GGUF file once and hands every load its own clone of the weights (so no load
    can alter another's)."""
    import copy
    import dataclasses

    from depthserve.engine import model_loader
    from depthserve.loading import gguf_loader

    original = gguf_loader.load_gguf
    cache: dict[Path, gguf_loader.GGUFWeights] = {}

    def load_once(path, progress: bool = True, keep_codes: bool = False):
        key = Path(path).resolve()
        if key not in cache or (keep_codes and not cache[key].quantized):
            cache[key] = original(path, progress, keep_codes=True)
        read = cache[key]
        # The codes are never written to (the quantized layers re-pack them), so they are shared.
        return dataclasses.replace(read, config=copy.deepcopy(read.config), dense={n: t.clone() for n, t in read.dense.items()},
                                   quantized=dict(read.quantized) if keep_codes else {}, types=dict(read.types))

    # gguf's reader of a file is shared too: the transformers oracle (tests/hf_oracle.py) parses the
    # same file with it, ~11 s a parse (the parsed fields are only read, by both).
    import gguf

    from tests.hf_oracle import reading_each_gguf_once

    original_reader = gguf.GGUFReader
    gguf_loader.load_gguf = model_loader.load_gguf = load_once
    gguf.GGUFReader = reading_each_gguf_once(original_reader)
    yield
    gguf_loader.load_gguf = model_loader.load_gguf = original
    gguf.GGUFReader = original_reader


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """SmolLM2's tokenizer: from its model package, or from a saved copy named by
    DEPTHSERVE_TEST_TOKENIZER (GPU hosts, where the package is too large to carry: bench/gpu/run.sh)."""
    saved = os.environ.get("DEPTHSERVE_TEST_TOKENIZER")
    if saved:
        from depthserve.lab.make_tiny import tokenizer_from

        return tokenizer_from(saved)
    from depthserve.loading.registry import resolve_model
    from depthserve.loading.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def alone_outputs(smollm_tokenizer, tmp_path_factory):
    """The batch-invariance workload's requests each run alone (tests/batch_workload.py), shared by
    the modules that compare batches with it: computed once per run, and under pytest-xdist by the
    first worker that needs it (~25 s of 384 batch-1 steps), the others reading it from that run's
    shared temporary folder."""
    from tests.batch_workload import run_alone

    return once_per_run(tmp_path_factory, "alone-outputs", lambda: run_alone(smollm_tokenizer))


def once_per_run(tmp_path_factory, name: str, compute):
    """`compute()`, run once for the whole test run: under pytest-xdist the workers share one result
    through a pickle in the run's own temporary folder (the parent of every worker's basetemp, new for
    each run), written by the first under a file lock; without xdist, plainly."""
    import pickle

    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    stored = tmp_path_factory.getbasetemp().parent / f"{name}.pickle"
    with FileLock(f"{stored}.lock"):
        if stored.is_file():
            return pickle.loads(stored.read_bytes())
        result = compute()
        stored.write_bytes(pickle.dumps(result))
        return result


@pytest.fixture(scope="session")
def smollm_llm():
    """The offline API on SmolLM2 in fp32, shared by the modules that only run requests on it
    (each test must leave it idle and holding no page: `_shared_llm_left_clean`). It stays resident all
    session, so its cache is no larger than they need: ~2,300 tokens (0.1 GiB at 46 KB a token), more
    than any of them has in flight."""
    from depthserve import LLM

    return LLM("smollm2-135m-instruct", device="cpu", dtype="float32", load_progress=False, max_model_len=1024,
               kv_cache_memory_gib=0.1)


@pytest.fixture(autouse=True)
def _shared_llm_left_clean(request):
    yield
    if "smollm_llm" in request.fixturenames:
        engine = request.getfixturevalue("smollm_llm").engine
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_used_pages == 0, "a finished or failed request kept cache pages"


RSS_LOG_ENV = "DEPTHSERVE_TEST_RSS_LOG"
_STARTED = time.monotonic()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After a module's last test, once its fixtures are torn down and the test let go of them: drop
    torch.compile's graphs (whose guards keep the compiled models alive), collect, and hand freed heap
    back to the OS (glibc keeps it otherwise), so that the suite's resident memory is that of the session's fixtures and the
    module running, not the sum of the modules. With $DEPTHSERVE_TEST_RSS_LOG set, each module's
    resident memory after it, the peak so far and the seconds since the worker started are appended
    there (a timeline per worker: which files keep the suite waiting)."""
    yield
    if nextitem is not None and nextitem.module is item.module:
        return
    import ctypes
    import gc

    torch._dynamo.reset()
    # FastAPI (0.16x) classifies endpoints through module-level lru_caches keyed by the endpoint
    # function, so every app a test builds would stay alive with its engine (the endpoints are closures
    # over it); the test oracles keep the models they load (transformers' SmolLM2: 540 MB in fp32), which
    # a later module that needs one reloads rather than every module carrying it.
    _clear_lru_caches("fastapi.dependencies.models", "depthserve.oracles.", "tests.hf_oracle")
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    if log := os.environ.get(RSS_LOG_ENV):
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        with open(log, "a") as out:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            out.write(f"{worker} {item.module.__name__} rss={status['VmRSS'].strip()} peak={status['VmHWM'].strip()} "
                      f"t={time.monotonic() - _STARTED:.0f}s\n")


def _clear_lru_caches(*module_prefixes: str) -> None:
    """Clear the module-level lru_caches of the loaded modules whose names start with one of these."""
    import sys

    for name in [name for name in sys.modules if name.startswith(module_prefixes)]:
        for value in vars(sys.modules[name]).values():
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    on the tiny looped models' matrices a second thread only adds synchronisation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
