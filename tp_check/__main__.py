"""python -m tp_check (see tp_check.cli)."""

import sys

from .cli import main

sys.exit(main())
