"""An eager engine's start-up imports no more of torch than serving needs: building every
architecture's engine and generating with it leaves torch._dynamo unimported (about a second of a process's
start-up: models are built on the meta device, where a random init or a computed table would import
it; layers/embedding.py, layers/rotary.py `register_rope_buffers`). Run in a fresh process, since the
test process has imported it long before."""

from __future__ import annotations

import json
import subprocess
import sys

from depthserve.archs import architectures
from depthserve.lab.make_tiny import make_tiny

BUILD_EACH = """
import json, sys
from depthserve import LLM, SamplingParams
imported = {}
for arch, path in json.loads(sys.argv[1]).items():
    llm = LLM(path, dtype="float32", max_model_len=64, kv_cache_memory_gib=0.01, load_progress=False)
    assert llm.engine.runner.static is None  # the CPU default: eager
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    imported[arch] = "torch._dynamo" in sys.modules
print(json.dumps(imported))
"""


def test_building_and_running_each_architecture_eagerly_never_imports_dynamo(tmp_path, smollm_tokenizer):
    names = sorted({architecture.name for architecture in architectures()
                    if architecture.tiny_checkpoints() is not None})
    paths = {name: str(make_tiny(name, tmp_path / name, seed=1, tokenizer=smollm_tokenizer)) for name in names}
    done = subprocess.run([sys.executable, "-c", BUILD_EACH, json.dumps(paths)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(imported) == names
    assert not any(imported.values()), imported  # the first True names the architecture that imported it
