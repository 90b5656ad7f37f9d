"""`python -m depthserve ...` is the `depthserve` command."""

import sys

from depthserve.tools.cli import main

sys.exit(main())
