"""The CPU model of the device layer (hybrid_ep._model) catches what the hardware punishes.

Each self-test kernel (csrc/device/model/selftest.cpp) breaks one rule of the device layer
and must stop the launch with a message that names the rule, the kernel, the thread and
the source line; a clean one must pass and move its bytes. The model is built by setup.py
with the host compiler alone, so these run on every machine.
"""

from __future__ import annotations

import importlib
import random
import re
import struct

import pytest
import torch

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

AT = r"CPU model: run_selftest kernel, block 0 of 1, thread \d+ \(warp \d+, lane \d+\): "
CAUGHT = {
    "misaligned_bulk": AT + r"bulk load \(selftest\.cpp:\d+\) of 64 bytes: addresses must be 16-byte aligned",
    "bulk_size": AT + r"bulk load \(selftest\.cpp:\d+\) of 24 bytes: the size must be a positive multiple of 16",
    "bulk_past_smem": AT + r"bulk load .* into dynamic shared memory \+ 224: past the block's shared memory",
    "bulk_outside_global": AT + r"bulk store .* not inside one declared allocation",
    "tx_too_many": AT + r"the mbarrier at static shared memory \+ 0 received 32 transaction bytes more than its "
                        r"phase 0 expected",
    "tx_too_few": AT + r"the block exits with the mbarrier at static shared memory \+ 0 owed 32 transaction bytes",
    "double_wait": AT + r"waits a second time \(selftest\.cpp:\d+\) on phase 0 of the mbarrier .* stale parity",
    "exit_with_load_in_flight": AT + r"the block exits while a bulk load issued at selftest\.cpp:\d+ by thread 0 "
                                     r"still writes its shared memory",
    "syncwarp_lane_exits": AT + r"(exits while lanes \{[\d,]+\} of its warp wait for it at __syncwarp"
                                r"|__syncwarp .* names lanes \{5\}, which exited)",
    "shfl_two_sites": AT + r"lanes of one warp meet at different warp collectives: lane \d+ at __shfl_sync "
                           r"\(selftest\.cpp:\d+",
    "syncthreads_after_exit": AT + r"(exits while \d+ thread\(s\) of its block wait at __syncthreads"
                                   r"|__syncthreads .* after 1 thread\(s\) of the block exited)",
    "syncthreads_two_sites": AT + r"threads of one block reach different __syncthreads: selftest\.cpp:\d+ and "
                                  r"selftest\.cpp:\d+",
    "smem_overflow": AT + r"shared memory accessed past the launch's 256 bytes of dynamic shared memory "
                          r"\(dynamic shared memory \+ 256\)",
    "stack_overflow": AT + r"stack overflow of the thread's fiber \((65536|262144) bytes\)",  # 4x under ASan
    "deadlock": r"CPU model: run_selftest kernel: deadlock: no thread can run .* __syncwarp \(selftest\.cpp:\d+\) "
                r"of warp 0, lanes \{0\} never came",
    "relaxed_poll_unfenced": AT + r"bulk load \(selftest\.cpp:\d+\) of 64 bytes after the relaxed poll at "
                                  r"selftest\.cpp:\d+ with no fence\.acq_rel since",
    "acquire_without_proxy_fence": AT + r"bulk load \(selftest\.cpp:\d+\) of 64 bytes from registered memory after "
                                        r"the acquire at selftest\.cpp:\d+ with no fence\.proxy\.async since",
    "static_plus_dynamic_smem": AT + r"static shared memory \(\d+ bytes so far\) plus the launch's 230400 bytes of "
                                     r"dynamic shared memory: over the 232448 a block may have",
    "assume_shared_global": AT + r"assume_shared \(selftest\.cpp:\d+\): 0x[0-9a-f]+ is not in the block's shared "
                                 r"memory",
    # a bar.sync whose participant left: unbounded on a GPU, so the model gives up on virtual time
    "named_barrier_participant_exits": AT + r"named barrier 1 \(selftest\.cpp:\d+\): 32 of 64 threads arrived and "
                                            r"no other came for 1000 s of virtual time",
    "named_barrier_count_mismatch": AT + r"named barrier 1 \(selftest\.cpp:\d+\): a thread arrives for (64|96) "
                                         r"threads where this generation's first arrival named (64|96)",
}
NOT_ERRORS = {"clean", "missing_wait", "timeout", "shared_without_barrier", "torn_row"}


def test_every_selftest_has_an_expectation():
    assert set(model.selftest_names()) == set(CAUGHT) | NOT_ERRORS


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_each_broken_rule_stops_the_launch_with_its_message(name, seed):
    model.set_seed(seed)
    error, _ = model.run_selftest(name)
    assert error is not None, f"{name}: the model let it pass"
    assert re.search(CAUGHT[name], error), error


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_clean_kernel_passes_and_moves_its_bytes(seed):
    model.set_seed(seed)
    error, out = model.run_selftest("clean")
    assert error is None
    assert out[0] == (63 * 7 + 3) & 0xFF  # byte 63 of the source, through shared memory


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_missing_wait_reads_garbage_not_the_data(seed):
    """Bulk copies land at a later scheduling point, so reading before the wait sees the
    shared memory's garbage (0xAB), never the data by luck."""
    model.set_seed(seed)
    error, out = model.run_selftest("missing_wait")
    assert error is None
    assert out[0] == 0xAB and out[0] != 3


@pytest.mark.parametrize("torn", [True, False])
def test_a_reader_that_skips_its_wait_sees_a_torn_row(torn):
    """A bulk load lands in pieces at their own rounds (the weakening torn_copies, on by default):
    a reader that polls the row's first word instead of the mbarrier sees its end unwritten on
    some seeds. With whole copies it never does: the row lands at once."""
    seen = set()
    try:
        model.set_weakening("torn_copies", torn)
        for seed in range(16):
            model.set_seed(seed)
            error, out = model.run_selftest("torn_row")
            assert error is None
            seen.add(out[0])
    finally:
        model.set_weakening("torn_copies", True)
    whole = (255 * 7 + 3) & 0xFF
    assert seen == ({whole, 0xAB} if torn else {whole})


def test_the_weakenings_are_on_by_default():
    assert model.weakenings() == {"remote_late": True, "torn_copies": True}
    with pytest.raises(ValueError, match="no weakening named 'stronger'"):
        model.set_weakening("stronger", False)


def test_a_read_without_a_barrier_sees_either_value():
    """Threads switch at the device layer's synchronisation points in a seeded order, so an
    unordered read sees the write on some schedules and the garbage before it on others; the
    model itself reports nothing (its race check does: scripts/sanitize.py --sanitizer thread)."""
    seen = set()
    for seed in range(16):
        model.set_seed(seed)
        error, out = model.run_selftest("shared_without_barrier")
        assert error is None
        seen.add(out[0])
    assert seen == {1, 0xAB}


def test_a_bounded_wait_gives_up_on_virtual_time():
    """A flag nobody sets: the kernel's own 5 s bound expires on the model's clock."""
    error, out = model.run_selftest("timeout")
    assert error is None and out[0] == -1


def _float_bits_specials():
    values = [0.0, -0.0, 1.0, -1.0, 65504.0, 65520.0, 65519.99, 1e-8, -1e-8, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8,
              3.0e38, -3.4e38, float("inf"), float("-inf"), 1.00390625, 1.01171875, 1.0 + 2**-9, 1.0 + 3 * 2**-9]
    gen = random.Random(5)
    for _ in range(2000):
        bits = gen.getrandbits(32)
        if (bits >> 23) & 0xFF == 0xFF:  # NaN payloads are not compared
            continue
        values.append(struct.unpack("<f", struct.pack("<I", bits))[0])
    return values


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_the_model_rounds_to_16_bits_like_torch(kind):
    values = _float_bits_specials()
    got = model.round_to_16bit(values, kind)
    want = torch.tensor(values, dtype=torch.float32).to(getattr(torch, kind)).view(torch.int16)
    want = [int(v) & 0xFFFF for v in want]
    bad = [(v, g, w) for v, g, w in zip(values, got, want) if g != w]
    assert not bad, f"{len(bad)} values differ, first: {bad[:3]}"
