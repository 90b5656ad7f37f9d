"""Dreamer: one shared block applied `depth` times, with depth attention and expert attention
(depth-semantics.md section 3; paper 002)."""

from depthserve.archs.base import Architecture, register
from depthserve.archs.dreamer import format, model, reference, tiny

ARCHITECTURE = register(Architecture(
    name="dreamer", read_spec=format.read_spec, build=model.build, reference_forward=reference.forward,
    make_tiny=tiny.make_tiny, description="shared block recurrence with depth and expert attention; knob `depth`"))
