"""ITT: token-routed thinking steps (depth-semantics.md section 2; paper 001)."""

from depthserve.archs.base import Architecture, register
from depthserve.archs.itt import format, model, reference, tiny

ARCHITECTURE = register(Architecture(
    name="itt", read_spec=format.read_spec, build=model.build, reference_forward=reference.forward,
    make_tiny=tiny.make_tiny, description="token-routed thinking steps; knobs `selection_ratios`, `thinking_steps`"))
