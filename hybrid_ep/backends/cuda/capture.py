"""Whether a CUDA graph is being captured: the one place the cuda backend asks.

Inside a capture nothing may read back to the host, grow or map memory, or wait on an event:
the agreement takes the path its ledger holds or the receive path (agreement.py), the arena
keeps every block it hands out for the graph's replays (arena.py), and the expert-out block's
stream order records nothing (expert_out_order.py). The CPU tests fake a capture by replacing
`capturing` here.
"""

from __future__ import annotations

import torch


def capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` is capturing a CUDA graph (never on the CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
