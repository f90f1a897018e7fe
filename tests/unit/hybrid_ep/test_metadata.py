"""The metadata block shared by every JSON the project writes (hybrid_ep.metadata).

The benchmark, traffic and demo files are checked in their own tests (test_bench,
test_traffic, test_megatron_demo); here: the block itself and the balancer's summary file.
"""

from __future__ import annotations

import datetime
import json

import pytest
import torch

import hybrid_ep
from hybrid_ep import metadata as md
from hybrid_ep.balancer.metrics import SUMMARY_KEYS, summarize
from hybrid_ep.balancer.planner import plan_placement
from hybrid_ep.balancer.report import write_report

pytestmark = pytest.mark.unit


def test_block_has_every_key_with_this_machine():
    block = md.metadata("my-tool", device_type="cpu", config={"hidden": 128}, units={"t": "s"},
                        backends=["reference"])
    assert tuple(block) == md.KEYS and md.validate(block) is block
    assert block["schema"] == "hybrid-ep-metadata/1" and block["tool"] == "my-tool"
    assert block["device"].startswith("CPU: ") and block["device"].endswith(" cores)")
    assert block["backends"] == ["reference"]
    assert block["config"] == {"hidden": 128} and block["units"] == {"t": "s"}
    v = block["versions"]
    assert v["torch"] == torch.__version__ and v["hybrid_ep"] == hybrid_ep.__version__
    assert v["driver"] is None  # numbers made on the CPU have no GPU driver
    age = datetime.datetime.now().astimezone() - datetime.datetime.fromisoformat(block["date"])
    assert datetime.timedelta(0) <= age < datetime.timedelta(minutes=5)


def test_device_may_be_given():
    block = md.metadata("t", device_type="cuda", config={}, units={}, device="NVIDIA H100 80GB HBM3", driver="570")
    assert block["device"] == "NVIDIA H100 80GB HBM3" and block["versions"]["driver"] == "570"


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(tool=""), ValueError, "tool must be a non-empty string"),
    (dict(config=[1]), TypeError, "config must be a dict"),
    (dict(units="ms"), TypeError, "units must be a dict"),
    (dict(device_type="tpu"), ValueError, "device_type must be 'cpu' or 'cuda'"),
])
def test_bad_arguments_name_the_argument(kwargs, exc, words):
    args = dict(tool="t", device_type="cpu", config={}, units={}) | kwargs
    with pytest.raises(exc, match=words):
        md.metadata(args.pop("tool"), **args)


@pytest.mark.parametrize("change, words", [
    (lambda b: b.pop("units"), r"metadata.units is missing"),
    (lambda b: b.update(schema="hybrid-ep-bench/1"), r"metadata.schema must be 'hybrid-ep-metadata/1'"),
    (lambda b: b.update(backends="reference"), r"metadata.backends must be a list"),
    (lambda b: b["versions"].pop("torch"), r"metadata.versions lacks torch"),
    (lambda b: b.update(date="yesterday"), r"Invalid isoformat"),
])
def test_validate_names_the_key(change, words):
    block = md.metadata("t", device_type="cpu", config={}, units={})
    change(block)
    with pytest.raises(ValueError, match=words):
        md.validate(block)


def test_balancer_summary_file_carries_the_block(tmp_path):
    load = torch.tensor([[9.0, 1.0, 1.0, 1.0], [4.0, 4.0, 2.0, 2.0]])
    summary = summarize(load, None, plan_placement(load, 8, 1, 2))
    path = write_report(summary, str(tmp_path), step=12)["summary"]
    doc = json.load(open(path))
    meta = md.validate(doc["metadata"])
    assert meta["tool"] == "hybrid_ep.balancer" and meta["backends"] == []
    assert meta["config"] == {"num_layers": 2, "num_experts": 4, "num_slots": 8, "num_ranks": 2, "num_nodes": 1,
                              "step": 12}
    assert set(SUMMARY_KEYS) <= set(meta["units"])
    assert doc["moves"] == summary["moves"] and doc["step"] == 12


@pytest.mark.parametrize("printed, want", [("1755\n", 1755.0), ("[N/A]\n", None), ("", None)])
def test_sm_clock_is_read_from_nvidia_smi(monkeypatch, printed, want):
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        return md.subprocess.CompletedProcess(cmd, 0, stdout=printed, stderr="")

    monkeypatch.setattr(md.subprocess, "run", run)
    assert md.gpu_sm_clock_mhz() == want
    assert calls == [["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"]]


def test_no_nvidia_smi_means_no_clock_and_no_driver(monkeypatch):
    def missing(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(md.subprocess, "run", missing)
    assert md.gpu_sm_clock_mhz() is None and md.gpu_driver() is None
