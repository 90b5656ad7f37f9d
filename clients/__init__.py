"""HTTP clients of a running `depthserve serve` (they use the public API only)."""

from depthserve.clients.client import AsyncDepthServeClient, DepthServeClient, depth_settings

__all__ = ["AsyncDepthServeClient", "DepthServeClient", "depth_settings"]
