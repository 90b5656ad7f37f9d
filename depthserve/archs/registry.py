"""The one registry of architectures: what each registers (`Architecture`) and the look-ups the
rest of depthserve makes through it (knob names, make-tiny flags, checkpoint commands, demo
recipes), so that nothing outside an architecture's folder names it.

The registry loads without torch: a built-in architecture's `__init__.py` imports only its format
module and names its model, reference, tiny checkpoints, commands and demo by dotted path
(`imported`, `Architecture.tiny`), so `depthserve --help` lists every command without loading a
model's code, and the offline tools (depthserve/lab) may import the registry without a cycle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from depthserve.depth import KnobInfo
from depthserve.errors import UnknownArchitectureError

if TYPE_CHECKING:
    from depthserve.archs.base import BuildOptions, DepthModel

BUILTIN = ("llama", "sgt", "itt", "dreamer", "put", "saobp", "dory", "inkling2", "hrm_text")


def imported(path: str) -> Callable[..., Any]:
    """The function at "package.module:name", imported on its first call (a registration names
    its heavy parts this way, so the registry itself stays light)."""
    module, _, name = path.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = path
    return call


@dataclass(frozen=True)
class TinyFlag:
    """A `depthserve make-tiny` flag of one architecture: `--flag VALUE` sets its make_tiny keyword
    `option` to `parse(VALUE)`, then to `resolve(value, like)` where the value depends on the
    shapes (`--like`) the checkpoint gets."""

    flag: str
    option: str
    parse: Callable[[str], Any]
    help: str
    resolve: Callable[[Any, str | None], Any] | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


class TinyCheckpoints(Protocol):
    """An architecture's tiny random checkpoints (a module of depthserve/lab/tiny/)."""

    CLI_FLAGS: tuple[TinyFlag, ...]  # make-tiny's flags for its own options (beyond --option)

    def make_tiny(self, out: Path, seed: int, like: str | None, num_kv_heads: int | None, tokenizer: Any,
                  **options: Any) -> Path:
        """Write a random-weight checkpoint to `out` (options: its keyword-only parameters)."""


@dataclass(frozen=True)
class Command:
    """A `depthserve` subcommand an architecture brings (a checkpoint tool): the module that adds
    it (`add_subcommands(sub)`), imported only when that command runs."""

    name: str
    module: str
    help: str


@dataclass(frozen=True)
class Architecture:
    """One architecture, as the registry knows it."""

    name: str
    # format: the config.json `depth` section (None when absent) and the HF config -> a typed spec
    read_spec: Callable[[dict[str, Any] | None, dict[str, Any]], Any]
    # model: the engine's model for a config and spec, weights not loaded yet
    build: Callable[[dict[str, Any], Any, BuildOptions], DepthModel]
    # reference: logits [n, V] of the plain full-sequence forward (the test oracle)
    reference_forward: Callable[..., Any]
    # its tiny random checkpoints: the dotted name of a TinyCheckpoints module (depthserve/lab/tiny/),
    # imported when make-tiny runs (the offline tools import the registry, never the other way)
    tiny: str | None = None
    description: str = ""
    knobs: tuple[KnobInfo, ...] = ()  # the knobs its models accept (each checkpoint sets their ranges)
    commands: tuple[Command, ...] = ()  # its checkpoint tools
    # its demo recipe (depthserve train-demo): () -> depthserve.demo.recipe.DemoArch
    demo: Callable[[], Any] | None = None

    def tiny_checkpoints(self) -> TinyCheckpoints | None:
        return None if self.tiny is None else importlib.import_module(self.tiny)


REGISTRY: dict[str, Architecture] = {}


def register(architecture: Architecture) -> Architecture:
    """Make an architecture known to the loader, the reference dispatch, make-tiny, the server's
    knob schema and the command line."""
    REGISTRY[architecture.name] = architecture
    return architecture


def load_builtin_architectures() -> None:
    for name in BUILTIN:
        if name not in REGISTRY:
            importlib.import_module(f"depthserve.archs.{name}")


def architectures() -> list[Architecture]:
    """Every registered architecture, by name."""
    load_builtin_architectures()
    return [REGISTRY[name] for name in sorted(REGISTRY)]


def get_architecture(name: str) -> Architecture:
    load_builtin_architectures()
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownArchitectureError(
            f"depth.architecture {name!r} is not a known architecture; known: {sorted(REGISTRY)} "
            "(register one with depthserve.archs.register)") from None


def architecture_names() -> list[str]:
    return [architecture.name for architecture in architectures()]


def knob_names() -> list[str]:
    """Every knob name a registered architecture declares (a request's names are checked against
    these before a model is at hand, and against the model's own once it is)."""
    return sorted({knob.name for architecture in architectures() for knob in architecture.knobs})


def knob_schemas() -> dict[str, dict[str, Any]]:
    """The JSON schema of each declared knob's value, described per architecture that has it (the
    HTTP schema of `depth`)."""
    by_name: dict[str, list[tuple[str, KnobInfo]]] = {}
    for architecture in architectures():
        for knob in architecture.knobs:
            by_name.setdefault(knob.name, []).append((architecture.name, knob))
    schemas = {}
    for name, declared in sorted(by_name.items()):
        shapes: list[dict[str, Any]] = []
        for _, knob in declared:
            shape = knob.value_schema()
            for one in shape.get("anyOf", [shape]):
                if one not in shapes:
                    shapes.append(one)
        schemas[name] = {**(shapes[0] if len(shapes) == 1 else {"anyOf": shapes}),
                         "description": "; ".join(f"{arch}: {knob.description}" for arch, knob in declared)}
    return schemas


def demo_arches() -> dict[str, Any]:
    """Architecture name -> its demo recipe (depthserve.demo.recipe.DemoArch), for those with one."""
    return {architecture.name: architecture.demo() for architecture in architectures() if architecture.demo}
