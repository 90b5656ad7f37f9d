"""The architectures the engine serves, one folder each, and the registry that makes them known.

    from depthserve.archs import register, Architecture, DepthModel, get_architecture

Built-in architectures register on first use (`load_builtin_architectures`); another one
registers with one `register(Architecture(...))` call and is then served, referenced and
make-tiny'd like the built-ins, its knobs in the server's schema (see base.py for what a model
provides, registry.py for what an architecture declares).
"""

from __future__ import annotations

from typing import Any

from depthserve.archs.base import BuildOptions, DepthModel
from depthserve.archs.registry import (
    BUILTIN,
    REGISTRY,
    Architecture,
    Command,
    TinyFlag,
    architecture_names,
    architectures,
    demo_arches,
    get_architecture,
    imported,
    knob_names,
    knob_schemas,
    load_builtin_architectures,
    register,
)
from depthserve.errors import UnknownArchitectureError
from depthserve.loading.checkpoint import depth_section

__all__ = ["REGISTRY", "Architecture", "BuildOptions", "Command", "DepthModel", "TinyFlag",
           "UnknownArchitectureError", "BUILTIN", "architecture_names", "architectures", "demo_arches",
           "get_architecture", "imported", "knob_names", "knob_schemas", "register", "load_builtin_architectures",
           "resolve_architecture", "read_depth_spec"]


def read_depth_spec(hf_config: dict[str, Any]) -> Any:
    """The typed spec of a checkpoint's `depth` section (CheckpointFormatError naming the field)."""
    return resolve_architecture(hf_config)[1]


def resolve_architecture(hf_config: dict[str, Any]) -> tuple[Architecture, Any]:
    """The registered architecture of a checkpoint's config and its parsed spec."""
    name, section = depth_section(hf_config)
    architecture = get_architecture(name)
    return architecture, architecture.read_spec(section, hf_config)
