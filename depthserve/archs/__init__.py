"""The architectures the engine serves, one folder each, and the registry that makes them known.

    from depthserve.archs import register, Architecture, DepthModel, get_architecture

Built-in architectures register on first use (`load_builtin_architectures`); another one
registers with one `register(Architecture(...))` call and is then served, referenced and
make-tiny'd like the built-ins (see base.py for what it provides).
"""

from __future__ import annotations

import importlib
from typing import Any

from depthserve.errors import UnknownArchitectureError
from depthserve.archs.base import (
    REGISTRY,
    Architecture,
    BuildOptions,
    DepthModel,
    architecture_names,
    get_architecture,
    register,
)

BUILTIN = ("llama", "sgt", "itt", "dreamer", "put", "saobp")

__all__ = ["REGISTRY", "Architecture", "BuildOptions", "DepthModel", "UnknownArchitectureError", "BUILTIN",
           "architecture_names", "get_architecture", "register", "load_builtin_architectures",
           "resolve_architecture", "read_depth_spec"]


def load_builtin_architectures() -> None:
    for name in BUILTIN:
        if name not in REGISTRY:
            importlib.import_module(f"depthserve.archs.{name}")


def read_depth_spec(hf_config: dict[str, Any]) -> Any:
    """The typed spec of a checkpoint's `depth` section (CheckpointFormatError naming the field)."""
    return resolve_architecture(hf_config)[1]


def resolve_architecture(hf_config: dict[str, Any]) -> tuple[Architecture, Any]:
    """The registered architecture of a checkpoint's config and its parsed spec."""
    from depthserve.loading.checkpoint import depth_section

    name, section = depth_section(hf_config)
    architecture = get_architecture(name)
    return architecture, architecture.read_spec(section, hf_config)
