"""python -m attnres.tp (see attnres.tp.cli)."""

import sys

from .cli import main

sys.exit(main())
