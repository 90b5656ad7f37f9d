"""`python -m depthserve ...` is the `depthserve` command."""

import sys

from depthserve.cli import main

sys.exit(main())
