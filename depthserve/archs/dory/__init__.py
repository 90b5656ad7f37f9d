"""Dory (NVIDIA Nemotron-Labs): a public looped nGPT model, served from its transformers checkpoint
(docs/depth-semantics.md, "Public looped models: Dory")."""

from depthserve.archs.dory import format
from depthserve.archs.registry import Architecture, imported, register

ARCHITECTURE = register(Architecture(
    name="dory", read_spec=format.read_spec, build=imported("depthserve.archs.dory.model:build"),
    reference_forward=imported("depthserve.oracles.dory:forward"), tiny="depthserve.lab.tiny.dory",
    description="transformers' looped nGPT model (model_type dory); knob `loops`", knobs=format.KNOBS))
