"""The kernels of an older commit on today's CPU model, for calibration.

The GPU measurements belong to the commits that ran them (tools/timing/points.json),
and the timing model lives in today's device layer. `build_commit` extracts the commit's tree
(`git archive`) into a scratch folder, puts today's device layer (csrc/device/) and the model's
bindings over it, and builds hybrid_ep._model there in place; `run_in_build` runs a job of
driver.py with that folder's package on PYTHONPATH. A build is reused while the device layer
it was made with is unchanged.

The hot loops' plain loads and stores are costed where the kernels name them through the device
layer's accessors (dev::ld, dev::st, dev::chain): a commit older than those accessors runs
without its plain code costed. Where a commit's kernels ran plain code that today's kernels
name and its own sources did not, the build names it the same way (ANNOTATIONS): the text is
the commit's, with the name put around or beside it, which is the same code on the GPU (dev::ld
is a plain load there, dev::plain_code nothing), so the model times what ran.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_WORK = os.path.join(os.path.expanduser("~"), ".cache", "hybrid-ep", "timing-builds")
# Today's files put over the old tree: the device layer (with the timing model) and the binding
# that exposes it. The kernels, transports, host code and Python package stay the commit's,
# and so do the model's kernel_*.cpp, which name the commit's kernel sources.
OVERLAY = ("csrc/device", "csrc/bindings/model_module.cpp")
KEEP = "csrc/device/model/kernel_"


def _overlay_files(repo: str) -> list[str]:
    """The overlaid files, relative to the repository."""
    out = []
    for top in OVERLAY:
        path = os.path.join(repo, top)
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
        out += [os.path.relpath(f, repo) for f in files if not os.path.relpath(f, repo).startswith(KEEP)]
    return out
DRIVER = os.path.join(os.path.dirname(__file__), "driver.py")


@dataclasses.dataclass(frozen=True)
class Annotation:
    """Plain code of a commit's kernels named for the timing model: in `path`, the text `old`
    (found once) becomes `new`; `seen_in` names commits whose file holds `old`."""

    name: str
    path: str
    old: str
    new: str
    seen_in: tuple[str, ...]


_BOUNDED = "    dev::plain_code(dev::PlainRun{dev::PlainCode::kBoundedVector, rounds});\n"
ANNOTATIONS = (
    # 8568e22's own_table read each fp8 scale of a route with a plain load and stored it at once:
    # the store waits for the load (ncu on the H200, 2026-11-27: a sector loaded and one stored
    # per scale and route). Today's route_scales reads them through dev::ld.
    Annotation("fp8 scale loads", "csrc/kernels/dispatch_direct.cuh",
               "p * d.scale_cols + i, x_scales[t * d.scale_cols + i]);",
               "p * d.scale_cols + i, dev::ld(&x_scales[t * d.scale_cols + i]));",
               ("8568e22",)),
    # SegmentAcc's bounded loop (a part narrower than the straight block: before d653338 every
    # part under 8192 columns, since then under 7 vectors a thread): a uniform branch around each
    # vector's load and around its add, which no accessor shows (dev::PlainCode::kBoundedVector).
    Annotation("bounded loop's vectors", "csrc/kernels/segments.cuh",
               "    const int whole = cols / kCols, rounds = (whole + kGroupThreads - 1) / kGroupThreads;\n"
               "#pragma unroll\n"
               "    for (int i = 0; i < kVecs; ++i)\n"
               "      if (i < rounds) V::load(",
               "    const int whole = cols / kCols, rounds = (whole + kGroupThreads - 1) / kGroupThreads;\n"
               + _BOUNDED +
               "#pragma unroll\n"
               "    for (int i = 0; i < kVecs; ++i)\n"
               "      if (i < rounds) V::load(",
               ("8568e22",)),
    Annotation("bounded loop's vectors (reducer warps R)", "csrc/kernels/segments.cuh",
               "    const int rounds = (whole + kThreads - 1) / kThreads;\n"
               "#pragma unroll\n"
               "    for (int i = 0; i < kVecs; ++i)\n"
               "      if (i < rounds) V::load(",
               "    const int rounds = (whole + kThreads - 1) / kThreads;\n"
               + _BOUNDED +
               "#pragma unroll\n"
               "    for (int i = 0; i < kVecs; ++i)\n"
               "      if (i < rounds) V::load(",
               ("1ab8f84",)),
)


def annotate(folder: str, annotations=ANNOTATIONS) -> list[str]:
    """Applies each annotation whose text the tree in `folder` holds; returns their names. A text
    found more than once is an error (the annotation would be ambiguous)."""
    applied = []
    for a in annotations:
        path = os.path.join(folder, a.path)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            text = f.read()
        found = text.count(a.old)
        if found == 0:
            continue
        if found > 1:
            raise ValueError(f"annotation {a.name!r}: its text occurs {found} times in {a.path}")
        with open(path, "w") as f:
            f.write(text.replace(a.old, a.new))
        applied.append(a.name)
    return applied


def overlay_digest(repo: str = REPO) -> str:
    """A hash of the overlaid files' contents and of the annotations: a build made with other
    contents is redone."""
    h = hashlib.sha256()
    for rel in _overlay_files(repo):
        h.update(rel.encode())
        with open(os.path.join(repo, rel), "rb") as fh:
            h.update(fh.read())
    h.update(repr(ANNOTATIONS).encode())
    return h.hexdigest()[:16]


def annotations_of(folder: str) -> list[str]:
    """The annotations a build applied (build_commit records them)."""
    try:
        with open(os.path.join(folder, ".timing-annotations")) as f:
            return json.load(f)
    except OSError:
        return []


def resolve_commit(commit: str, repo: str = REPO) -> str:
    out = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=repo, capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise ValueError(f"{commit!r} is not a commit of {repo}: {out.stderr.strip()}")
    return out.stdout.strip()


def build_commit(commit: str, work: str = DEFAULT_WORK, repo: str = REPO, log=sys.stderr) -> str:
    """The folder holding `commit`'s tree with today's device layer and its built model."""
    full = resolve_commit(commit, repo)
    folder = os.path.join(work, full[:12])
    stamp = os.path.join(folder, ".timing-build")
    digest = overlay_digest(repo)
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read().strip() == digest:
                return folder
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    archive = subprocess.run(["git", "archive", full], cwd=repo, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    for d, _, fs in os.walk(os.path.join(folder, "csrc", "device")):
        for f in fs:
            if not os.path.relpath(os.path.join(d, f), folder).startswith(KEEP):
                os.unlink(os.path.join(d, f))
    for rel in _overlay_files(repo):
        os.makedirs(os.path.dirname(os.path.join(folder, rel)), exist_ok=True)
        shutil.copy2(os.path.join(repo, rel), os.path.join(folder, rel))
    applied = annotate(folder)
    with open(os.path.join(folder, ".timing-annotations"), "w") as f:
        json.dump(applied, f)
    print(f"timing: building the model of {full[:12]} with today's device layer in {folder}"
          + (f" (annotated: {', '.join(applied)})" if applied else ""), file=log, flush=True)
    env = dict(os.environ, HYBRID_EP_SKIP_CUDA_BUILD="1")
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=folder, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the model of {full[:12]} did not build:\n{done.stderr[-4000:]}")
    with open(stamp, "w") as f:
        f.write(digest + "\n")
    return folder


def run_in_build(folder: str, job: dict, environ: dict | None = None) -> dict:
    """driver.py's result for `job`, run with the build's package first on sys.path and the
    variables of `environ` set (HYBRID_EP_DATA_PATH picks the data path of the point measured)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
        path = f.name
    try:
        env = dict(os.environ, PYTHONPATH=folder, **(environ or {}))
        done = subprocess.run([sys.executable, DRIVER, path], cwd=folder, env=env, capture_output=True, text=True)
    finally:
        os.unlink(path)
    if done.returncode != 0:
        raise RuntimeError(f"the job {job} failed in {folder}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)
