#!/usr/bin/env python3
"""Render, check and submit Slurm pretraining recipes (megatron_patches.slurm.cli; docs/slurm.md).

    python scripts/launch_slurm.py recipes/deepseek_v3 --dry-run
    python scripts/launch_slurm.py recipes/tiny_moe --local --set train.steps=3

Works from the checkout without installing (the repository root is put on sys.path); when
installed, the same command is `hybrid-ep-launch`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_patches.slurm.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
