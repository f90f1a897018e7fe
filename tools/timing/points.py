"""The measured GPU points the timing model is calibrated on and scored against.

tools/timing/points.json holds every (W, nodes, SMs per rank, kernel, ms, rows)
of the emulated benchmark runs on a GPU, each run with the commit whose kernels it measured,
so that a prediction is always made for the code that was timed. `points_from_run` turns one
run's emulated.json into these entries; `load_points` reads the file back.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os

POINTS_FILE = os.path.join(os.path.dirname(__file__), "points.json")
SCHEMA = "hybrid-ep-timing-points/1"
KERNELS = ("dispatch", "combine")


@dataclasses.dataclass(frozen=True)
class Run:
    """One benchmark run on a GPU: where its files are and what it measured."""

    name: str           # e.g. "2026-11-24-h100/bench": the folder under benchmarks/results/
    date: str           # the emulated.json's date
    device: str
    commit: str         # the commit whose kernels ran
    commit_note: str    # how the commit was established
    command: str
    hidden: int
    tokens_per_rank: int
    topk: int
    experts: int
    dtype: str
    routing: str
    seed: int
    host_time_us: dict  # "W=2" -> host time per dispatch + combine pair (static size), us


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured kernel time: the median of the run's timed calls."""

    run: str
    world_size: int
    nodes: int
    sms_per_rank: int
    kernel: str  # "dispatch" (count kernel, host read of the row count and dispatch kernel) or "combine"
    ms: float
    recv_rows: int
    out_rows: int
    rdma_rows: int
    # the kernels' data path (HYBRID_EP_DATA_PATH): runs before the direct path had none, and
    # their points name none: the receive path
    data_path: str = "receive"

    @property
    def key(self) -> tuple:
        return (self.world_size, self.nodes, self.sms_per_rank, self.kernel)


def today() -> str:
    return datetime.date.today().isoformat()


def points_from_run(emulated: dict, name: str, commit: str, commit_note: str) -> tuple[Run, list[Point]]:
    """The run and its points from one emulated.json (hybrid-ep-bench --emulate)."""
    meta, cfg = emulated["metadata"], emulated["metadata"]["config"]
    run = Run(name=name, date=meta["date"], device=meta["device"], commit=commit, commit_note=commit_note,
              command=emulated["command"], hidden=cfg["hidden"], tokens_per_rank=cfg["tokens_per_rank"],
              topk=cfg["topk"], experts=cfg["experts"], dtype=cfg["dtype"], routing=cfg["routing"],
              seed=cfg.get("seed", 0),
              host_time_us={k: v["median_us"] for k, v in emulated.get("host_time", {}).items()})
    points = [Point(run=name, world_size=r["world_size"], nodes=r.get("nodes", 1), sms_per_rank=r["sms_per_rank"],
                    kernel=k, ms=r[f"{k}_ms"], recv_rows=r["recv_rows"], out_rows=r["out_rows"],
                    rdma_rows=r.get("rdma_rows", 0), data_path=r.get("data_path", "receive"))
              for r in emulated["runs"] for k in KERNELS]
    return run, points


def dump_points(runs: list[Run], points: list[Point]) -> dict:
    units = {"ms": "ms, median of the run's timed calls (CUDA events)",
             "recv_rows": "rows all ranks received in the dispatch (one per token and destination rank)",
             "out_rows": "rows all ranks hand to their experts (one per token and routed expert)",
             "rdma_rows": "rows the forwarders received by RDMA in the dispatch (as many go back in the combine)",
             "host_time_us": "us, host time per dispatch + combine pair in static-size mode, per W",
             "data_path": "the kernels' data path the point ran (direct or receive)"}
    return {"schema": SCHEMA, "units": units, "runs": [dataclasses.asdict(r) for r in runs],
            "points": [dataclasses.asdict(p) for p in points]}


def write_points(path: str, runs: list[Run], points: list[Point]) -> None:
    """points.json with one line per point, so that a diff shows each changed point."""
    data = dump_points(runs, points)
    lines = [json.dumps(p) for p in data.pop("points")]
    text = json.dumps(data, indent=1)[:-2]  # without the closing brace
    with open(path, "w") as f:
        f.write(text + ',\n "points": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n")


def load_points(path: str = POINTS_FILE) -> tuple[dict[str, Run], list[Point]]:
    """(runs by name, points) from points.json."""
    with open(path) as f:
        data = json.load(f)
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    runs = {r["name"]: Run(**r) for r in data["runs"]}
    points = [Point(**p) for p in data["points"]]
    for p in points:
        if p.run not in runs:
            raise ValueError(f"{path}: a point of run {p.run!r}, which the file does not list")
    return runs, points
