"""Dreamer: one shared block applied `depth` times, with depth attention and expert attention
(docs/depth-semantics.md section 3; paper 002)."""

from depthserve.archs.dreamer import format
from depthserve.archs.registry import Architecture, imported, register

ARCHITECTURE = register(Architecture(
    name="dreamer", read_spec=format.read_spec, build=imported("depthserve.archs.dreamer.model:build"),
    reference_forward=imported("depthserve.oracles.dreamer:forward"), tiny="depthserve.lab.tiny.dreamer",
    description="shared block recurrence with depth and expert attention; knob `depth`", knobs=format.KNOBS,
    demo=imported("depthserve.lab.demo.dreamer:demo")))
