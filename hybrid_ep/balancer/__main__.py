"""`python -m hybrid_ep.balancer`: see cli.py."""

import sys

from .cli import main

sys.exit(main())
