"""The Llama family (Llama, Mistral, SmolLM2): docs/depth-semantics.md section 0."""

from depthserve.archs.llama import format
from depthserve.archs.registry import Architecture, imported, register

ARCHITECTURE = register(Architecture(
    name="llama", read_spec=format.read_spec, build=imported("depthserve.archs.llama.model:build"),
    reference_forward=imported("depthserve.oracles.llama:forward"), tiny="depthserve.lab.tiny.llama",
    description="plain Llama-family decoder"))
