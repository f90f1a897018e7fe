"""One vocabulary for the kernels, as tests/unit/hybrid_ep/backends/cuda/test_layout_constants.py
keeps csrc's sizes in one home: the kernels are named by what they do and the path they serve
(count, dispatch_receive, dispatch_direct, combine_receive, combine_direct), "layout" names memory
offsets only, the SM count is num_sms from the API to the launch, the buffer's call counter is the
call (docs/architecture.md's glossary; it was the epoch) and the direct path's combine is the
direct combine on the launch side too (it was the pull combine). The names they had before are
gone from csrc/ and hybrid_ep/, so they do not come back."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit

ROOTS = [Path(REPO) / "csrc", Path(REPO) / "hybrid_ep"]
SUFFIXES = {".cu", ".cuh", ".h", ".cpp", ".py"}
KERNEL_FILES = {"count.cuh", "count.cu", "dispatch_receive.cuh", "dispatch_receive.cu", "dispatch_direct.cuh",
                "combine_receive.cuh", "combine_receive.cu", "combine_direct.cuh", "direct.cu"}

# Each old name (a regular expression), and what it is now.
OLD_NAMES = {
    r"\blayout_kernel\b|\blayout_impl\b|\blaunch_layout\w*|\bLayoutShared\b|\blayout_(?:smem_bytes|max_blocks_per_sm)\b"
    r"|\bkLayout(?:Tile|Route|RoutePair|Dest|Node|ScanColumn)\b|\blayout_\w+_instructions\b|\blayout_read\b"
    r"|\bkPrepareThreads\b|\b(?:after|before)_layout\b|\bdispatch_layout\b|[Ll]ayout kernel|kernels/layout\.cuh?\b":
        "the count kernel (kernels/count.cuh: count_kernel, launch_count, info_read, after_count)",
    r"\bdispatch_(?:kernel|impl|smem_bytes|max_blocks_per_sm)\b|\blaunch_dispatch(?:_nvshmem|_with)?\b"
    r"|kernels/dispatch\.cuh?\b":
        "the receive path's dispatch (kernels/dispatch_receive.cuh: dispatch_receive_kernel)",
    r"\bcombine_(?:kernel|impl|smem_bytes|stage_bytes|max_blocks_per_sm)\b"
    r"|\blaunch_combine(?:_nvshmem|_with|_typed)?\b|kernels/combine\.cuh?\b":
        "the receive path's combine (kernels/combine_receive.cuh: combine_receive_kernel)",
    r"\bcombine_pull\w*|\bCombinePull\b|\bkPullThreads\b|[Cc]ombine[- ]pull\b":
        "the direct path's combine (kernels/combine_direct.cuh: combine_direct_kernel)",
    r"\bblocks_per_rank\b": "num_sms (LaunchArgs::num_sms, one block per SM)",
    r"\w+_epoch\b|\w*EPOCH\w*|(?:\.|->)epoch\b|[\"']epoch[\"']|call's epoch\b":
        "the call (the buffer's call counter: LocalState::dispatch_calls / combine_calls, count_call, "
        "ErrorRecord::call, ERROR_RECORD_CALL_OFFSET, the kernels' d.call)",
    r"\bPull[A-Z]\w*|\bpull_\w+|\bPULL_\w+|\bkPull\w*|\b[Pp]ull (?:combine|stages?)\b":
        "the direct combine (DirectCombineShape, direct_combine_shape, DIRECT_COMBINE_PIPELINES, "
        "kDirectCombinePipelines, HYBRID_EP_DIRECT_COMBINE_STAGES)",
}


def _sources() -> list[Path]:
    return sorted(p for root in ROOTS for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file())


def test_no_old_kernel_name_in_csrc_or_the_package():
    pattern = re.compile("|".join(f"(?:{p})" for p in OLD_NAMES))
    found = []
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = pattern.search(line)
            if m:
                now = next(what for p, what in OLD_NAMES.items() if re.search(p, m.group(0)))
                found.append(f"{path.relative_to(REPO)}:{n}: {m.group(0)} (now: {now})")
    assert found == []


def test_each_kernel_file_is_named_for_its_kernel():
    kernels = Path(REPO) / "csrc" / "kernels"
    launched = set()
    for path in sorted(kernels.glob("*.cuh")):
        for name in re.findall(r"__global__ void __launch_bounds__\([^)]*\)\s+(\w+)_kernel\b", path.read_text()):
            assert path.name == f"{name}.cuh", f"{name}_kernel lives in {path.name}"
            launched.add(name)
    assert launched == {"count", "dispatch_receive", "dispatch_direct", "combine_receive", "combine_direct"}
    assert KERNEL_FILES <= {p.name for p in kernels.iterdir()}


def test_the_pattern_finds_each_old_name():
    """The grep above would see each old name where it stood (a test that cannot fail proves nothing)."""
    lines = ["layout_kernel<Rdma>", "launch_layout_nvshmem(args, s)", "#include \"kernels/dispatch.cuh\"",
             "combine_kernel<Rdma, Elem, Wire>", "combine_pull_stage_bytes(args)", "args.blocks_per_rank",
             "the layout kernel's count rows", "a.layout_read = 1",
             "sh.epoch = view.state()->dispatch_epoch + 1;", "st->combine_epoch = d.epoch;", "rec->epoch = 0;",
             "m.attr(\"ERROR_RECORD_EPOCH_OFFSET\")", "self._bad_route_epoch.value", "rec[\"epoch\"]",
             "signals with the call's epoch", "class PullShape:", "launch.pull_shape(cols, 2, smem)",
             "constexpr int kPullPipelines = 2;", "compiled.PULL_PIPELINES", "launch.PULL_STAGES_ENV",
             "s.pull_stages_override", "the pull combine's rings", "fewer than 2 pull stages"]
    for line in lines:
        assert any(re.search(p, line) for p in OLD_NAMES), line
    for line in ["RegLayout reg", "const InfoLayout& il", "call.layout.info", "launch_dispatch_direct(a, s)",
                 "dispatch_receive_kernel", "combine_direct_kernel", "num_sms",
                 "if (++epoch_ == 0) std::fill(done_.begin(), done_.end(), 0), epoch_ = 1;",  # the refit's own
                 "sh.call = view.state()->dispatch_calls + 1;", "PeerRing::tag(d.call, it.chunk)",
                 "ERROR_RECORD_CALL_OFFSET", "DirectCombineShape", "launch.direct_combine_shape(cols, 2, smem)",
                 "kDirectCombinePipelines", 'OLD_DIRECT_COMBINE_STAGES_ENV = "HYBRID_EP_PULL_STAGES"']:
        assert not any(re.search(p, line) for p in OLD_NAMES), line
