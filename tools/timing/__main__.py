"""`python -m tools.timing`: see cli.py."""

import sys

from .cli import main

sys.exit(main())
