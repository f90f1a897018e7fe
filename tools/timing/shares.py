"""Where the warps' time goes: the model's per-role waits beside ncu's stall samples per line.

The issue asks for the model's wait shares within 10 points of a GPU run's ncu stall breakdown.
Both sides are put into the same few categories, each a share of the warps' time:

- the model (`model_shares`): per warp role, its busy time and its waits by kind and site, over
  (warp roles x the kernel's predicted time), a diverged warp's time split over its paths as a
  sampler of warps sees it (`SAMPLED`, below);
- ncu (`ncu_shares`): the per-line stall samples of `scripts/ncu_lines.py` (its top lines, the
  rest as one share), each line put in the category of the function it is in at the measured
  commit (the wait loops of csrc/common/state.cuh), or by what it is (`__syncwarp`, the
  kernel's last `__syncthreads` and the instruction after it, where finished warps park).

`compare` puts the two side by side, per category, with the difference in points.
"""

from __future__ import annotations

import re
import subprocess

AFTER_LAST = "after the last __syncthreads"
MBARRIER = "mbarrier wait"
FLAG = "flag wait"
SYNCWARP = "__syncwarp"
ABORT = "abort flag read"
OTHER = "other"
# The waits on other warps together, whichever path of a diverged warp a sample lands on: lane 0
# spinning in the wait loop (and reading the abort flag from it), the other lanes at the
# __syncwarp after it.
WAITING_ON_WARPS = "mbarrier wait + __syncwarp + abort flag read"
CATEGORIES = (AFTER_LAST, MBARRIER, FLAG, SYNCWARP, ABORT)

# The functions of the device code whose lines are a category's (state.cuh's wait loops).
FUNCTIONS = {"mbar_wait": MBARRIER, "wait_at_least": FLAG, "aborted": ABORT}


# How a warp counts. ncu's source counters come from warp state sampling: at a fixed interval
# the SM's sampler picks a warp and records one program counter and one stall reason for it (a
# CUPTI PC-sampling record has one pcOffset and one stallReason per sample). A warp whose lanes
# stand at different sites (lane 0 spinning on an mbarrier, the other 31 at the __syncwarp after
# it, or lane 0 working while the others are parked at the last __syncthreads) is diverged: with
# independent thread scheduling it keeps a program counter per path and runs one path at a
# time, so each sample lands on one of its paths. Which one the scheduler holds at a sample is
# not documented, and the model has no scheduler of paths, so SAMPLED gives each path of a warp
# an equal share of the warp's time: the warp's time per category is the mean of its lane
# groups' (the report's `paths`: lanes grouped by the synchronisation sites they passed, each
# group's busiest lane for it), each group of each block alike. This is exact for a warp of two
# paths that end together; with three or more, lanes of two groups that stand at one site at
# once would count as one path on the GPU. BUSIEST counts a warp by its busiest lane alone
# (lane 0 where one lane waits for the others), as the model did before the paths were reported.
SAMPLED, BUSIEST = "paths", "busiest lane"


def _role_time(role: dict, count: str) -> tuple[float, list[tuple[str, float]]]:
    """(busy ns, [(wait site, ns)]) that one warp role counts for under `count`."""
    paths = role.get("paths") or []
    if count == BUSIEST or not paths:
        return role["busy_ns"], list(role["waits"])
    if count != SAMPLED:
        raise ValueError(f"count is {SAMPLED!r} or {BUSIEST!r}, got {count!r}")
    weight = sum(p["blocks"] for p in paths)
    busy = sum(p["blocks"] * p["busy_ns"] for p in paths) / weight
    waits = [(what, p["blocks"] * ns / weight) for p in paths for what, ns in p["waits"]]
    return busy, waits


def model_shares(report: dict, count: str = SAMPLED) -> dict:
    """{category: share} of one launch's timing report (warp roles x its time): busy, the wait at
    the kernel's last __syncthreads (the one waited at longest: warps whose role is done), the
    other __syncthreads, and each other kind of wait (mbarrier, flag, warp collective, bulk);
    a warp counted as `count` says (SAMPLED: its paths alike; BUSIEST: its busiest lane)."""
    total = len(report["roles"]) * report["time_ns"]
    sums = {}
    for role in report["roles"]:
        busy, waits = _role_time(role, count)
        sums["busy"] = sums.get("busy", 0.0) + busy
        for what, ns in waits:
            kind = what.split(" (")[0]
            key = what if kind == "__syncthreads" else kind
            sums[key] = sums.get(key, 0.0) + ns
    last = max((k for k in sums if k.startswith("__syncthreads")), key=sums.get, default=None)
    out = {"busy": sums.pop("busy", 0.0) / total}
    if last is not None:
        out[AFTER_LAST] = sums.pop(last) / total
    for k, v in sums.items():
        key = "__syncthreads (other)" if k.startswith("__syncthreads") else k
        out[key] = out.get(key, 0.0) + v / total
    return out


LINE = re.compile(r"^\s*([0-9.]+)%\s+(\S+):(\d+)\s+(.*?)\s*(?:\[(.*)\])?\s*$")


def read_ncu_lines(text: str) -> list[tuple[float, str, int, str, str]]:
    """(share, file, line, source text, stall reasons) per line of ncu_lines.py's output."""
    out = []
    for raw in text.splitlines():
        m = LINE.match(raw)
        if m:
            out.append((float(m.group(1)) / 100, m.group(2), int(m.group(3)), m.group(4), m.group(5) or ""))
    if not out:
        raise ValueError("no stall-sample lines (like '  44.7%  combine_receive.cuh:564  ...') in the ncu file")
    return out


FUNCTION_START = re.compile(r"^__device__\b[^(]*?\b(\w+)\s*\(")


def enclosing_functions(source: str) -> list[str | None]:
    """Per line of a device source (1-based: index 0 is line 1), the __device__ function it is
    in: the last one that started at or above it (the project's files start each at column 0)."""
    out, current = [], None
    for line in source.splitlines():
        m = FUNCTION_START.match(line)
        if m:
            current = m.group(1)
        elif line.startswith("}"):
            out.append(current)
            current = None
            continue
        out.append(current)
    return out


def git_source(repo: str, commit: str, basename: str) -> str | None:
    """The text of the file named `basename` under csrc/ at `commit` (None if none or several)."""
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit, "csrc"], cwd=repo, capture_output=True,
                           text=True, check=True).stdout.split()
    found = [n for n in names if n.rsplit("/", 1)[-1] == basename]
    if len(found) != 1:
        return None
    return subprocess.run(["git", "show", f"{commit}:{found[0]}"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout


def ncu_shares(lines: list[tuple[float, str, int, str, str]], source_of) -> dict:
    """{category: share} of ncu's lines; source_of(basename) -> that file's text at the measured
    commit, or None. Lines of no category are OTHER; what the lines leave out is OTHER too."""
    functions = {}
    out = dict.fromkeys(CATEGORIES, 0.0)
    out[OTHER] = 0.0
    parked = {(name, number) for _, name, number, _, reasons in lines if reasons.startswith("barrier")}
    for share, name, number, text, reasons in lines:
        if name not in functions:
            src = source_of(name)
            functions[name] = enclosing_functions(src) if src is not None else []
        fn = functions[name][number - 1] if number <= len(functions[name]) else None
        if fn in FUNCTIONS:
            key = FUNCTIONS[fn]
        elif "bar_warp_sync" in text:
            key = SYNCWARP
        elif (name, number) in parked or ("__syncthreads()" in text and
                                          {(name, number + 1), (name, number + 2)} & parked):
            key = AFTER_LAST  # where done warps park (stall reason barrier) and the barrier's own line
        else:
            key = OTHER
        out[key] += share
    out[OTHER] += max(0.0, 1.0 - sum(s for s, *_ in lines))
    return out


def compare(model: dict, ncu: dict) -> list[tuple[str, float, float]]:
    """(category, model share, ncu share) for each category, then the waits on other warps
    together (see WAITING_ON_WARPS)."""
    rows = [(k, model.get(k, 0.0), ncu.get(k, 0.0)) for k in (AFTER_LAST, MBARRIER, FLAG, SYNCWARP)]
    rows.append((WAITING_ON_WARPS, model.get(MBARRIER, 0.0) + model.get(SYNCWARP, 0.0),
                 ncu[MBARRIER] + ncu[SYNCWARP] + ncu[ABORT]))
    return rows


def format_comparison(kernel: str, rows: list[tuple[str, float, float]], limit: float = 0.10) -> str:
    lines = [f"{kernel}: share of the warps' time, predicted (model) against ncu's stall samples",
             f"  {'category':<46} {'model':>7} {'ncu':>7} {'points':>7}"]
    for what, m, n in rows:
        flag = "" if abs(m - n) <= limit else f"  over {limit * 100:.0f} points"
        lines.append(f"  {what:<46} {m:>7.1%} {n:>7.1%} {100 * (m - n):>+7.1f}{flag}")
    return "\n".join(lines)
