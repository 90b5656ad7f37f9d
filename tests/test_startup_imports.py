"""An eager engine's start-up imports no more than serving needs. Models are built on the meta
device, where a random init, a computed table or to_empty's empty_like run through torch's Python
references and import what an eager engine never uses: torch._dynamo (about a second of a process's
start-up) and sympy with the symbolic-shapes machinery (~0.3 s). Loading every architecture's model
imports neither (layers/embedding.py, layers/rotary.py `register_rope_buffers`,
engine/model_loader.py `allocate`), and building each one's engine on the CPU and generating with
it imports neither Dynamo nor Triton (~0.2 s; the ops' Triton forms are imported at their first
call on CUDA, kernels/ops.py `triton_kernel`). sympy may come with transformers' tokenizer classes
(HRM-Text's and Inkling-2's read their model's config class). Run in a fresh process: the test
process imported all of them long ago."""

from __future__ import annotations

import json
import subprocess
import sys

from depthserve.lab.make_tiny import make_tiny

LOAD_THEN_SERVE_EACH = """
import json, sys
import torch
from depthserve import LLM, SamplingParams
from depthserve.engine.model_loader import load_model
from depthserve.loading.registry import resolve_model

def imported():
    return sorted(name for name in ("torch._dynamo", "sympy") if name in sys.modules)

paths = json.loads(sys.argv[1])
loading = {}
for arch, path in paths.items():
    load_model(resolve_model(path), torch.float32, torch.device("cpu"), 64, progress=False)
    loading[arch] = imported()
serving = {}
for arch, path in paths.items():
    llm = LLM(path, dtype="float32", max_model_len=64, kv_cache_memory_gib=0.01, load_progress=False)
    assert llm.engine.runner.static is None  # the CPU default: eager
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    serving[arch] = sorted(name for name in ("torch._dynamo", "triton") if name in sys.modules)
print(json.dumps({"loading": loading, "serving": serving}))
"""


LIST_BUILT_IN = """
import json
from depthserve.archs import architectures
print(json.dumps([a.name for a in architectures() if a.tiny_checkpoints() is not None]))
"""


def built_in_architectures() -> list[str]:
    """The architectures with a tiny checkpoint that a fresh process knows (this one may also hold
    the toy architectures other test modules register)."""
    done = subprocess.run([sys.executable, "-c", LIST_BUILT_IN], capture_output=True, text=True, timeout=120,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_loading_each_architecture_imports_neither_dynamo_nor_sympy_and_serving_neither_dynamo_nor_triton(
        tmp_path, smollm_tokenizer):
    names = built_in_architectures()
    paths = {name: str(make_tiny(name, tmp_path / name, seed=1, tokenizer=smollm_tokenizer)) for name in names}
    done = subprocess.run([sys.executable, "-c", LOAD_THEN_SERVE_EACH, json.dumps(paths)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    # once imported a module stays: the first architecture with an entry is the one that imported it
    assert found["loading"] == {name: [] for name in names}, found["loading"]
    assert found["serving"] == {name: [] for name in names}, found["serving"]
