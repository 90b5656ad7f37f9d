"""SGT: static head-subset attention loops (depth-semantics.md section 1; paper 000)."""

from depthserve.archs.base import Architecture, register
from depthserve.archs.sgt import format, model, reference, tiny

ARCHITECTURE = register(Architecture(
    name="sgt", read_spec=format.read_spec, build=model.build, reference_forward=reference.forward,
    make_tiny=tiny.make_tiny, description="head-subset attention loops; knob `loops`"))
