"""ITT: token-routed thinking steps (docs/depth-semantics.md section 2; paper 001)."""

from depthserve.archs.itt import format
from depthserve.archs.registry import Architecture, Command, imported, register

ARCHITECTURE = register(Architecture(
    name="itt", read_spec=format.read_spec, build=imported("depthserve.archs.itt.model:build"),
    reference_forward=imported("depthserve.oracles.itt:forward"), tiny="depthserve.lab.tiny.itt",
    description="token-routed thinking steps; knobs `selection_ratios`, `thinking_steps`", knobs=format.KNOBS,
    commands=(Command("calibrate", "depthserve.lab.itt_calibrate",
                      "write an ITT checkpoint's router-score calibration table"),),
    demo=imported("depthserve.lab.demo.itt:demo")))
