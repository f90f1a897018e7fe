#!/usr/bin/env python3
"""Does the CPU model bite? Plant one defect at a time in the real kernels, rebuild
hybrid_ep._model in a scratch copy of the checkout, run the model's kernel tests there (the
several-node tests for a defect of the RDMA path), and report which test failed and with what
message. Each defect lives only in the scratch copy.

    python scripts/model_mutations.py                 # every defect, then a clean control run
    python scripts/model_mutations.py --only missing-mbarrier-wait --keep

Exit status 0 when every planted defect made a test fail and the control run passed. Not
part of CI (each defect rebuilds the model); benchmarks/results/ records its runs (docs/dev/cpu_model.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Calls that wrap the dispatch's rings (2 chunks) many times, on one node and on 2-4 nodes.
RING_TESTS = "tests/model/test_ring_model.py::test_calls_that_wrap_the_ring_many_times_match_the_oracle"


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    kind: str  # the class of defect the issue lists
    path: str
    old: str
    new: str
    tests: str = "tests/model/test_kernels_model.py"  # the model tests that should catch it


# The combine's ring tests (many turns of two-slot rings), one node and several.
RINGS_ONE_NODE = "tests/model/test_combine_rings_model.py::test_one_node_calls_many_times_a_ring_match_the_oracle"
RINGS_NODES = "tests/model/test_combine_rings_model.py::test_several_nodes_calls_many_times_a_ring_match_the_oracle"
# The hazards the weakened model reproduces (tests/model/test_hazards_model.py).
HAZARD_CREDITS = "tests/model/test_hazards_model.py::test_the_combines_last_credits_land_before_the_next_call"
HAZARD_STAGES = "tests/model/test_hazards_model.py::test_the_direct_dispatch_keeps_an_even_stage_count"
# The direct combine's knob combinations the lease times: token stages with every lane observing and
# with a named barrier, one node; the named hand-off on route stages, two nodes.
LEASE_VARIANTS = "tests/model/test_kernels_model.py::test_every_combination_the_lease_times_gives_the_oracle_result"
LEASE_TOKEN = f"{LEASE_VARIANTS}[token-None-None-1] {LEASE_VARIANTS}[token-named-8-1]"
LEASE_NAMED = f"{LEASE_VARIANTS}[route-named-None-2] {LEASE_VARIANTS}[token-named-None-1]"
# The direct path on several nodes: calls that wrap its staging and node-partial rings many times.
DIRECT_NODES = ("tests/model/test_hierarchy_direct_model.py::"
                "test_calls_that_wrap_the_rdma_rings_many_times_match_the_oracle")

MUTATIONS = (
    Mutation("misaligned-bulk-store", "a misaligned bulk copy", "csrc/kernels/dispatch_receive.cuh",
             "dev::bulk_s2g(to + it.offset, d.send_fifo.slot(consumed)",
             "dev::bulk_s2g(to + it.offset + 8, d.send_fifo.slot(consumed)"),
    Mutation("missing-mbarrier-wait", "a missing mbarrier wait", "csrc/kernels/dispatch_receive.cuh",
             "if (d.stopped() || !d.expand_fifo.ring.consumer_wait(d.args, consumed)) {",
             "if (d.stopped()) {"),
    Mutation("signal-before-stores-land", "a missing bulk-group wait", "csrc/kernels/dispatch_receive.cuh",
             "      const Landing l = stores(mark);\n      if (l != Landing::kLanded) return l;\n",
             "      if (mark + in_flight > queue.groups()) return Landing::kInFlight;\n"
             "      dev::fence_proxy_async();\n"),
    Mutation("signal-one-row-short", "a wrong signal count", "csrc/kernels/dispatch_receive.cuh",
             "      sig->rows = rows;", "      sig->rows = rows > 0 ? rows - 1 : 0;"),
    Mutation("staged-before-stores-land", "a missing bulk-group wait (rows put to another node before staged)",
             "csrc/kernels/dispatch_receive.cuh", "      const Landing l = stores(mark);\n",
             """      if (pending.item[0].staged) {
        if (!d.staged_fifo.producer_acquire(d.args, staged)) return Landing::kStopped;
        d.staged_fifo.producer_commit(staged);
        staged.advance(kStagedSlots);
        pending.item[0].staged = false;
      }
      const Landing l = stores(mark);\n""", tests="tests/model/test_hierarchy_model.py"),
    Mutation("staged-slot-off-by-one", "an off-by-one position (a token's staged slot for another node)",
             "csrc/kernels/dispatch_receive.cuh", "tab.dest_slot[lane][n] = __popc(mask & ((1u << lane) - 1u));",
             "tab.dest_slot[lane][n] = __popc(mask & ((1u << lane) - 1u)) + (lane == 1);",
             tests="tests/model/test_hierarchy_model.py"),
    Mutation("forwarder-drops-a-partial", "a lost term (a node partial summed without one rank's partial)",
             "csrc/kernels/combine_receive.cuh", "    const bool goes = lane < rows && slots[g] >= 0;",
             "    const bool goes = lane < rows && slots[g] >= 0 && g != 1;",
             tests="tests/model/test_hierarchy_model.py"),
    Mutation("forwarded-stage-freed-by-one-warp", "a stage released before every consumer read it (the source "
             "side's ring, forwarded partials too)", "csrc/kernels/combine_receive.cuh",
             "    src.init(1, kGroupWarps);",
             "    src.init(1, 1);", tests="tests/model/test_hierarchy_model.py"),
    Mutation("forwarded-chunk-put-after-its-first-row", "a hand-off before the data is written (a forwarded "
             "chunk put before its later rows' node partials)", "csrc/kernels/combine_receive.cuh",
             "return rows == 0 || (q == rows - 1 && end == C); }", "return rows == 0 || (q == 0 && end == C); }",
             tests="tests/model/test_hierarchy_model.py"),
    Mutation("source-frees-a-slot-before-its-loads-land", "a ring slot freed before its reads completed (a "
             "source credits a chunk's partial-ring slots as soon as it issued the chunk's bulk loads)",
             "csrc/kernels/combine_receive.cuh",
             "  cr.pending.note(typename SourceCredits<Rdma>::Chunk{node, c}, produced.count);",
             "  send_credits(d, cr, typename SourceCredits<Rdma>::Chunk{node, c});",
             tests=RINGS_ONE_NODE),
    Mutation("credit-tag-a-chunk-behind", "an off-by-one position (a credit names the chunk before the one read: "
             "the writers wait for a credit that never comes, and the call times out)",
             "csrc/kernels/combine_receive.cuh",
             "ring.reader_release(d.credit(first + g, source, k.chunk), d.call, k.chunk);",
             "ring.reader_release(d.credit(first + g, source, k.chunk), d.call, k.chunk - 1);", tests=RINGS_ONE_NODE),
    Mutation("host-skips-the-credit-wait", "a missing wait for a ring slot (an expert host writes chunk c over "
             "chunk c - ring before its reader read it)", "csrc/kernels/combine_receive.cuh",
             "    if (!d.host_ring(s).writer_acquire(d.args, d.credit(d.a.rank, s, c), d.call, c,",
             "    if (false && !d.host_ring(s).writer_acquire(d.args, d.credit(d.a.rank, s, c), d.call, c,",
             tests=RINGS_ONE_NODE),
    Mutation("node-partial-forwarded-twice", "a chunk counted twice (a forwarder puts a chunk's node partials "
             "again as the next chunk's, with that chunk's signal)", "csrc/kernels/combine_receive.cuh",
             "                      PeerRing::tag(d.call, it.chunk));\n  }",
             """                      PeerRing::tag(d.call, it.chunk));
    h.rdma.put_signal(lane, h.rail_peer(it.node), d.node_row_off(h.R.node_part_rows_in, h.node, it.chunk + 1, 0),
                      h.rdma.local(d.node_row_off(h.R.node_part_rows_out, it.node, it.chunk, 0)),
                      static_cast<uint64_t>(it.rows) * row_b,
                      d.node_word_off(h.R.node_part_signal, h.node, it.chunk + 1),
                      PeerRing::tag(d.call, it.chunk + 1));
  }""", tests=RINGS_NODES),
    Mutation("chunk-signal-of-the-previous-call", "a completion count of the wrong call (the expand warps take "
             "a chunk's signal of the previous call, call - 1, for this call's)", "csrc/kernels/dispatch_receive.cuh",
             "d.recv.reader_wait(d.args, &sig->tag, d.call, c,",
             "d.recv.reader_wait(d.args, &sig->tag, d.call - 1, c,"),
    Mutation("direct-tensors-of-the-previous-call", "a completion count of the wrong call (a direct dispatch "
             "takes a destination's tensors published by the previous call, call - 1)",
             "csrc/kernels/dispatch_direct.cuh", "read_tensors(args, d.view, a, dst, kDirectDispatch, d.call, pv)",
             "read_tensors(args, d.view, a, dst, kDirectDispatch, d.call - 1, pv)",
             tests="tests/model/test_kernels_model.py::test_a_source_waits_for_a_late_destination_to_publish"),
    Mutation("direct-done-of-the-previous-call", "a completion count of the wrong call (a rank takes its "
             "sources' done count of the previous call, call - 1, for this call's: its kernel may end while a "
             "peer still writes its rows)", "csrc/kernels/direct.cuh",
             "return wait_at_least(args, direct_done(view, a.rank, kind, r), call,",
             "return wait_at_least(args, direct_done(view, a.rank, kind, r), call - 1,",
             tests="tests/model/test_kernels_model.py::test_a_destination_waits_for_its_direct_writers"),
    Mutation("ordinal-off-by-one", "an off-by-one position", "csrc/kernels/count.cuh",
             "e[k] >= 0 ? lanes_of[e[k]] + prefix[k] : -1;",
             "e[k] >= 0 ? lanes_of[e[k]] + prefix[k] + (lane == 31) : -1;"),
    Mutation("no-drain-after-abort", "a block exiting with bulk loads in flight", "csrc/kernels/dispatch_receive.cuh",
             "  d.expand_fifo.drain(d.args, PipeState{}, produced);\n", "\n"),
    Mutation("lanes-skip-the-acquire", "lanes reading a peer's data before lane 0's acquire",
             "csrc/kernels/dispatch_receive.cuh", """    if (!warp_uniform(ok)) {
      d.stop();
      break;
    }
    d.table_ring.observe_empty(slot, lane);""", """    if (!ok) {
      d.stop();
      break;
    }
    d.table_ring.observe_empty(slot, lane);"""),
    Mutation("syncwarp-in-a-lane-branch", "a warp collective not reached by every lane of its mask",
             "csrc/kernels/dispatch_receive.cuh", """    if (lane < rows) tab.ndest[lane] = n;
    // Several nodes""", """    if (lane < rows) {
      tab.ndest[lane] = n;
      __syncwarp();
    }
    // Several nodes"""),
    Mutation("combine-stage-freed-by-one-warp", "a stage released before every consumer read it",
             "csrc/kernels/combine_receive.cuh", "    host_in.init(1, kGroupWarps);", "    host_in.init(1, 1);"),
    Mutation("combine-signal-before-stores-land", "a missing bulk-group wait", "csrc/kernels/combine_receive.cuh",
             "    stored.flush(StoresLanded(queue, in_flight, true), [&](const Stored& k) {",
             """    stored.flush([&](uint32_t mark) {
      if (mark + in_flight > queue.groups()) return Landing::kInFlight;
      dev::fence_proxy_async();
      __threadfence_system();
      return Landing::kLanded;
    }, [&](const Stored& k) {"""),
    Mutation("combine-partial-after-first-route", "an item flag off by one (a row emitted before its last part)",
             "csrc/kernels/segments.cuh", "if ((it.flags & kLastPart) && !emit(acc, it)) return;",
             "if ((it.flags & kFirstPart) && !emit(acc, it)) return;"),
    Mutation("reducer-weight-taken-as-one", "a lost factor (a weighted part added as if its weight were 1)",
             "csrc/kernels/segments.cuh", "add_as<kFirst>(in, cols, gt, w);\n    } else if (w == 1.f) {",
             "add_as<kFirst>(in, cols, gt, w);\n    } else if (w > 0.f) {"),
    Mutation("direct-route-row-off-by-one", "an off-by-one position (a route's final row)",
             "csrc/kernels/dispatch_direct.cuh",
             "const int64_t p = static_cast<int64_t>(d.sh.first_row[e]) + ord[k];",
             "const int64_t p = static_cast<int64_t>(d.sh.first_row[e]) + ord[k] + (lane == 5);"),
    Mutation("store-queue-ends-before-stores-land", "a missing bulk-group wait (a store thread ends, and the "
             "direct dispatch signals done, with stores in flight)", "csrc/kernels/pipeline.cuh",
             "    dev::bulk_wait_all();      // the stores landed", "    // the stores landed"),
    Mutation("store-queue-frees-before-read", "a stage released before its stores read it (every store queue)",
             "csrc/kernels/pipeline.cuh",
             "    bulk_wait_read_except(in_flight);  // release the oldest stages only\n", ""),
    Mutation("block-counter-kept-across-calls", "a completion count of the wrong call (the rank's count of "
             "finished blocks is not reset, so the next call's last block never publishes done)",
             "csrc/kernels/skeleton.cuh", "  *blocks_done = 0;\n", ""),
    Mutation("direct-combine-weight-dropped", "a route summed without its routing weight (apply_probs)",
             "csrc/kernels/combine_direct.cuh", "        weight = tab.weight[q][j];", "        weight = 1.f;"),
    Mutation("layout-mask-counted-before-read", "a missing __syncwarp (an expert's lane mask turned into its count "
             "before every lane read it)", "csrc/kernels/count.cuh",
             "    __syncwarp();  // every lane has read the masks before they become counts\n", ""),
    Mutation("skipped-syncthreads", "a skipped __syncthreads (the tally warps' named barrier before the scan)",
             "csrc/kernels/count.cuh", """          if (lane == 0) lanes_of[E + W + n] = __popc(bal);
        }
      }
    }
    dev::named_barrier_sync(kTallyBarrier, kTallyThreads);""",
             """          if (lane == 0) lanes_of[E + W + n] = __popc(bal);
        }
      }
    }"""),
    Mutation("launch-ranks-past-inline-misread", "a launch's ranks past the 16 its parameters hold read from "
             "the wrong slot (the inline array again, not the device copy)", "csrc/common/state.cuh",
             "                                : reinterpret_cast<const RankArgs*>(args.more_ranks)"
             "[i - kInlineLaunchRanks];",
             "                                : args.ranks[i - kInlineLaunchRanks];",
             tests="tests/model/test_nvlink_domain_model.py::"
                   "test_a_launch_past_its_inline_ranks_reads_the_rest_from_device_memory"),
    Mutation("count-peers-skip-flow-control", "a missing wait (the count kernel's peers warp does not wait for its "
             "peers to finish the previous call before the block overwrites their count rows)",
             "csrc/kernels/count.cuh", "  for (int r = lane; r < c.W && ok; r += 32) {",
             "  for (int r = lane; false && r < c.W && ok; r += 32) {",
             tests="tests/model/test_kernels_model.py::test_a_call_waits_for_its_peers_to_finish_the_previous_one"),
    Mutation("ring-freed-before-loads-land", "a ring slot freed before its reader's loads completed (the receive "
             "ring's credit sent when the chunk's table is ready)", "csrc/kernels/dispatch_receive.cuh",
             "    const int rows = tab.rows;\n    bool ok = true;\n",
             "    const int rows = tab.rows;\n    d.recv.reader_release(d.recv_credit(d.ring_writer(s), topo.node(s), "
             "topo.local(d.a.rank), c), d.call, c);\n    bool ok = true;\n", tests=RING_TESTS),
    Mutation("ring-credit-one-chunk-short", "a credit tag off by one chunk ((call << 32) | c for chunk c, not c + 1)",
             "csrc/kernels/dispatch_receive.cuh", "topo.local(d.a.rank), c), d.call, c);",
             "topo.local(d.a.rank), c), d.call, c - 1);", tests=RING_TESTS),
    Mutation("ring-writer-skips-the-credit-wait", "a writer that skips the credit wait (a chunk written into a ring "
             "slot whose previous chunk its reader may not have read)", "csrc/kernels/dispatch_receive.cuh",
             "    for (int i = lane; i < slot_items(su, with_staged) && ok; i += 32) {",
             "    for (int i = lane; false && i < slot_items(su, with_staged) && ok; i += 32) {",
             tests=RING_TESTS),
    Mutation("staging-freed-before-forwarded", "a staging slot freed before its forwarder read it (the credit sent "
             "when the forwarded chunk arrived)", "csrc/kernels/dispatch_receive.cuh",
             "    if (!d.slots_ready(su, lane, true) && lane == 0) ok = signal_pending(0);",
             "    if (lane == 0 && su.node >= 0)\n"
             "      releases.reader_release(su.source, d.h.staged_credit_off(d.h.node, su.chunk), d.call, su.chunk);\n"
             "    if (!d.slots_ready(su, lane, true) && lane == 0) ok = signal_pending(0);", tests=RING_TESTS),
    Mutation("staged-rows-forwarded-before-their-signal", "a staged row forwarded before its RDMA put landed (the "
             "forwarder's load warp reads a chunk's row count and rows without waiting for its signal)",
             "csrc/kernels/dispatch_receive.cuh", "    if (!d.arrive(su)) {\n      d.stop();\n      break;\n    }\n",
             "    if (su.node >= 0) su.u1 = *reinterpret_cast<const volatile int32_t*>(d.fwd_meta(su));\n",
             tests=RING_TESTS),
    Mutation("bad-routing-call-left-open", "a completion never published (a call with a bad route, whose "
             "dispatch kernel moves nothing, is not completed by the count kernel)", "csrc/kernels/count.cuh",
             "  complete_unmoved(view, h, call);\n", "", tests="tests/model/test_routing_device.py"),
    Mutation("static-bad-route-unrecorded", "a bad route of a static-size call never reported (the count kernel "
             "records no route for the host)", "csrc/kernels/count.cuh",
             "  if (!args.info_read) record_bad_route(", "  if (false) record_bad_route(",
             tests="tests/model/test_routing_device.py"),
    Mutation("refused-direct-dispatch-runs", "a dispatch kernel run on a call its count kernel refused (the direct "
             "path's kernel does not return on the info's bad-route word)", "csrc/kernels/dispatch_direct.cuh",
             "  if (place.rank.absent || call_refused(args.geo, place.rank)) return;",
             "  if (place.rank.absent) return;", tests="tests/model/test_routing_device.py"),
    # The direct path on several nodes (dispatch_direct.cuh, combine_direct.cuh through the rail peers)
    Mutation("direct-node-partial-forwarded-twice", "a chunk counted twice (a rail peer puts a forwarded chunk's "
             "node partials again as the next chunk's, with that chunk's signal)", "csrc/kernels/combine_direct.cuh",
             "                      d.node_word_off(h.R.node_part_signal, h.node, it.chunk), "
             "PeerRing::tag(d.call, it.chunk));\n"
             "  }\n  if (lane == 0) h.rdma.quiet();",
             "                      d.node_word_off(h.R.node_part_signal, h.node, it.chunk), "
             """PeerRing::tag(d.call, it.chunk));
    h.rdma.put_signal(lane, h.rail_peer(it.node), d.node_row_off(h.R.node_part_rows_in, h.node, it.chunk + 1, 0),
                      h.rdma.local(d.node_row_off(h.R.node_part_rows_out, it.node, it.chunk, 0)), it.rows * row_b,
                      d.node_word_off(h.R.node_part_signal, h.node, it.chunk + 1),
                      PeerRing::tag(d.call, it.chunk + 1));
  }
  if (lane == 0) h.rdma.quiet();""", tests=DIRECT_NODES),
    Mutation("direct-staged-rows-loaded-before-their-put", "a staged row expanded before its RDMA put landed (the "
             "rail peer's load warp reads a forwarded chunk's row count and rows without waiting for its signal)",
             "csrc/kernels/dispatch_direct.cuh",
             "      if (!d.arrive(m, c, u1)) {\n        d.stop();\n        break;\n      }\n",
             "      u1 = *reinterpret_cast<const volatile int32_t*>(d.fwd_meta(m, c));\n", tests=DIRECT_NODES),
    Mutation("direct-staging-credit-before-loads-land", "a staging slot freed before its reader's loads landed (the "
             "rail peer credits a forwarded chunk before the store warps waited for its loads)",
             "csrc/kernels/dispatch_direct.cuh",
             "    bool ok = true;\n    if (lane == 0) ok = !d.stopped() && d.done_ring.consumer_wait(d.args, done);",
             "    if (m >= 0 && lane == 0)\n"
             "      releases.reader_release(h.rail_peer(m), h.staged_credit_off(h.node, c), d.call, c);\n"
             "    bool ok = true;\n    if (lane == 0) ok = !d.stopped() && d.done_ring.consumer_wait(d.args, done);",
             tests=DIRECT_NODES),
    Mutation("direct-forwarded-route-off-by-one", "an off-by-one position (a forwarded route written to the wrong "
             "row on the rail peer's node)", "csrc/kernels/dispatch_direct.cuh",
             "+ dev::ld(&tm->ordinal[k]);", "+ dev::ld(&tm->ordinal[k]) + (lane == 3);", tests=DIRECT_NODES),
    Mutation("direct-scales-before-the-table", "a warp reading its lanes' shared rows without a __syncwarp "
             "(the route table's fp8 scale copies, a token at a time by the whole warp, before every lane "
             "wrote its routes)",
             "csrc/kernels/dispatch_direct.cuh", "  __syncwarp();  // every lane's routes in the table\n", ""),
    Mutation("elected-reducers-without-the-agreement", "lanes reading a stage that only their lane 0 waited "
             "for, with no __syncwarp after its wait (the direct combine's elected stage waits, "
             "HYBRID_EP_REDUCER_WAIT=elect)",
             "csrc/kernels/segments.cuh", "  if (!warp_uniform(ok)) {\n    d.stop();\n    return false;\n  }\n"
             "  if (wait == kReducerWaitObserve)",
             "  if (wait == kReducerWaitObserve ? !warp_uniform(ok) : !ok) {\n    d.stop();\n"
             "    return false;\n  }\n  if (wait == kReducerWaitObserve)",
             tests="tests/model/test_kernels_model.py::test_the_direct_combine_variants_give_the_oracle_result"),
    Mutation("wide-reducers-release-at-four", "a stage freed before every reader is done with it (the direct "
             "combine's ring counting 4 reducer arrivals where HYBRID_EP_REDUCER_WARPS=8 has 8 warps read "
             "each stage)",
             "csrc/kernels/combine_direct.cuh", "      d.pipeline_ring(p).init(1, R);",
             "      d.pipeline_ring(p).init(1, kReducerWarpsNarrow);",
             tests="tests/model/test_kernels_model.py::test_eight_reducer_warps_add_the_widest_segments"),
    # The direct combine's token stages (HYBRID_EP_COMBINE_STAGE=token) and its named hand-off
    # (HYBRID_EP_REDUCER_WAIT=named), against the combinations the GPU lease times.
    Mutation("token-stage-freed-before-summed", "a stage freed before every reader is done with it (a token "
             "stage released before its reducers summed its parts: the load warp refills it under them)",
             "csrc/kernels/combine_direct.cuh",
             "    const int n = (it.flags & kNoBytes) ? 0 : tp.n;\n",
             "    const int n = (it.flags & kNoBytes) ? 0 : tp.n;\n"
             "    if (lane == 0) ring.consumer_release(p);\n",
             tests=LEASE_TOKEN),
    Mutation("token-stage-expects-a-part-short", "a missing wait (a token stage's expected bytes one part short: "
             "its phase may complete before its last part lands)", "csrc/kernels/combine_direct.cuh",
             "((static_cast<uint32_t>(n) - in_wire) * d.in_bytes +",
             "((static_cast<uint32_t>(n) - 1 - in_wire) * d.in_bytes +", tests=LEASE_TOKEN),
    Mutation("token-segment-for-one-part", "a stage overrun (a token stage's segment sized for one part, not the "
             "call's top-k: its parts run past the stage)", "csrc/kernels/combine_direct.cuh",
             "stage_bytes / (static_cast<uint32_t>(K > 0 ? K : 1) * elem)", "stage_bytes / elem",
             tests=LEASE_TOKEN),
    Mutation("named-hand-off-without-its-barrier", "warps reading a stage only their group's waiter waited for, "
             "with no barrier after its wait (HYBRID_EP_REDUCER_WAIT=named without the bar.sync)",
             "csrc/kernels/segments.cuh", "  dev::named_barrier_sync(id, threads);\n", "", tests=LEASE_NAMED),
    Mutation("bad-route-of-the-last-rank", "ranks naming another rank's bad route than the lowest",
             "csrc/kernels/count.cuh", "for (int s = 0; s < W && sh.bad_rank < 0; ++s) {",
             "for (int s = 0; s < W; ++s) {", tests="tests/model/test_routing_device.py"),
    # Defects only the weakened model shows (docs/dev/cpu_model.md, "Weakened"): one per weakening
    # or check, and one per hazard of the kernels it reproduced.
    Mutation("combine-credits-not-quieted", "a remote signal not quieted before the kernel ends (late delivery: "
             "the source's last node-partial credits land in a later call, over that call's)",
             "csrc/kernels/peer_ring.cuh", "  __device__ ~RingReleases() { quiet(); }",
             "  __device__ ~RingReleases() {}", tests=HAZARD_CREDITS),
    Mutation("rows-signalled-without-their-fence", "remote puts out of order (late delivery: a chunk's routing "
             "and signal land before its rows, put without the fence between)", "csrc/kernels/hierarchy.cuh",
             "      if (lane == 0) rdma.fence();  // the rows are delivered before the routing's signal\n"
             "      __syncwarp();\n    }\n    rdma.put_signal(lane, peer, staged_meta_off(",
             "      __syncwarp();\n    }\n    rdma.put_signal(lane, peer, staged_meta_off(", tests=RING_TESTS),
    Mutation("wait-without-its-fence", "a relaxed poll not followed by its fence (the flag's wait returns on the "
             "relaxed load alone)", "csrc/common/state.cuh", "      dev::fence_acq_rel_sys();\n      return true;",
             "      return true;"),
    Mutation("bulk-load-after-acquire-without-proxy-fence", "a missing proxy fence (the expand warp's bulk loads "
             "of the rows a peer stored, after its acquire of their signal)", "csrc/kernels/dispatch_receive.cuh",
             "      dev::fence_proxy_async();                                       // read by bulk loads below\n",
             ""),
    Mutation("plan-forgets-static-smem", "static plus dynamic shared memory over the block's limit (the FIFO "
             "plan gives every byte to the dynamic stages)", "hybrid_ep/backends/cuda/launch.py",
             "    budget = (smem_per_block - STATIC_SMEM_RESERVE) // pipelines",
             "    budget = smem_per_block // pipelines"),
    Mutation("direct-dispatch-odd-stage-count", "store threads taking a FIFO's items in turn over an odd stage "
             "count (a stale mbarrier parity; the launcher refuses it)", "hybrid_ep/backends/cuda/launch.py",
             "budget // stage) // stage_multiple * stage_multiple", "budget // stage)", tests=HAZARD_STAGES),
)


def _copy_checkout(dst: str) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = os.path.join(REPO, rel)
        if not os.path.isfile(src) or rel.startswith(("docs/benchmarks/", "benchmarks/results/")):
            continue
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, rel))


def _plant(root: str, m: Mutation) -> None:
    path = os.path.join(root, m.path)
    text = open(path).read()
    if text.count(m.old) != 1:
        raise SystemExit(f"{m.name}: the text to change occurs {text.count(m.old)} times in {m.path}; "
                         f"update the mutation to today's kernel")
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))


def _build(root: str, log: str) -> None:
    """The model alone: no defect is planted in the balancer's planner, so the checkout's built
    one is copied in where there is one, and its 9 files at -O3 are not compiled again per defect."""
    env = {**os.environ, "HYBRID_EP_SKIP_CUDA_BUILD": "1", "HYBRID_EP_BUILD_MODEL": "1"}
    planners = glob.glob(os.path.join(REPO, "hybrid_ep", "_planner*.so"))
    if planners:
        env["HYBRID_EP_SKIP_PLANNER_BUILD"] = "1"
        for built in planners:
            shutil.copy2(built, os.path.join(root, "hybrid_ep"))
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=root, env=env,
                            stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"building the model in {root} failed; see {log}")


def _first_failure(output: str) -> tuple[str, str]:
    """(test id, the first line of its error) from pytest -x output."""
    test = re.search(r"^FAILED (\S+)", output, re.M)
    errors = [line[2:].strip() for line in output.splitlines() if line.startswith("E ")]
    message = next((e for e in errors if "Error" in e or "differ" in e or "gave up" in e), errors[0] if errors else "")
    return (test.group(1) if test else "?"), message[:400]


def _run_tests(root: str, tests: str, timeout_s: int) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": root, "HYBRID_EP_TIMEOUT_S": "5"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests.split()],
                          cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode, proc.stdout + proc.stderr


def _document(results: list[dict], args) -> dict:
    """The JSON the script writes: the project's metadata block, then one row per defect run."""
    sys.path.insert(0, REPO)
    from hybrid_ep.metadata import metadata

    config = {"only": args.only, "timeout_s": args.timeout, "defects": len(results) - 1}
    units = {"seconds": "wall seconds per defect: copy, build and the tests it names",
             "caught": "a test failed with the defect planted (the control: with none)"}
    return {"metadata": metadata("python scripts/model_mutations.py", device_type="cpu", config=config, units=units),
            "results": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--only", nargs="+", choices=[m.name for m in MUTATIONS], help="these defects only")
    p.add_argument("--keep", action="store_true", help="keep the scratch copies (paths are printed)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--timeout", type=int, default=600, help="seconds for one test run")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    results, ok = [], True
    for m in chosen + [None]:
        name = m.name if m else "control (no defect)"
        root = tempfile.mkdtemp(prefix=f"hybrid_ep_mutation_{name.split()[0]}_")
        started = time.monotonic()
        _copy_checkout(root)
        if m:
            _plant(root, m)
        _build(root, os.path.join(root, "build.log"))
        try:
            rc, output = _run_tests(root, m.tests if m else Mutation.tests, args.timeout)
        except subprocess.TimeoutExpired as e:  # no verdict: the run outlasted --timeout (a loaded machine)
            rc, output = None, f"the tests ran past --timeout {args.timeout} s: {e}"
        test, message = _first_failure(output) if rc else ("", "")
        caught = bool(rc)
        good = caught if m else rc == 0
        ok &= good
        row = {"defect": name, "class": m.kind if m else "", "file": m.path if m else "", "caught": caught,
               "timed_out": rc is None, "test": test, "message": message,
               "seconds": round(time.monotonic() - started, 1)}
        results.append(row)
        if rc is None:
            verdict = "TIMED OUT"
        else:
            verdict = ("caught" if caught else "NOT CAUGHT") if m else ("passes" if not caught else "FAILS")
        print(f"{name:<26} {verdict:<11} {test}\n{'':<26} {message}", flush=True)
        if not good:
            print(output[-3000:])
        if args.keep:
            print(f"{'':<26} scratch copy: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_document(results, args), f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
