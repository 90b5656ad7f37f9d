"""PUT: polymorphic universal transformer, a looped core with step embeddings and a causal conv
(depth-semantics.md section 4; paper 004)."""

from depthserve.archs.base import Architecture, register
from depthserve.archs.put import format, model, reference, tiny

ARCHITECTURE = register(Architecture(
    name="put", read_spec=format.read_spec, build=model.build, reference_forward=reference.forward,
    make_tiny=tiny.make_tiny, description="looped core with step embeddings and a causal conv; knob `loops`"))
