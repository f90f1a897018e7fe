"""Find NVSHMEM for the build: NVSHMEM_HOME when set, else the nvidia-nvshmem-cu12/cu13 wheel.

Used by setup.py (imported by path, before the package exists) and by scripts/compile_csrc.sh
(`python scripts/find_nvshmem.py --shell` prints shell assignments). Standard library only.

The wheel ships the headers, the device library (libnvshmem_device.a, linked into the
extension's device code with relocatable device code) and the host library only as
libnvshmem_host.so.3: the link names the file (-l:libnvshmem_host.so.3) and the extension
finds it at run time through an rpath.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import importlib.util
import os
import shlex
import sys

INSTALL_HINT = ("pip install nvidia-nvshmem-cu13 (or -cu12, matching torch.version.cuda) or set NVSHMEM_HOME, "
                "then rebuild")


@dataclasses.dataclass(frozen=True)
class Nvshmem:
    source: str  # "NVSHMEM_HOME" or the wheel's distribution name and version
    include_dir: str
    lib_dir: str
    host_lib: str  # file name in lib_dir, for -l:<name>
    device_lib: str  # path of libnvshmem_device.a
    cuda_major: int | None  # the wheel's CUDA major version; None for NVSHMEM_HOME

    def link_args(self) -> list[str]:
        """Host link: the device library's host objects, kept private to the extension (PyTorch's
        libtorch_nvshmem exports the same names for its own copy), the host library, and where to
        find it at run time."""
        return [f"-L{self.lib_dir}", "-l:libnvshmem_device.a", "-Wl,--exclude-libs,libnvshmem_device.a",
                f"-l:{self.host_lib}", f"-Wl,-rpath,{self.lib_dir}"]


def _host_lib(lib_dir: str) -> str | None:
    """libnvshmem_host.so if present, else the highest libnvshmem_host.so.N."""
    if os.path.exists(os.path.join(lib_dir, "libnvshmem_host.so")):
        return "libnvshmem_host.so"
    versioned = sorted(os.path.basename(p) for p in glob.glob(os.path.join(lib_dir, "libnvshmem_host.so.*")))
    return versioned[-1] if versioned else None


def _check_home(home: str, source: str, cuda_major: int | None) -> tuple[Nvshmem | None, str]:
    include_dir, lib_dir = os.path.join(home, "include"), os.path.join(home, "lib")
    missing = [p for p in (os.path.join(include_dir, "nvshmem.h"), os.path.join(lib_dir, "libnvshmem_device.a"))
               if not os.path.exists(p)]
    host = _host_lib(lib_dir) if os.path.isdir(lib_dir) else None
    if host is None:
        missing.append(os.path.join(lib_dir, "libnvshmem_host.so*"))
    if missing:
        return None, f"{source} at {home} has no {', '.join(missing)}"
    return Nvshmem(source, include_dir, lib_dir, host, os.path.join(lib_dir, "libnvshmem_device.a"), cuda_major), ""


def _wheel() -> tuple[str, str, int] | None:
    """(directory, distribution and version, CUDA major) of an installed nvidia-nvshmem wheel."""
    for major in (13, 12):
        dist = f"nvidia-nvshmem-cu{major}"
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        spec = importlib.util.find_spec("nvidia.nvshmem") if importlib.util.find_spec("nvidia") else None
        for location in (spec.submodule_search_locations if spec else []) or []:
            if os.path.isdir(os.path.join(location, "include")):
                return location, f"{dist} {version}", major
    return None


def find(environ=None) -> tuple[Nvshmem | None, str]:
    """(NVSHMEM, "") when found, else (None, why not). NVSHMEM_HOME wins when set."""
    environ = os.environ if environ is None else environ
    home = environ.get("NVSHMEM_HOME")
    if home:
        return _check_home(home, "NVSHMEM_HOME", None)
    wheel = _wheel()
    if wheel is None:
        return None, "no nvidia-nvshmem-cu12/cu13 wheel is installed and NVSHMEM_HOME is not set"
    location, source, major = wheel
    return _check_home(location, source, major)


def not_found_line(reason: str) -> str:
    """The one line a build without NVSHMEM prints."""
    return f"hybrid-ep: building hybrid_ep._C without the inter-node transport (NVSHMEM): {reason}; {INSTALL_HINT}"


def main(argv: list[str]) -> int:
    found, reason = find()
    if argv[1:] != ["--shell"]:
        print(found if found else reason)
        return 0 if found else 1
    if found is None:
        print(f"NVSHMEM_FOUND=0\nNVSHMEM_REASON={shlex.quote(reason)}")
        return 0
    for key, value in (("FOUND", "1"), ("SOURCE", found.source), ("INCLUDE", found.include_dir),
                       ("LIB", found.lib_dir), ("HOST_LIB", found.host_lib), ("DEVICE_LIB", found.device_lib)):
        print(f"NVSHMEM_{key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
