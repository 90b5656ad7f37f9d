"""`depthserve.tiny` moved to `depthserve.lab.make_tiny` (the offline tools' home); this name stays
importable."""

from depthserve.lab.make_tiny import *  # noqa: F403
from depthserve.lab.make_tiny import __all__  # noqa: F401
