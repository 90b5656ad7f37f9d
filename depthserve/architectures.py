"""Where the depth architectures beyond SGT and ITT live: one module per architecture.

The format reader (loading/checkpoint.py), the model builder (loading/model_loader.py), the
reference oracle (reference.py) and `make-tiny` (tiny.py) find an architecture's code here, so
adding one touches its own module only. Each module in ARCHITECTURE_MODULES provides:

    read_spec(section: dict, hf_config: dict) -> spec     # the config.json `depth` section, checked
                                                          # (CheckpointFormatError naming the field)
    spec.architecture: str; spec.to_section() -> dict     # the inverse of read_spec
    build_model(hf_config: dict, spec, max_len: int) -> torch.nn.Module   # the engine's model
    reference_forward(model_dir, token_ids, depth=None, *, dtype=torch.float64, **kwargs) -> logits [n, V]
    make_tiny(out: Path, seed: int, like: str | None, num_kv_heads: int | None, tokenizer) -> Path
"""

from __future__ import annotations

import importlib
from types import ModuleType

ARCHITECTURE_MODULES: dict[str, str] = {
    "dreamer": "depthserve.models.dreamer",  # depth-semantics.md section 3
    "put": "depthserve.models.put",  # section 4
    "saobp": "depthserve.models.saobp",  # section 5
}


def architecture_module(name: str) -> ModuleType:
    return importlib.import_module(ARCHITECTURE_MODULES[name])


def module_of_spec(spec) -> ModuleType | None:
    """The module of a spec read by one of ARCHITECTURE_MODULES (None for Llama/SGT/ITT)."""
    name = getattr(spec, "architecture", None)
    return architecture_module(name) if name in ARCHITECTURE_MODULES else None
