"""The stamp of an extension build made ahead of time for the GPU machine, and the check that it
fits the checkout and the machine it is carried to.

scripts/prebuild_gpu.sh builds hybrid_ep._C (with _model and _planner) here against the GPU
machine's torch and writes `stamp` beside the built files (`write`); scripts/gpu_check.sh asks
`check` on the GPU machine before it copies them into hybrid_ep/, and builds there when the
answer is no. What must match: the build inputs (the same files whose dates gpu_check.sh's
in-place freshness test reads: csrc/ less csrc/microbench/ and csrc/tools/, setup.py,
scripts/find_nvshmem.py; by content, as a carried copy's dates say nothing), the archs,
Python's major.minor, torch's release (without its local tag: PyPI's 2.11.0 is the +cu130
build), torch's CUDA and the nvidia-nvshmem wheel's version (its device library is linked in).

    python3 scripts/gpu_prebuilt.py write DIR --archs 90a --build-s 310   # here, after the build
    python3 scripts/gpu_prebuilt.py check DIR --archs 90a                 # there: exit 0 or 1 + why
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAMP = "stamp"
# Keys that must be equal here and there (the others, built and build_s, only inform).
MATCHED = ("inputs", "archs", "python", "torch", "cuda", "nvshmem")


def input_files(repo: Path = REPO) -> list[Path]:
    """The files hybrid_ep._C, _model and _planner are built from, sorted by their path."""
    files = [p for p in (repo / "csrc").rglob("*") if p.is_file()
             and p.relative_to(repo / "csrc").parts[0] not in ("microbench", "tools")]
    files += [repo / "setup.py", repo / "scripts" / "find_nvshmem.py"]
    return sorted((p for p in files if p.is_file()), key=lambda p: p.relative_to(repo).as_posix())


def inputs_digest(repo: Path = REPO) -> str:
    """sha256 over each input's path and content: equal exactly when the sources are."""
    h = hashlib.sha256()
    for path in input_files(repo):
        data = path.read_bytes()
        h.update(f"{path.relative_to(repo).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def environment() -> dict[str, str]:
    """This Python's and its torch's facts that the build depends on."""
    import torch

    cuda = torch.version.cuda or "none"
    try:
        nvshmem = importlib.metadata.version(f"nvidia-nvshmem-cu{cuda.split('.')[0]}")
    except importlib.metadata.PackageNotFoundError:
        nvshmem = "none"
    return {"python": f"{sys.version_info[0]}.{sys.version_info[1]}", "torch": torch.__version__.split("+")[0],
            "cuda": cuda, "nvshmem": nvshmem}


def read_stamp(folder: Path) -> dict[str, str]:
    """The stamp's key=value lines; {} when there is none."""
    path = folder / STAMP
    if not path.is_file():
        return {}
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def mismatch(stamp: dict[str, str], here: dict[str, str]) -> str | None:
    """Why the build stamped `stamp` does not fit `here` (None when it does)."""
    if not stamp:
        return "it has no stamp"
    differ = [f"{key} {stamp.get(key, 'unset')} (here {here[key]})" for key in MATCHED
              if stamp.get(key) != here[key]]
    return "built for " + ", ".join(differ) if differ else None


def here(archs: str, repo: Path = REPO) -> dict[str, str]:
    return {"inputs": inputs_digest(repo), "archs": archs, **environment()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_prebuilt.py", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("write", "check"))
    p.add_argument("folder", type=Path)
    p.add_argument("--archs", default=os.environ.get("HYBRID_EP_CUDA_ARCHS", "90a"))
    p.add_argument("--build-s", type=int, default=None, help="with write: seconds the build took")
    args = p.parse_args(argv)
    if args.action == "write":
        stamp = here(args.archs) | {"built": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        if args.build_s is not None:
            stamp["build_s"] = str(args.build_s)
        args.folder.mkdir(parents=True, exist_ok=True)
        (args.folder / STAMP).write_text("".join(f"{k}={v}\n" for k, v in stamp.items()))
        print(" ".join(f"{k}={v}" for k, v in stamp.items()))
        return 0
    stamp = read_stamp(args.folder)
    why = mismatch(stamp, here(args.archs))
    if why:
        print(why)
        return 1
    print(f"matches: built {stamp.get('built', '?')} for torch {stamp['torch']}, CUDA {stamp['cuda']}, "
          f"sm_{stamp['archs']}, sources {stamp['inputs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
