"""The native checkpoint format: a Hugging Face style directory with a `depth` section.

`config.json` holds the usual Llama fields plus a `depth` object naming the architecture
(`depth.architecture`, a name the registry knows) and its settings; extra weights live in
`*.safetensors` under HF-style names. Each architecture reads and writes its own section
(`depthserve/archs/<name>/format.py`); this module holds what they share. docs/checkpoint-format.md
is the reference. No model code here: the engine and the reference implementations both use it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from depthserve.errors import CheckpointFormatError, MissingCalibrationError  # noqa: F401 - re-exported

FORMAT_VERSION = 1


# transformers model types whose checkpoints are served as they are, under the architecture of
# the same name (docs/checkpoint-format.md, "Dory").
NATIVE_MODEL_TYPES = ("dory", "inkling2_loop_text", "inkling2_loop", "hrm_text")


def depth_section(hf_config: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """(architecture name, the `depth` section) of a config; a config without one is a plain Llama."""
    section = hf_config.get("depth")
    if section is None:
        # A transformers model type served as an architecture of its own (its config is its spec).
        model_type = hf_config.get("model_type")
        return (model_type if model_type in NATIVE_MODEL_TYPES else "llama"), None
    if not isinstance(section, dict):
        raise CheckpointFormatError("config.json: `depth` must be an object")
    version = section.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(f"depth.format_version {version} is not supported (expected {FORMAT_VERSION})")
    name = section.get("architecture")
    if not isinstance(name, str):
        raise CheckpointFormatError(f"depth.architecture must be an architecture name, got {name!r}")
    return name, section


def int_list(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise CheckpointFormatError(f"depth.{what} must be a list of integers, got {value!r}")
    return tuple(value)


def float_list(value: Any, what: str, length: int) -> tuple[float, ...]:
    if not isinstance(value, list) or len(value) != length or not all(isinstance(v, (int, float)) for v in value):
        raise CheckpointFormatError(f"depth.{what} must be a list of {length} numbers, got {value!r}")
    return tuple(float(v) for v in value)


# ---- writing ------------------------------------------------------------------------------------
def write_config(path: Path, hf_config: dict[str, Any]) -> None:
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")


def write_checkpoint(out: Path, cfg: dict[str, Any], weights: dict, tokenizer) -> Path:
    """Write a checkpoint directory: config.json, model.safetensors (every older *.safetensors
    removed first, since a checkpoint's weight files are all read) and the tokenizer files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    save_file({name: t.contiguous() for name, t in weights.items()}, str(out / "model.safetensors"))
    write_config(out, cfg)
    tokenizer.save_pretrained(str(out))
    return out
