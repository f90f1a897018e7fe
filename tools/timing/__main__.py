"""`python -m hybrid_ep.timing`: see cli.py."""

import sys

from .cli import main

sys.exit(main())
