"""SGT: static head-subset attention loops (docs/depth-semantics.md section 1; paper 000)."""

from depthserve.archs.registry import Architecture, Command, imported, register
from depthserve.archs.sgt import format, tiny

ARCHITECTURE = register(Architecture(
    name="sgt", read_spec=format.read_spec, build=imported("depthserve.archs.sgt.model:build"),
    reference_forward=imported("depthserve.archs.sgt.reference:forward"), make_tiny=tiny.make_tiny,
    description="head-subset attention loops; knob `loops`", knobs=format.KNOBS, tiny_flags=tiny.CLI_FLAGS,
    commands=(Command("import-sgt", "depthserve.archs.sgt.import_checkpoint",
                      "convert an SGT training checkpoint (OLMo v1 layout) to the native format"),
              Command("graft-sgt", "depthserve.archs.sgt.graft",
                      "training-free SGT: loop the highest-entropy heads of any Llama checkpoint"))))
