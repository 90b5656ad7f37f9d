"""The Llama family (Llama, Mistral, SmolLM2): depth-semantics.md section 0."""

from depthserve.archs.base import Architecture, register
from depthserve.archs.llama import format, model, reference, tiny

ARCHITECTURE = register(Architecture(
    name="llama", read_spec=format.read_spec, build=model.build, reference_forward=reference.forward,
    make_tiny=tiny.make_tiny, description="plain Llama-family decoder"))
