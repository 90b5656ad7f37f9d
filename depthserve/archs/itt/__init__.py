"""ITT: token-routed thinking steps (docs/depth-semantics.md section 2; paper 001)."""

from depthserve.archs.itt import format, tiny
from depthserve.archs.registry import Architecture, Command, imported, register

ARCHITECTURE = register(Architecture(
    name="itt", read_spec=format.read_spec, build=imported("depthserve.archs.itt.model:build"),
    reference_forward=imported("depthserve.archs.itt.reference:forward"), make_tiny=tiny.make_tiny,
    description="token-routed thinking steps; knobs `selection_ratios`, `thinking_steps`", knobs=format.KNOBS,
    tiny_flags=tiny.CLI_FLAGS,
    commands=(Command("calibrate", "depthserve.archs.itt.calibrate",
                      "write an ITT checkpoint's router-score calibration table"),),
    demo=imported("depthserve.archs.itt.demo:demo")))
