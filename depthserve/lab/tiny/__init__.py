"""Each architecture's tiny random checkpoint (`depthserve make-tiny`, depthserve/lab/make_tiny.py)."""
