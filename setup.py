"""hybrid-ep: hierarchical expert-parallel dispatch/combine for Megatron-Core MoE training.

The CUDA extension hybrid_ep._C is compiled ahead of time here when csrc/ has sources and a
CUDA toolkit plus a CUDA build of PyTorch are present; otherwise the package installs as
pure Python (reference backend) and one line says why.
"""

import glob
import os
import sys

from setuptools import find_packages, setup


def _cuda_extension():
    """Return (ext_modules, cmdclass, reason it was skipped or None)."""
    if os.environ.get("HYBRID_EP_SKIP_CUDA_BUILD") == "1":
        return [], {}, "HYBRID_EP_SKIP_CUDA_BUILD=1"
    sources = sorted(glob.glob("csrc/**/*.cu", recursive=True) + glob.glob("csrc/**/*.cpp", recursive=True))
    if not sources:
        return [], {}, "csrc/ has no CUDA sources yet"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}, "PyTorch is not importable at build time (install torch, then pip install --no-build-isolation)"
    if torch.version.cuda is None:
        return [], {}, "this PyTorch is a CPU-only build"
    if CUDA_HOME is None:
        return [], {}, "no CUDA toolkit found (set CUDA_HOME)"
    archs = os.environ.get("HYBRID_EP_CUDA_ARCHS", "90a")
    nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]
    nvcc_flags += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs.split(";") if a]
    ext = CUDAExtension(
        "hybrid_ep._C",
        sources,
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": nvcc_flags},
    )
    return [ext], {"build_ext": BuildExtension}, None


ext_modules, cmdclass, skipped = _cuda_extension()
if skipped:
    print(f"hybrid-ep: building without the CUDA extension hybrid_ep._C: {skipped}", file=sys.stderr)

setup(
    name="hybrid-ep",
    version="0.1.0",
    description="Hierarchical NVLink + RDMA expert-parallel dispatch/combine for Megatron-Core MoE training",
    long_description=open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hybrid_ep", "hybrid_ep.*", "megatron_patches", "megatron_patches.*"]),
    install_requires=["torch>=2.6", "numpy", "matplotlib"],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout"],
        "megatron": ["megatron-core>=0.16"],
        "wandb": ["wandb"],
    },
    entry_points={
        "console_scripts": [
            "hybrid-ep-bench=hybrid_ep.bench.cli:main",
            "hybrid-ep-traffic=hybrid_ep.traffic.cli:main",
        ]
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
