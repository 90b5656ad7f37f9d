"""The Llama family (Llama, Mistral, SmolLM2): docs/depth-semantics.md section 0."""

from depthserve.archs.llama import format, tiny
from depthserve.archs.registry import Architecture, imported, register

ARCHITECTURE = register(Architecture(
    name="llama", read_spec=format.read_spec, build=imported("depthserve.archs.llama.model:build"),
    reference_forward=imported("depthserve.archs.llama.reference:forward"), make_tiny=tiny.make_tiny,
    description="plain Llama-family decoder"))
