"""Deploying depthserve past one process (Ray Serve: ray_serve.py)."""
