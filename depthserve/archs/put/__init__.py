"""PUT: polymorphic universal transformer, a looped core with step embeddings and a causal conv
(docs/depth-semantics.md section 4; paper 004)."""

from depthserve.archs.put import format
from depthserve.archs.registry import Architecture, imported, register

ARCHITECTURE = register(Architecture(
    name="put", read_spec=format.read_spec, build=imported("depthserve.archs.put.model:build"),
    reference_forward=imported("depthserve.oracles.put:forward"), tiny="depthserve.lab.tiny.put",
    description="looped core with step embeddings and a causal conv; knob `loops`", knobs=format.KNOBS,
    demo=imported("depthserve.lab.demo.put:demo")))
