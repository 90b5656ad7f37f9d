"""SAOBP: one-step belief-propagation attention (docs/depth-semantics.md section 5; paper 003)."""

from depthserve.archs.registry import Architecture, imported, register
from depthserve.archs.saobp import format

ARCHITECTURE = register(Architecture(
    name="saobp", read_spec=format.read_spec, build=imported("depthserve.archs.saobp.model:build"),
    reference_forward=imported("depthserve.oracles.saobp:forward"), tiny="depthserve.lab.tiny.saobp",
    description="attention refined by a trained per-key belief-propagation bias; no knobs"))
