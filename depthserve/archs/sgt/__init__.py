"""SGT: static head-subset attention loops (docs/depth-semantics.md section 1; paper 000)."""

from depthserve.archs.registry import Architecture, Command, imported, register
from depthserve.archs.sgt import format

ARCHITECTURE = register(Architecture(
    name="sgt", read_spec=format.read_spec, build=imported("depthserve.archs.sgt.model:build"),
    reference_forward=imported("depthserve.oracles.sgt:forward"), tiny="depthserve.lab.tiny.sgt",
    description="head-subset attention loops; knob `loops`", knobs=format.KNOBS,
    commands=(Command("import-sgt", "depthserve.lab.sgt_import",
                      "convert an SGT training checkpoint (OLMo v1 layout) to the native format"),
              Command("graft-sgt", "depthserve.lab.sgt_graft",
                      "training-free SGT: loop the highest-entropy heads of any Llama checkpoint"))))
