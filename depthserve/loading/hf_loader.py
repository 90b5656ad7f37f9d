"""Read a Hugging Face style checkpoint directory (config.json + *.safetensors)."""

from __future__ import annotations

import json
from collections.abc import Iterator, MutableMapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tqdm.auto import tqdm

# transformers model types whose tensors are read one at a time as the loader asks for them, so that
# a checkpoint of several GB is never held twice (the file's tensors and the model's parameters):
# docs/checkpoint-format.md, "Dory". Read with pread, not through a mapping: the mapped pages of the
# whole file would count in the process's resident memory until the files are closed.
TENSOR_AT_A_TIME_MODEL_TYPES = ("dory", "inkling2_loop_text")


def load_hf_dir(path: Path, progress: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, every tensor of every *.safetensors file). A native-format checkpoint's extra
    tensors (routers, step encodings, a calibration table file) load with the rest."""
    return read_config(path), read_weights(path, progress)


def read_config(path: Path) -> dict[str, Any]:
    """The checkpoint's config.json."""
    return json.loads((path / "config.json").read_text())


def read_weights(path: Path, progress: bool = True) -> MutableMapping[str, torch.Tensor]:
    """Every tensor of every *.safetensors file of the checkpoint directory: read into memory, or
    for the model types of TENSOR_AT_A_TIME_MODEL_TYPES a `LazyWeights` reading each on access."""
    files = _weight_files(path)
    if read_config(path).get("model_type") in TENSOR_AT_A_TIME_MODEL_TYPES:
        return LazyWeights(files)
    weights: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc=f"Loading {path.name}", disable=not progress, unit="file"):
        weights.update(load_file(str(file)))
    return weights


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


class LazyWeights(MutableMapping[str, torch.Tensor]):
    """The tensors of safetensors files by name, each read from its file when it is asked for
    (`weights[name]`, `pop`): a loader that copies each into its parameter and drops it holds one
    tensor at a time besides the model. The files stay open until `clear` or `close`."""

    def __init__(self, files: list[Path]):
        self._files = ExitStack()
        self._where: dict[str, Any] = {}  # name -> the open file holding it
        self._replaced: dict[str, torch.Tensor] = {}  # tensors set by the caller
        for file in files:
            handle = self._files.enter_context(safe_open(str(file), framework="pt", device="cpu", backend="pread"))
            self._where.update(dict.fromkeys(handle.keys(), handle))

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._replaced:
            return self._replaced[name]
        return self._where[name].get_tensor(name)

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self._where.pop(name, None)
        self._replaced[name] = tensor

    def __delitem__(self, name: str) -> None:
        if name not in self._replaced and name not in self._where:
            raise KeyError(name)
        self._replaced.pop(name, None)
        self._where.pop(name, None)

    def __contains__(self, name: object) -> bool:  # without reading the tensor (Mapping's would)
        return name in self._where or name in self._replaced

    def __iter__(self) -> Iterator[str]:
        return iter([*self._where, *self._replaced])

    def __len__(self) -> int:
        return len(self._where) + len(self._replaced)

    def clear(self) -> None:
        """Forget every tensor without reading it."""
        self._where.clear()
        self._replaced.clear()
        self.close()

    def close(self) -> None:
        self._files.close()
