"""`depthserve.reference` moved to `depthserve.oracles` (the test oracles' home); this name stays
importable."""

from depthserve.oracles import forward

__all__ = ["forward"]
