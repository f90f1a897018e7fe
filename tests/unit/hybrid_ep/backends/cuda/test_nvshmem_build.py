"""NVSHMEM without a GPU: how the build finds it (wheel, NVSHMEM_HOME, the one line without it),
that the transport's self-test links against the wheel's libraries, and the logic of
hybrid_ep/backends/cuda/nvshmem.py with a fake extension and a fake process group (unique id
from the group's rank 0, one initialisation per process, heap size exported before it, errors)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, built_cuda_extension
from hybrid_ep.backends.cuda import nvshmem
from hybrid_ep.memory import MemoryPlan

pytestmark = pytest.mark.unit

MIB = 1 << 20


def _finder():
    spec = importlib.util.spec_from_file_location("find_nvshmem_under_test", Path(REPO, "scripts", "find_nvshmem.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


finder = _finder()


def _wheel_version() -> str | None:
    major = (torch.version.cuda or "").split(".")[0]
    try:
        return importlib.metadata.version(f"nvidia-nvshmem-cu{major}") if major else None
    except importlib.metadata.PackageNotFoundError:
        return None


def _fake_home(root: Path, host_libs=("libnvshmem_host.so.3",)) -> Path:
    (root / "include").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "include" / "nvshmem.h").write_text("// header\n")
    (root / "lib" / "libnvshmem_device.a").write_bytes(b"!<arch>\n")
    for name in host_libs:
        (root / "lib" / name).write_bytes(b"")
    return root


# ---- finding NVSHMEM -------------------------------------------------------------------------

@pytest.mark.skipif(_wheel_version() is None, reason="no nvidia-nvshmem wheel matching torch's CUDA")
def test_the_wheel_is_found_with_its_headers_and_libraries():
    found, reason = finder.find(environ={})
    assert found is not None, reason
    major = int(torch.version.cuda.split(".")[0])
    assert found.source == f"nvidia-nvshmem-cu{major} {_wheel_version()}" and found.cuda_major == major
    assert (Path(found.include_dir) / "nvshmem.h").exists() and (Path(found.include_dir) / "nvshmemx.h").exists()
    assert found.host_lib.startswith("libnvshmem_host.so") and (Path(found.lib_dir) / found.host_lib).exists()
    assert Path(found.device_lib) == Path(found.lib_dir) / "libnvshmem_device.a" and Path(found.device_lib).exists()
    assert found.link_args() == [f"-L{found.lib_dir}", "-l:libnvshmem_device.a",
                                 "-Wl,--exclude-libs,libnvshmem_device.a", f"-l:{found.host_lib}",
                                 f"-Wl,-rpath,{found.lib_dir}"]


def test_nvshmem_home_wins_and_names_the_host_library_it_has(tmp_path):
    home = _fake_home(tmp_path / "a", ("libnvshmem_host.so.2", "libnvshmem_host.so.3"))
    found, _ = finder.find(environ={"NVSHMEM_HOME": str(home)})
    assert (found.source, found.include_dir, found.host_lib) == ("NVSHMEM_HOME", str(home / "include"),
                                                                 "libnvshmem_host.so.3")
    assert found.cuda_major is None
    (home / "lib" / "libnvshmem_host.so").write_bytes(b"")
    assert finder.find(environ={"NVSHMEM_HOME": str(home)})[0].host_lib == "libnvshmem_host.so"


def test_a_broken_nvshmem_home_is_not_replaced_by_the_wheel(tmp_path):
    home = tmp_path / "empty"
    (home / "lib").mkdir(parents=True)
    found, reason = finder.find(environ={"NVSHMEM_HOME": str(home)})
    assert found is None
    assert reason == (f"NVSHMEM_HOME at {home} has no {home}/include/nvshmem.h, {home}/lib/libnvshmem_device.a, "
                      f"{home}/lib/libnvshmem_host.so*")


def test_without_wheel_or_home_the_reason_and_the_one_line(monkeypatch):
    monkeypatch.setattr(finder, "_wheel", lambda: None)
    found, reason = finder.find(environ={})
    assert found is None and reason == "no nvidia-nvshmem-cu12/cu13 wheel is installed and NVSHMEM_HOME is not set"
    line = finder.not_found_line(reason)
    assert "\n" not in line
    assert line.startswith("hybrid-ep: building hybrid_ep._C without the inter-node transport (NVSHMEM): no ")
    assert "pip install nvidia-nvshmem-cu13" in line and "set NVSHMEM_HOME" in line


def _setup_lines(env_extra: dict[str, str]) -> list[str]:
    env = {**os.environ, **env_extra}
    for name in ("HYBRID_EP_SKIP_CUDA_BUILD", "HYBRID_EP_BUILD_MODEL"):  # the CUDA extension's lines, no CPU model
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hybrid-ep:")]
    if any("building without the CUDA extension" in line for line in lines):
        pytest.skip("no CUDA toolkit or CUDA build of torch here: setup.py does not reach NVSHMEM")
    return lines


@pytest.mark.slow  # the full tier (scripts/test.sh --full): two setup.py runs
def test_setup_prints_one_line_without_nvshmem_and_one_with_it(tmp_path):
    missing = tmp_path / "no_nvshmem"
    lines = [line for line in _setup_lines({"NVSHMEM_HOME": str(missing)}) if "NVSHMEM" in line]
    assert lines == [finder.not_found_line(finder.find(environ={"NVSHMEM_HOME": str(missing)})[1])]
    home = _fake_home(tmp_path / "home")
    lines = [line for line in _setup_lines({"NVSHMEM_HOME": str(home)}) if "NVSHMEM" in line]
    assert lines == ["hybrid-ep: building hybrid_ep._C with the inter-node transport (NVSHMEM from NVSHMEM_HOME)"]


# ---- it compiles and links ------------------------------------------------------------------

@pytest.mark.slow  # the full tier (scripts/test.sh --full): compile_csrc.sh links it too
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.skipif(_wheel_version() is None, reason="no nvidia-nvshmem wheel matching torch's CUDA")
def test_the_selftest_links_into_a_shared_object_against_the_wheel(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "HYBRID_EP_CUDA_ARCHS": "90a"}
    env.pop("NVSHMEM_HOME", None)
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "compile_csrc.sh"), "--nvshmem-link", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    so = tmp_path / "libhybrid_ep_nvshmem_check.so"
    found, _ = finder.find(environ={})
    dynamic = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    assert "Shared library: [libnvshmem_host.so.3]" in dynamic
    assert found.lib_dir in dynamic  # rpath to the wheel's libraries
    symbols = subprocess.run(["nm", "-C", "--defined-only", str(so)], capture_output=True, text=True,
                             check=True).stdout
    for name in ("hybrid_ep::nvshmem_selftest::run(", "hybrid_ep::nvshmem_host::init(int, int",
                 "nvshmemi_init_thread("):  # the last from libnvshmem_device.a's host objects
        assert name in symbols, name
    # ... kept private: PyTorch's libtorch_nvshmem exports the same names for its own device state
    exported = subprocess.run(["nm", "-D", "-C", "--defined-only", str(so)], capture_output=True, text=True,
                              check=True).stdout
    assert "hybrid_ep::nvshmem_selftest::run(" in exported and "nvshmemi_init_thread(" not in exported


@pytest.mark.skipif(_wheel_version() is None, reason="no nvidia-nvshmem wheel matching torch's CUDA")
def test_the_built_extension_imports_with_the_transport():
    """What runs without a GPU once built: the module loads libnvshmem_host through its rpath,
    NVSHMEM makes a unique id, and calls that need an initialised NVSHMEM say so."""
    ext = built_cuda_extension()

    assert ext.has_nvshmem() and ext.nvshmem_init_status() == 0
    uid = ext.nvshmem_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(RuntimeError, match="nvshmem_my_pe before NVSHMEM was initialised"):
        ext.nvshmem_my_pe()
    with pytest.raises(ValueError, match="an NVSHMEM unique id has 128 bytes, got 3"):
        ext.nvshmem_init(0, 2, b"abc")
    assert ext.nvshmem_selftest_region_bytes(1 << 20) == 128 + (2 << 20)


# ---- nvshmem.py with a fake extension and a fake group ------------------------------------

class FakeExt:
    """hybrid_ep._C's NVSHMEM functions, recording calls; the unique id is 128 random bytes."""

    def __init__(self, built=True, init_error=None, pe_shift=0, malloc_ok=True):
        self.built, self.init_error, self.pe_shift, self.malloc_ok = built, init_error, pe_shift, malloc_ok
        self.calls: list[tuple] = []
        self.uid = os.urandom(128)
        self.rank = self.n = None
        self.next_ptr = 0x7F0000000000

    def has_nvshmem(self):
        return self.built

    def nvshmem_unique_id(self):
        self.calls.append(("unique_id",))
        return self.uid

    def nvshmem_init(self, rank, n, uid):
        self.calls.append(("init", rank, n, uid, os.environ.get(nvshmem.HEAP_ENV)))
        if self.init_error:
            raise RuntimeError(self.init_error)
        self.rank, self.n = rank, n

    def nvshmem_init_status(self):
        return 0 if self.rank is None else 3

    def nvshmem_my_pe(self):
        return self.rank + self.pe_shift

    def nvshmem_n_pes(self):
        return self.n

    def nvshmem_malloc(self, nbytes):
        self.calls.append(("malloc", nbytes))
        if not self.malloc_ok:
            return 0
        ptr, self.next_ptr = self.next_ptr, self.next_ptr + nbytes
        return ptr

    def nvshmem_free(self, ptr):
        self.calls.append(("free", ptr))

    def nvshmem_finalize(self):
        self.calls.append(("finalize",))


class FakeDist:
    """torch.distributed as seen by one rank of a group whose ranks are the global ranks
    `members`; ranks run one after the other and share `board` (what a broadcast delivers)."""

    def __init__(self, rank, members, board):
        self.rank, self.members, self.board = rank, members, board
        self.calls: list[tuple] = []

    def get_rank(self, group):
        return self.rank

    def get_world_size(self, group):
        return len(self.members)

    def get_global_rank(self, group, rank):
        return self.members[rank]

    def broadcast_object_list(self, objs, src, group=None):
        self.calls.append(("broadcast", src, group))
        if self.members[self.rank] == src:
            self.board["broadcast"] = list(objs)
        else:
            objs[:] = self.board["broadcast"]

    def all_gather_object(self, out, obj, group=None):
        self.board.setdefault("gathered", {})[self.rank] = obj
        out[:] = [self.board["gathered"].get(r) for r in range(len(out))]


@pytest.fixture
def fresh(monkeypatch):
    """A process with no NVSHMEM session yet and no NVSHMEM_SYMMETRIC_SIZE."""
    monkeypatch.setattr(nvshmem, "_session", None)
    monkeypatch.setattr(nvshmem, "_finalized", False)
    monkeypatch.setenv(nvshmem.HEAP_ENV, "unset-by-the-fixture")
    monkeypatch.delenv(nvshmem.HEAP_ENV)

    def new_process():
        nvshmem._session, nvshmem._finalized = None, False
        os.environ.pop(nvshmem.HEAP_ENV, None)

    return new_process


def test_heap_size_rounds_the_region_plus_nvshmem_reserve_up_to_2_mib():
    assert nvshmem.symmetric_heap_bytes(0) == 32 * MIB
    assert nvshmem.symmetric_heap_bytes(1) == 34 * MIB
    assert nvshmem.symmetric_heap_bytes(2 * MIB) == 34 * MIB
    assert nvshmem.symmetric_heap_bytes(1000 * MIB + 5) == 1034 * MIB
    with pytest.raises(ValueError, match="region_bytes must be >= 0"):
        nvshmem.symmetric_heap_bytes(-1)
    with pytest.raises(TypeError, match="region_bytes must be an int"):
        nvshmem.symmetric_heap_bytes(1.5)
    spec = nvshmem.heap_spec(100 * MIB)
    assert (spec.name, spec.nbytes, spec.registered) == ("nvshmem_heap", 132 * MIB, True)
    assert "nvshmem_heap" in str(MemoryPlan("cuda", (spec,))) and "132.00 MiB" in str(MemoryPlan("cuda", (spec,)))


def test_parse_size_reads_nvshmem_size_syntax():
    assert [nvshmem.parse_size(t) for t in ("1048576", "1K", "2m", "1G", "1GB", " 3 MiB", "3.1M", ".5m")] == [
        MIB, 1024, 2 * MIB, 1 << 30, 1 << 30, 3 * MIB, 3250586, MIB // 2]
    with pytest.raises(ValueError, match="NVSHMEM_SYMMETRIC_SIZE must be a byte count"):
        nvshmem.parse_size("lots")


def test_unique_id_goes_from_group_rank_0_to_the_others_and_heap_is_exported_before_init(fresh):
    board: dict = {}
    members = [4, 5, 6]  # the EP group holds global ranks 4..6
    exts = [FakeExt() for _ in members]
    region = 100 * MIB
    for rank, ext in enumerate(exts):
        fresh()
        dist = FakeDist(rank, members, board)
        s = nvshmem.initialize("ep-group", region, ext=ext, dist=dist)
        assert (s.pe, s.n_pes, s.heap_bytes) == (rank, 3, 132 * MIB)
        assert dist.calls == [("broadcast", 4, "ep-group")]
    assert exts[0].calls[0] == ("unique_id",)
    assert all(("unique_id",) not in e.calls for e in exts[1:])
    heap = str(132 * MIB)
    assert [e.calls[-1] for e in exts] == [("init", r, 3, exts[0].uid, heap) for r in range(3)]


def test_initialised_once_per_process(fresh):
    ext, dist = FakeExt(), FakeDist(0, [0, 1], {})
    first = nvshmem.initialize(None, 10 * MIB, ext=ext, dist=dist)
    again = nvshmem.initialize(None, 8 * MIB, ext=ext, dist=dist)
    assert again is first and nvshmem.session() is first
    assert [c[0] for c in ext.calls] == ["unique_id", "init"] and len(dist.calls) == 1
    assert first.status == "initialised, limited support of several PEs per GPU (no MPS)"
    with pytest.raises(nvshmem.NvshmemHeapTooSmall, match=r"initialised once per process.*at least 169869312"):
        nvshmem.initialize(None, 130 * MIB, ext=ext, dist=dist)


def test_a_user_heap_size_is_kept_when_large_enough_and_refused_before_init_when_not(fresh, monkeypatch):
    monkeypatch.setenv(nvshmem.HEAP_ENV, "1G")
    ext = FakeExt()
    assert nvshmem.initialize(None, 10 * MIB, ext=ext, dist=FakeDist(0, [0], {})).heap_bytes == 1 << 30
    assert ext.calls[-1][-1] == "1G"
    fresh()
    monkeypatch.setenv(nvshmem.HEAP_ENV, "64M")
    ext = FakeExt()
    with pytest.raises(nvshmem.NvshmemHeapTooSmall, match=r"NVSHMEM_SYMMETRIC_SIZE=64M \(67108864 bytes\) is "
                                                          r"smaller than the 71303168 bytes"):
        nvshmem.initialize(None, 36 * MIB, ext=ext, dist=FakeDist(0, [0], {}))
    assert ext.calls == []


def test_errors_say_what_is_missing_and_what_to_do(fresh):
    with pytest.raises(nvshmem.NvshmemNotBuilt, match=r"built without NVSHMEM.*pip install nvidia-nvshmem-cu13.*"
                                                      r"NVSHMEM_HOME.*rebuild"):
        nvshmem.initialize(None, 0, ext=FakeExt(built=False), dist=FakeDist(0, [0], {}))
    with pytest.raises(nvshmem.NvshmemNotBuilt):
        nvshmem.require_built(object())  # an extension without has_nvshmem (the CPU model)
    board: dict = {}
    nvshmem.initialize(None, 0, ext=FakeExt(), dist=FakeDist(0, [0, 1], board))
    fresh()
    failing = FakeExt(init_error="hybrid_ep: nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID) failed with status 7")
    with pytest.raises(nvshmem.NvshmemInitError, match=r"failed on rank 1 of 2 .*status 7.*NVSHMEM_DEBUG=INFO"):
        nvshmem.initialize(None, 0, ext=failing, dist=FakeDist(1, [0, 1], board))
    assert nvshmem.session() is None
    with pytest.raises(nvshmem.NvshmemInitError, match="made rank 1 of 2 PE 2 of 2"):
        nvshmem.initialize(None, 0, ext=FakeExt(pe_shift=1), dist=FakeDist(1, [0, 1], board))


def test_allocations_are_counted_against_the_heap(fresh):
    with pytest.raises(nvshmem.NvshmemError, match="not initialised in this process"):
        nvshmem.allocate(MIB)
    ext = FakeExt()
    nvshmem.initialize(None, 8 * MIB, ext=ext, dist=FakeDist(0, [0], {}))  # heap 40 MiB, 8 usable
    a = nvshmem.allocate(6 * MIB)
    assert a.nbytes == 6 * MIB and a.ptr == 0x7F0000000000 and nvshmem.session().allocated == 6 * MIB
    with pytest.raises(nvshmem.NvshmemHeapTooSmall, match=r"41943040 bytes, 6291456 allocated; 4194304 more"):
        nvshmem.allocate(4 * MIB)
    assert ("malloc", 4 * MIB) not in ext.calls  # refused before the collective call
    nvshmem.free(a)
    assert nvshmem.session().allocated == 0 and ext.calls[-1] == ("free", a.ptr)
    ext.malloc_ok = False
    with pytest.raises(nvshmem.NvshmemHeapTooSmall, match=r"nvshmem_malloc\(1048576\) found no room"):
        nvshmem.allocate(MIB)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        nvshmem.allocate(-5)


def test_pe_table_and_finalize(fresh):
    board: dict = {}
    for rank in (0, 1):
        fresh()
        nvshmem.initialize(None, 0, ext=FakeExt(), dist=FakeDist(rank, [0, 1], board))
        table = nvshmem.pe_table(None, dist=FakeDist(rank, [0, 1], board))
    assert table == [0, 1]
    ext = nvshmem.session().ext
    nvshmem.finalize()
    assert ext.calls[-1] == ("finalize",) and nvshmem.session() is None
    with pytest.raises(nvshmem.NvshmemInitError, match="finalised in this process and cannot be initialised again"):
        nvshmem.initialize(None, 0, ext=FakeExt(), dist=FakeDist(0, [0], {}))


def test_memory_plan_prints_the_symmetric_heap_of_a_group_that_spans_nodes():
    from hybrid_ep.backends.cuda.backend import memory_plan
    from hybrid_ep.backends.cuda.layout import rdma_layout
    from hybrid_ep.config import BufferConfig

    two_nodes = BufferConfig(7168, 512, 32, 16, 8).validate()
    region = rdma_layout(two_nodes).total
    assert region > 0
    plan = memory_plan(two_nodes)
    assert plan.as_dict()["nvshmem_heap"] == nvshmem.symmetric_heap_bytes(region)
    assert f"nvshmem_heap     {nvshmem.symmetric_heap_bytes(region) / MIB:12.2f} MiB  registered" in str(plan)
    assert "nvshmem_heap" not in memory_plan(BufferConfig(7168, 512, 32, 8, 8).validate()).as_dict()
