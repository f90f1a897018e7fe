"""The launcher's memory table reads in MiB for a model under 1 GiB per GPU (tiny_moe read 0.0 GiB
in every row) and stays in GiB for the others."""

from __future__ import annotations

import pathlib
import re

import pytest

from megatron_patches.slurm import cli, memory

pytestmark = pytest.mark.unit

RECIPES = pathlib.Path(__file__).resolve().parents[4] / "recipes"


def _amounts(table: str) -> dict[str, tuple[float, str]]:
    rows = {}
    for line in table.splitlines()[1:]:
        m = re.fullmatch(r"  (.+?)\s{2,}(\d+\.\d) (MiB|GiB)( of \d+ GiB)?", line)
        if m:
            rows[m.group(1)] = (float(m.group(2)), m.group(3))
    return rows


def test_a_model_under_one_gib_reads_in_mib():
    est = memory.estimate(cli.load_checked(str(RECIPES / "tiny_moe"), []))
    assert est.total_gb < 1
    rows = _amounts(est.table())
    assert set(rows) == {"weights", "gradients (fp32)", "optimizer (fp32 master + Adam)", "activations (rough)",
                         "total", "with dispatcher.backend cuda the buffer would hold (not in the total)"}
    assert all(unit == "MiB" and value > 0 for value, unit in rows.values())
    assert rows["total"][0] == pytest.approx(est.total_gb * 1024, abs=0.05)
    assert next(r for r in est.table().splitlines() if r.startswith("  total ")).endswith(" MiB of 80 GiB")
    assert "  dispatcher buffer (hybrid_ep reference)      0.0 MiB  (auto's pick for one node" in est.table()


def test_a_large_model_stays_in_gib():
    est = memory.estimate(cli.load_checked(str(RECIPES / "deepseek_v3"), []))
    rows = _amounts(est.table())
    assert {unit for _, unit in rows.values()} == {"GiB"}
    assert rows["total"][0] == pytest.approx(est.total_gb, abs=0.05)
    assert "balancer spare slots (weights + grads + optimizer, in the rows above)" in rows
