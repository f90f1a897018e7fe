"""Megatron's parallel state on the pools' ranks: re-initialising another layout destroys the old
layout's process groups, so a rank that serves many tests does not keep a gloo group (and its
polling thread) per layout it ever had."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.megatron


def _groups_after_layouts(layouts: list[int]) -> list[int]:
    """Runs on each rank: the process groups torch holds after each init_megatron."""
    from torch.distributed import distributed_c10d

    from megatron_patches.local.common import init_megatron

    counts = []
    for ep in layouts:
        init_megatron(ep)
        counts.append(len(distributed_c10d._world.pg_map))
    return counts


def test_a_new_layout_leaves_the_old_layouts_groups_behind(pool_for):
    got = pool_for(2).run(_groups_after_layouts, [([2, 1, 2, 1, 2],)] * 2)
    for counts in got:
        assert counts[0] == counts[2] == counts[4] and counts[1] == counts[3], counts
        assert counts[0] > 1  # Megatron's groups besides the world
