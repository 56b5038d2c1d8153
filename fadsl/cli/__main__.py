"""`python -m fadsl.cli`: the `fadsl` command."""

import sys

from . import main

sys.exit(main())
