"""`python -m hybrid_ep.traffic`: see cli.py."""

import sys

from .cli import main

sys.exit(main())
