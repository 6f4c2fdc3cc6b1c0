"""python -m attnres.bench (see attnres.bench.cli)."""

import sys

from .cli import main

sys.exit(main())
