"""The reference implementations (the test oracle): a plain full-sequence forward of any
registered architecture, dispatched on the checkpoint's `depth.architecture`.

    logits = forward(model_dir, token_ids, depth=None)                         # [n_tokens, vocab]
    logits, decisions = forward(model_dir, ids, depth, return_decisions=True)  # routing decisions
    logits = forward(model_dir, ids, depth, force={...})                      # teacher-forced

Each architecture's own reference (`depthserve/oracles/<name>.py`) is written straight
from docs/depth-semantics.md and shares nothing with the engine but the checkpoint reader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from depthserve.archs import get_architecture
from depthserve.loading.checkpoint import depth_section


def forward(model_dir: str | Path, token_ids: list[int], depth: Any = None, **kwargs: Any):
    config = json.loads((Path(model_dir) / "config.json").read_text())
    name, _ = depth_section(config)
    return get_architecture(name).reference_forward(model_dir, token_ids, depth, **kwargs)
