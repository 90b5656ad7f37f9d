"""HRM-Text (Sapient HRM-Text-1B): a high-level and a low-level stack cycled H_cycles x L_cycles
times, served from its transformers checkpoint (docs/depth-semantics.md, "Public looped models:
HRM-Text")."""

from depthserve.archs.hrm_text import format
from depthserve.archs.registry import Architecture, imported, register

ARCHITECTURE = register(Architecture(
    name="hrm_text", read_spec=format.read_spec, build=imported("depthserve.archs.hrm_text.model:build"),
    reference_forward=imported("depthserve.oracles.hrm_text:forward"), tiny="depthserve.lab.tiny.hrm_text",
    description="transformers' HRM-Text model (model_type hrm_text); knobs `h_cycles`, `l_cycles`, `prefix_lm`",
    knobs=format.KNOBS))
