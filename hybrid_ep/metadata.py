"""The metadata block every JSON file of the project starts with.

A number without its device, backend, versions, date, configuration and units cannot be
compared with another one, so every writer (benchmark, demo, traffic model, balancer
reports) puts the same block under the key "metadata":

    schema    "hybrid-ep-metadata/1"
    tool      the command that wrote the file, e.g. "hybrid-ep-bench"
    date      local time with its UTC offset (ISO 8601, seconds)
    device    "CPU: <model> (<n> cores)" or the GPU's name
    backends  hybrid_ep backends that moved the data ([] when nothing was communicated:
              a model or a plan)
    versions  python, platform, hybrid_ep, torch, cuda (torch's CUDA, null on CPU builds),
              driver (GPU driver, null on CPU), megatron_core and numpy (null if absent)
    config    the settings that produced the numbers (tool specific)
    units     unit of each number field, by field name
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess

SCHEMA = "hybrid-ep-metadata/1"
KEYS = ("schema", "tool", "date", "device", "backends", "versions", "config", "units")


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_cpu() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU: {cpu_name()} ({cores} cores)"


def describe_device(device_type: str) -> str:
    """"CPU: ..." for "cpu", the current GPU's name for "cuda"."""
    if device_type == "cpu":
        return describe_cpu()
    if device_type == "cuda":
        import torch

        return torch.cuda.get_device_name(torch.cuda.current_device())
    raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")


def _nvidia_smi(field: str) -> str | None:
    """One field of the first GPU as nvidia-smi reports it, None without nvidia-smi or a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0].strip() if out.strip() else None


def gpu_driver() -> str | None:
    """The NVIDIA driver version (nvidia-smi), None without one."""
    return _nvidia_smi("driver_version")


def gpu_sm_clock_mhz() -> float | None:
    """The SM clock the first GPU runs at now (nvidia-smi clocks.sm, MHz): read right after a
    measurement, the clock it ran at. None without a GPU or a number."""
    raw = _nvidia_smi("clocks.sm")
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(device_type: str, driver: str | None = None) -> dict:
    import torch

    from . import __version__

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hybrid_ep": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver if driver is not None or device_type != "cuda" else gpu_driver(),
        "megatron_core": _installed("megatron-core"),
        "numpy": _installed("numpy"),
    }


def metadata(tool: str, *, device_type: str, config: dict, units: dict, backends=(),
             device: str | None = None, driver: str | None = None) -> dict:
    """The block, for numbers produced on `device_type` ("cpu" or "cuda").

    device: the description when the caller knows it better (e.g. several ranks' devices);
    default: this process's device of that type.
    """
    if not isinstance(tool, str) or not tool:
        raise ValueError(f"tool must be a non-empty string (the command that writes the file), got {tool!r}")
    for name, value in (("config", config), ("units", units)):
        if not isinstance(value, dict):
            raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    return {
        "schema": SCHEMA,
        "tool": tool,
        "date": now(),
        "device": device if device is not None else describe_device(device_type),
        "backends": list(backends),
        "versions": versions(device_type, driver),
        "config": config,
        "units": units,
    }


_TYPES = {"schema": str, "tool": str, "date": str, "device": str, "backends": list, "versions": dict,
          "config": dict, "units": dict}
_VERSION_KEYS = ("python", "platform", "hybrid_ep", "torch", "cuda", "driver", "megatron_core", "numpy")


def validate(block) -> dict:
    """Check a block read back from a file; raise ValueError naming the key and the rule."""
    if not isinstance(block, dict):
        raise ValueError(f"metadata must be a mapping, got {type(block).__name__}")
    for key in KEYS:
        if key not in block:
            raise ValueError(f"metadata.{key} is missing (every block has {', '.join(KEYS)})")
        if not isinstance(block[key], _TYPES[key]):
            raise ValueError(f"metadata.{key} must be a {_TYPES[key].__name__}, got {type(block[key]).__name__}")
    if block["schema"] != SCHEMA:
        raise ValueError(f"metadata.schema must be {SCHEMA!r}, got {block['schema']!r}")
    missing = [k for k in _VERSION_KEYS if k not in block["versions"]]
    if missing:
        raise ValueError(f"metadata.versions lacks {', '.join(missing)}")
    datetime.datetime.fromisoformat(block["date"])  # ValueError when it is not ISO 8601
    return block
