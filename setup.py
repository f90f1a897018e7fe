"""hybrid-ep: hierarchical expert-parallel dispatch/combine for Megatron-Core MoE training.

Two extensions are compiled ahead of time from csrc/:
- hybrid_ep._C, the kernels for the GPU, when a CUDA toolkit and a CUDA build of PyTorch are
  present; otherwise the package installs without it (reference backend) and one line says why.
  With NVSHMEM (scripts/find_nvshmem.py: the nvidia-nvshmem wheel or NVSHMEM_HOME) it also holds
  the inter-node transport; without, one line says so;
- hybrid_ep._model, the same kernel sources on the CPU model of the device layer with its timing
  model, with the host compiler alone (no CUDA toolkit), so the kernels' logic is tested on
  every machine: a development build only (HYBRID_EP_BUILD_MODEL=1, which scripts/env.sh sets),
  so a wheel or a plain `pip install` holds neither.
A third, hybrid_ep._planner (the expert balancer's placement planner, csrc/balancer/), is
plain C++ and always built: the balancer needs it.

With HYBRID_EP_BUILD_CACHE set to a folder (scripts/env.sh sets it), the two host-compiled
modules are kept there under a digest of everything their build reads (sources, every header
under csrc/, flags, compiler and Python), and a build that finds its digest copies the module
instead of compiling it (2 to 3 minutes on 2 cores): a fresh clone of an unchanged tree, as CI
makes, installs in seconds.

The package's metadata (name, version, dependencies, extras, the CLIs) and which packages the
wheel holds are in pyproject.toml; this file holds what must stay code, the extensions.
"""

import concurrent.futures
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _setuptools_build_ext


def _default_archs(cuda_home: str) -> str:
    """sm_90a always; sm_100a too when this nvcc can build it (CUDA >= 12.8)."""
    archs = ["90a"]
    try:
        listed = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-code"],
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ";".join(archs)
    if "sm_100" in listed.split():
        archs.append("100a")
    return ";".join(archs)


def _locate_cuda_home() -> None:
    """Point CUDA_HOME at the toolkit when nvcc on PATH is a wrapper outside it.

    PyTorch takes the parent of nvcc's directory; a wrapper script in /usr/local/bin would
    make that /usr/local, which has no CUDA headers. nvcc --dryrun names its real home.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None or os.path.exists(os.path.join(os.path.dirname(nvcc), "..", "include", "cuda_runtime.h")):
        return
    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "probe.cu")
        open(probe, "w").close()
        run = subprocess.run([nvcc, "--dryrun", "-c", probe], capture_output=True, text=True)
    for line in (run.stdout + run.stderr).splitlines():
        if line.startswith("#$ TOP="):
            home = os.path.normpath(line.split("=", 1)[1].strip())
            if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
                os.environ["CUDA_HOME"] = home
            return


def _csrc_files() -> list[str]:
    """Every source and header under csrc/ but the microbenchmarks' and the tools' (no extension
    has them): an extension is rebuilt when any of them changes (setuptools compares only the
    listed sources otherwise, and the model's sources include the kernels' .cu files)."""
    return sorted(p for ext in ("cu", "cuh", "h", "cpp") for p in glob.glob(f"csrc/**/*.{ext}", recursive=True)
                  if not p.startswith(("csrc/microbench/", "csrc/tools/")))


def _cuda_extension():
    """Return (ext_modules, cmdclass, reason it was skipped or None)."""
    if os.environ.get("HYBRID_EP_SKIP_CUDA_BUILD") == "1":
        return [], {}, "HYBRID_EP_SKIP_CUDA_BUILD=1"
    # *_nvshmem.cu need NVSHMEM's headers and relocatable device code: only with NVSHMEM.
    sources = _cuda_sources(with_nvshmem=False)
    if not all(os.path.exists(s) for s in sources):
        return [], {}, "csrc/ has no CUDA sources"
    _locate_cuda_home()
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}, "PyTorch is not importable at build time (install torch, then pip install --no-build-isolation)"
    if torch.version.cuda is None:
        return [], {}, "this PyTorch is a CPU-only build"
    if CUDA_HOME is None:
        return [], {}, "no CUDA toolkit found (set CUDA_HOME)"
    archs = os.environ.get("HYBRID_EP_CUDA_ARCHS") or _default_archs(CUDA_HOME)
    nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
    nvcc_flags += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs.split(";") if a]
    print(f"hybrid-ep: building the CUDA extension hybrid_ep._C for {archs.replace(';', ', ')}", file=sys.stderr)
    kwargs = dict(include_dirs=[os.path.abspath("csrc")], depends=_csrc_files(),
                  extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": nvcc_flags})
    nvshmem = _nvshmem_for(torch.version.cuda)
    if nvshmem is not None:
        sources = _cuda_sources(with_nvshmem=True)
        _with_nvshmem(kwargs, nvshmem)
    ext = CUDAExtension("hybrid_ep._C", sources, **kwargs)
    if nvshmem is not None:
        ext.hybrid_ep_dlink = [os.path.join(CUDA_HOME, "bin", "nvcc"), "-dlink", "-Xcompiler", "-fPIC",
                               *[f for f in nvcc_flags if f.startswith("-gencode")], f"-L{nvshmem.lib_dir}",
                               "-lnvshmem_device"]
    return [ext], {"build_ext": _device_linking(BuildExtension)}, None


def _device_linking(build_ext):
    """build_ext that device-links an extension's relocatable device code (ext.hybrid_ep_dlink,
    the nvcc -dlink command) right before its host link. torch's own device link (nvcc_dlink)
    needs ninja, which a machine may lack."""

    class BuildWithDeviceLink(build_ext):
        def build_extension(self, ext):
            dlink = getattr(ext, "hybrid_ep_dlink", None)
            if not dlink:
                return super().build_extension(ext)
            link = self.compiler.link_shared_object

            def link_with_device_code(objects, output, *args, **kwargs):
                device_code = os.path.join(self.build_temp, "hybrid_ep_dlink.o")
                subprocess.check_call([*dlink, *objects, "-o", device_code])
                return link([*objects, device_code], output, *args, **kwargs)

            self.compiler.link_shared_object = link_with_device_code
            try:
                return super().build_extension(ext)
            finally:
                self.compiler.link_shared_object = link

    return BuildWithDeviceLink


def _is_nvshmem_source(path: str) -> bool:
    """Sources of the NVSHMEM transport (csrc/**/*_nvshmem.cu, nvshmem_host.cpp, the NVSHMEM
    bindings): built only when NVSHMEM is found."""
    return "nvshmem" in os.path.basename(path)


def _cuda_sources(with_nvshmem: bool) -> list[str]:
    found = set(glob.glob("csrc/kernels/*.cu") + glob.glob("csrc/transport/*.cu") + glob.glob("csrc/transport/*.cpp")
                + glob.glob("csrc/bindings/nvshmem_*.cpp"))
    return sorted(s for s in found if with_nvshmem or not _is_nvshmem_source(s)) + ["csrc/bindings/cuda_module.cpp"]


def _load_finder():
    """scripts/find_nvshmem.py, imported by path (the package is not importable while it builds)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "find_nvshmem.py")
    spec = importlib.util.spec_from_file_location("hybrid_ep_find_nvshmem", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _nvshmem_for(torch_cuda: str):
    """NVSHMEM for this build, or None after one line that says why not and how to get it."""
    finder = _load_finder()
    found, reason = finder.find()
    if found is not None and found.cuda_major is not None and str(found.cuda_major) != torch_cuda.split(".")[0]:
        found, reason = None, f"{found.source} does not match torch's CUDA {torch_cuda}"
    if found is None:
        print(finder.not_found_line(reason), file=sys.stderr)
        return None
    print(f"hybrid-ep: building hybrid_ep._C with the inter-node transport (NVSHMEM from {found.source})",
          file=sys.stderr)
    return found


def _with_nvshmem(kwargs: dict, nvshmem) -> None:
    """Relocatable device code for every .cu, NVSHMEM's headers, and a host link against its
    libraries (the host one found at run time by rpath); the device link is _device_linking's."""
    flags = kwargs["extra_compile_args"]
    kwargs["include_dirs"] = kwargs["include_dirs"] + [nvshmem.include_dir]
    flags["cxx"] = flags["cxx"] + ["-DHYBRID_EP_WITH_NVSHMEM"]
    # NVSHMEM's device headers use the half / bfloat16 operators that torch's extension flags
    # (-D__CUDA_NO_HALF_OPERATORS__ ...) switch off; the kernels compile either way.
    no_half = ("HALF_OPERATORS", "HALF_CONVERSIONS", "BFLOAT16_CONVERSIONS", "HALF2_OPERATORS")
    flags["nvcc"] = flags["nvcc"] + ["-rdc=true", "-DHYBRID_EP_WITH_NVSHMEM"] + [f"-U__CUDA_NO_{m}__" for m in no_half]
    kwargs["extra_link_args"] = nvshmem.link_args()


def _pybind11_includes() -> list[str] | None:
    """pybind11's headers: its own package, else the copy inside PyTorch; None without either."""
    try:
        import pybind11

        return [pybind11.get_include()]
    except ImportError:
        try:
            from torch.utils.cpp_extension import include_paths
        except ImportError:
            return None
        return include_paths()


_CXX_FLAGS = ["-std=c++17", "-O2", "-fno-strict-aliasing", "-Wno-unknown-pragmas"]
# The planner runs on the training's critical path at every rebalance; -O3 plans the
# benchmark's 61 x 256 x 64 layout about 4% faster than -O2 (docs/balancer.md, planning time).
# No -ffast-math: plans must not depend on the compiler's reassociation of sums.
_PLANNER_CXX_FLAGS = [flag if flag != "-O2" else "-O3" for flag in _CXX_FLAGS]


def _planner_extension() -> Extension:
    includes = _pybind11_includes()
    if includes is None:
        raise RuntimeError("hybrid-ep: building hybrid_ep._planner needs pybind11 or PyTorch at build time "
                           "(pip install pybind11, or install torch first)")
    sources = sorted(glob.glob("csrc/balancer/*.cpp")) + ["csrc/bindings/planner_module.cpp"]
    return Extension("hybrid_ep._planner", sources,
                     include_dirs=[os.path.abspath("csrc")] + includes,
                     depends=sorted(glob.glob("csrc/balancer/*")), language="c++",
                     extra_compile_args=_PLANNER_CXX_FLAGS)


def _model_extension():
    """Return (extension or None, reason it was skipped or None)."""
    if os.environ.get("HYBRID_EP_BUILD_MODEL") != "1":
        return None, "a development build only (HYBRID_EP_BUILD_MODEL=1; scripts/env.sh sets it)"
    includes = _pybind11_includes()
    if includes is None:
        return None, "neither pybind11 nor PyTorch is importable at build time (for the pybind11 headers)"
    sources = sorted(glob.glob("csrc/device/model/*.cpp")) + ["csrc/bindings/model_module.cpp"]
    print("hybrid-ep: building the CPU model of the kernels hybrid_ep._model", file=sys.stderr)
    ext = Extension(
        "hybrid_ep._model",
        sources,
        include_dirs=[os.path.abspath("csrc")] + includes,
        depends=_csrc_files(),
        language="c++",
        extra_compile_args=_CXX_FLAGS,
    )
    return ext, None


_HOST_MODULES = ("hybrid_ep._model", "hybrid_ep._planner")  # compiled by the host compiler alone


def _host_build_digest(ext: Extension, compiler_command: list[str]) -> str:
    """What a host module's build reads: its sources and the headers it may include (every file
    under csrc/), its flags and include folders, the compiler's version, the Python it is for."""
    digest = hashlib.sha256()
    version = subprocess.run([compiler_command[0], "--version"], capture_output=True, text=True).stdout
    here = os.path.abspath(".")  # the checkout's own path does not count: a clone elsewhere builds the same
    includes = [d.replace(here, "<checkout>") for d in ext.include_dirs]
    digest.update(repr([ext.name, ext.extra_compile_args, includes, compiler_command, version, sys.version,
                        sysconfig.get_config_var("EXT_SUFFIX")]).encode())
    for path in sorted(set(ext.sources) | set(_csrc_files())):
        digest.update(path.encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:20]


def _compile_in_parallel(compiler) -> None:
    """Have the host compiler compile an extension's sources HYBRID_EP_BUILD_JOBS at a time
    (default: the CPUs), where distutils compiles them one after another: the CPU model's 20
    translation units are most of a fresh checkout's build."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    raw = os.environ.get("HYBRID_EP_BUILD_JOBS") or str(cpus)
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"HYBRID_EP_BUILD_JOBS must be a whole number >= 1, got {raw!r}")
    jobs = int(raw)

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=False, extra_preargs=None,
                extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

        def one(obj):
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one, [obj for obj in objects if obj in build]))  # absent: up to date
        return objects

    compiler.compile = compile


def _cached_host_builds(build_ext):
    """build_ext that takes the host modules from HYBRID_EP_BUILD_CACHE when their digest is
    there, and leaves each module it compiles there."""

    class CachedHostBuild(build_ext):
        def build_extension(self, ext):
            if ext.name in _HOST_MODULES:
                _compile_in_parallel(self.compiler)
            cache = os.environ.get("HYBRID_EP_BUILD_CACHE")
            if not cache or ext.name not in _HOST_MODULES:
                return super().build_extension(ext)
            target = self.get_ext_fullpath(ext.name)
            kept = os.path.join(cache, _host_build_digest(ext, list(self.compiler.compiler_so)),
                                os.path.basename(target))
            if os.path.isfile(kept):
                os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
                # A copy of its own time: the in-place copy after it skips a target that is newer
                # (setuptools' update check), which a module built since from other sources is.
                shutil.copy(kept, target)
                print(f"hybrid-ep: {ext.name} taken from the build cache ({kept}): its sources, flags and "
                      "compiler are those it was built from", file=sys.stderr)
                return None
            super().build_extension(ext)
            os.makedirs(os.path.dirname(kept), exist_ok=True)
            partial = f"{kept}.{os.getpid()}.partial"
            shutil.copy2(target, partial)
            os.replace(partial, kept)
            return None

    return CachedHostBuild


ext_modules, cmdclass, skipped = _cuda_extension()
cmdclass = {**cmdclass, "build_ext": _cached_host_builds(cmdclass.get("build_ext", _setuptools_build_ext))}
if skipped:
    print(f"hybrid-ep: building without the CUDA extension hybrid_ep._C: {skipped}", file=sys.stderr)
model_ext, model_skipped = _model_extension()
if model_ext is not None:
    ext_modules = ext_modules + [model_ext]
else:
    print(f"hybrid-ep: building without the CPU model hybrid_ep._model: {model_skipped}", file=sys.stderr)
if os.environ.get("HYBRID_EP_SKIP_PLANNER_BUILD") == "1":  # scripts/model_mutations.py: the checkout's is copied
    print("hybrid-ep: building without the balancer's planner hybrid_ep._planner: HYBRID_EP_SKIP_PLANNER_BUILD=1",
          file=sys.stderr)
else:
    ext_modules = ext_modules + [_planner_extension()]

setup(ext_modules=ext_modules, cmdclass=cmdclass)
