"""SAOBP: one-step belief-propagation attention (depth-semantics.md section 5; paper 003)."""

from depthserve.archs.base import Architecture, register
from depthserve.archs.saobp import format, model, reference, tiny

ARCHITECTURE = register(Architecture(
    name="saobp", read_spec=format.read_spec, build=model.build, reference_forward=reference.forward,
    make_tiny=tiny.make_tiny, description="attention refined by a trained per-key belief-propagation bias; no knobs"))
