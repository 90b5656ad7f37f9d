"""Dory (NVIDIA Nemotron-Labs): a public looped nGPT model, served from its transformers checkpoint
(docs/depth-semantics.md, "Public looped models: Dory")."""

from depthserve.archs.dory import format, tiny
from depthserve.archs.registry import Architecture, imported, register

ARCHITECTURE = register(Architecture(
    name="dory", read_spec=format.read_spec, build=imported("depthserve.archs.dory.model:build"),
    reference_forward=imported("depthserve.archs.dory.reference:forward"), make_tiny=tiny.make_tiny,
    description="transformers' looped nGPT model (model_type dory); knob `loops`", knobs=format.KNOBS))
