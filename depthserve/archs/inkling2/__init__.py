"""Inkling-2 loop (Thinking Machines): the looped text model of Inkling-2-Mini, served from its
transformers checkpoint (docs/depth-semantics.md, "Public looped models: Inkling-2")."""

from depthserve.archs.inkling2 import format
from depthserve.archs.registry import Architecture, imported, register

ARCHITECTURE = register(Architecture(
    name="inkling2_loop_text", read_spec=format.read_spec, build=imported("depthserve.archs.inkling2.model:build"),
    reference_forward=imported("depthserve.oracles.inkling2:forward"), tiny="depthserve.lab.tiny.inkling2",
    description="transformers' Inkling-2 looped text model (model_type inkling2_loop_text); knob `loops`",
    knobs=format.KNOBS))

# The multimodal checkpoint names an architecture of its own, so that loading it says why it is refused.
MULTIMODAL = register(Architecture(
    name="inkling2_loop", read_spec=format.refuse_multimodal, build=imported("depthserve.archs.inkling2.model:build"),
    reference_forward=imported("depthserve.oracles.inkling2:forward"),
    description="Inkling-2 with its vision tower (model_type inkling2_loop): refused, serve the text model"))
