// The rings between ranks: every row (and every routing record or partial sum) that moves from
// one rank to another goes through a ring of chunk slots that its reader frees with a credit.
// PeerRing is their one type, as PipeState / Ring (kernels/pipeline.cuh) is for the rings between
// the warps of a block: a kernel asks it for a chunk's slot, the words that tag the chunk, the
// writer's acquire of a slot and its publish, the reader's wait for a chunk (each side's wait
// names the ring's phase for that side in a timeout record) and its release, and never writes
// those out itself (tests/tools/test_peer_ring_waits.py keeps it so).
//
// The rings (their memory: csrc/bindings/buffer_layout.h builds it from this list):
//   recv        dispatch, receive path: a source's rows, routing entries and fp8 scales in each
//               rank of its node; written by the source, or for a source on another node by its
//               rail peer on this node (the forwarder), read by the expand warps (NVLink).
//   staged      both dispatches, several nodes: a source's own chunks for another node, staged in
//               its RDMA region and put into the same slot of its rail peer there (RDMA).
//   partial     combine, receive path: an expert host's partial sums for a source of its node
//               (NVLink).
//   forward     combine, receive path, several nodes: an expert host's partial sums for a source
//               on another node, at that source's rail peer on this node (NVLink).
//   node_part   both combines, several nodes: the forwarder's node partial sums of a chunk, put
//               into the same slot of the source on the other node (RDMA).
//
// The invariant. Chunk c of a ring takes slot(c) = c % slots. Every signal and credit word holds
// tag(call, c), one encoding for the five rings (the recv and staged rings' signals have a word
// per chunk, the others a word per slot), which grows with the call and, within a call, with the
// chunk; the chunks of one slot come in order (c, c + slots, ...), so every word only grows and
// every wait is `>=`.
// Before the writer puts anything of chunk c >= slots into its slot (writer_acquire), its
// credit word, in the writer's memory, holds tag(call, c - slots) from every reader of the slot:
// the reader released chunk c - slots (reader_release) once it had read it whole: once its
// copies of it landed, not when it issued them (DeferredReleases, kernels/pipeline.cuh, holds
// the releases until then, and says why each lands before the kernel ends). Chunks c < slots
// wait for nothing: the call's flow control (done_dispatch, done_combine, waited for before a
// kernel writes a peer's ring) freed every slot. Every chunk takes its slot, rows or none, so a
// slot's words keep that order. One release of a staged or node_part slot frees it at
// both ends: the reader read its copy, and the put that delivered it had read the writer's.
// Over the transport a release is a non-blocking signal (NVSHMEM), which the reader quiets
// before it ends (RingReleases).
//
// Why the waits end (no deadlock). Give every unit of work a number such that each wait of a
// unit points at a lower number, each role takes its units in increasing order, and no role
// holds back, while it waits, what a lower number needs (a writer signals the chunks it stored
// before it waits for a credit: writer_acquire's flush; a reader sends the credits of what it
// has read before it waits for a peer). Then by induction every unit with a lower number is
// done when a unit waits, and its waits end. The numbers:
//   dispatch (receive path) and dispatch_direct: an own chunk c has key c, a forwarded chunk c
//     key c + L, L = slots / 2 of its rings < slots (SendUnits, DirectUnits: the send roles take units
//     in key order). A reader reads chunk index j of every source once the units of keys up to
//     j + L are produced (its expand warps take (source, chunk) pairs chunk-major), so a credit
//     wait for chunk c >= slots waits for the reading of chunk c - slots by the destinations
//     (keys up to c - slots + L < c) or, for staged, for the forwarder's unit of key
//     c - slots + L < c; a forwarded chunk's arrival waits for its source's own chunk c (key c).
//   combine (receive path) and combine_direct: host(k) = 3k (an expert host stores and signals
//     its partials of chunk k), fwd(k) = 3k + 1 (a forwarder reads a forwarded chunk's
//     partials, sums and puts them), own(k) = 3(k + lag) + 2 (the source reads and sums chunk
//     k), lag = min(blocks, slots - 1): own chunk k comes after the forwarded chunks up to k + lag
//     (SourceSideChunks). host(k) waits for the credit of own(k - slots) <= 3k - 1 (partial) or
//     of fwd(k - slots) = 3k - 3 slots + 1 (forward); fwd(k) for host(k) and for the credit of
//     own(k - slots) <= 3k - 1 (node_part); own(k) for host(k) and fwd(k). The host warps walk
//     (source, chunk) chunk-major, the source load warp a forwarded chunk k before own chunk
//     k - lag. The direct combine has no host side: only fwd and own.
// Waits inside a block (its own rings, kernels/pipeline.cuh) are freed by its own roles'
// progress on lower numbers; the tests run every ring at 2 slots, where each turns over most.
#pragma once
#include "common/params.h"
#include "common/state.cuh"

namespace hybrid_ep {

// A tag is the call in the high bits and chunk + 1 in the low kRingTagChunkBits (common/params.h).
constexpr int64_t kTagMaxChunks = (int64_t{1} << kRingTagChunkBits) - 2;  // the largest chunk index a tag holds

// One ring family: a ring per (writer, reader) pair, `slots` chunk slots each.
struct PeerRing {
  int slots;
  int phase;       // Phase of the writer's wait for a free slot (the timeout record's)
  int read_phase;  // Phase of the reader's wait for a chunk's signal

  // A chunk index is below 2^24 (kRingTagChunkBits): a 32-bit remainder, where a 64-bit one is a
  // call to a division routine (and the spills around it) at every ring access.
  __host__ __device__ int slot(int64_t c) const {
    return static_cast<int>(static_cast<uint32_t>(c) % static_cast<uint32_t>(slots));
  }
  // Ring i's word of chunk c among the [rings][slots] words of a region, and row q of the
  // chunk's slot among its [rings][slots][kChunkTokens] rows.
  __host__ __device__ int64_t word(int64_t i, int64_t c) const { return i * slots + slot(c); }
  __host__ __device__ int64_t row(int64_t i, int64_t c, int q) const { return word(i, c) * kChunkTokens + q; }

  // What a slot's signal and credit words hold for chunk c of a call.
  __host__ __device__ static constexpr uint64_t tag(uint64_t call, int64_t c) {
    return call << kRingTagChunkBits | static_cast<uint64_t>(c + 1);
  }
  // The credit the writer of chunk c waits for: its slot's previous chunk was read.
  __device__ uint64_t freed(uint64_t call, int64_t c) const { return tag(call, c - slots); }

  // The writer: whether chunk c's slot is free by this reader's credit word, without waiting.
  __device__ bool is_free(const uint64_t* credit, uint64_t call, int64_t c) const {
    return c < slots || dev::ld_relaxed_sys(credit) >= freed(call, c);
  }
  // The writer: until this reader's credit frees chunk c's slot (bounded; names the reader in a
  // timeout record). Where this rank reads its own ring (its rail peer on its own node is
  // itself), the wait has twice the bound: the credit follows the rank's own progress, so the
  // wait that stalls that progress on another rank times out first and names the rank that is
  // missing. No fence: a writer that waits for several readers fences once after them
  // (acquired()).
  __device__ bool wait_free(const LaunchArgs& args, const uint64_t* credit, uint64_t call, int64_t c, int rank,
                            int reader) const {
    const uint32_t bounds = reader == rank ? 2 : 1;
    return c < slots || wait_at_least(args, credit, freed(call, c), phase, rank, reader, call, bounds);
  }
  // The writer, once every reader's credit was waited for: the readers' loads, before this
  // thread's bulk stores into the slot.
  __device__ static void acquired() { dev::fence_proxy_async(); }
  // The writer's acquire of chunk c's slot from one reader: what it holds first (flush: it
  // signals the chunks it stored, which the reader may need before it frees the slot) where the
  // credit is not there yet, then the bounded wait, then the fence. False on a stop.
  template <typename Flush>
  __device__ bool writer_acquire(const LaunchArgs& args, const uint64_t* credit, uint64_t call, int64_t c, int rank,
                                 int reader, Flush&& flush) const {
    if (c < slots) return true;
    if (!is_free(credit, call, c) && !flush()) return false;
    if (!wait_free(args, credit, call, c, rank, reader)) return false;
    acquired();
    return true;
  }

  // The writer, once chunk c's bytes in the slot landed: its signal word (NVLink), a release.
  __device__ static void publish(uint64_t* signal, uint64_t call, int64_t c) {
    dev::st_release_sys(signal, tag(call, c));
  }

  // The reader: whether chunk c's signal word says the writer published it, without waiting.
  __device__ static bool is_published(const uint64_t* signal, uint64_t call, int64_t c) {
    return dev::ld_relaxed_sys(signal) >= tag(call, c);
  }
  // The reader: until chunk c's signal word says the writer published it (bounded; names the
  // writer in a timeout record), then this thread has acquired what the writer released. Where
  // this rank writes the ring itself (bounds = 2), the wait that stalls that progress on another
  // rank times out first, as for wait_free. False on a stop.
  __device__ bool reader_wait(const LaunchArgs& args, const uint64_t* signal, uint64_t call, int64_t c, int rank,
                              int writer, uint32_t bounds = 1) const {
    return wait_at_least(args, signal, tag(call, c), read_phase, rank, writer, call, bounds);
  }
  // The same for a signal that puts deliver (staged, node_part), then the transport's
  // consistency step: what the puts before it wrote is visible to this thread's later reads
  // also through a proxy transport (transport/rdma.cuh, delivered).
  template <typename Rdma>
  __device__ bool reader_wait_delivered(const Rdma& rdma, const LaunchArgs& args, const uint64_t* signal, uint64_t call,
                                        int64_t c, int rank, int writer) const {
    if (!reader_wait(args, signal, call, c, rank, writer)) return false;
    rdma.delivered(signal, tag(call, c));
    return true;
  }
  // Another thread of the reader's, after the waiting thread saw chunk c published: its own
  // acquire of what the writer released.
  __device__ static void reader_acquire(const uint64_t* signal) { dev::ld_acquire_sys(signal); }

  // The reader, once it read chunk c whole (its loads landed): frees the slot through a peer
  // pointer (the writer's credit word, NVLink: a system-scope release).
  __device__ void reader_release(uint64_t* credit, uint64_t call, int64_t c) const {
    dev::st_release_sys(credit, tag(call, c));
  }
};

// The releases one reader thread sends over the transport (the staged and node_part rings):
// non-blocking with NVSHMEM, so the thread quiets them before it ends (DeferredReleases says
// why).
template <typename Rdma>
struct RingReleases {
  const Rdma& rdma;
  bool sent = false;

  __device__ explicit RingReleases(const Rdma& transport) : rdma(transport) {}
  RingReleases(const RingReleases&) = delete;
  // Chunk c read whole: the writer's credit word at `credit_off` in its RDMA region.
  __device__ void reader_release(int writer, uint64_t credit_off, uint64_t call, int64_t c) {
    rdma.signal(writer, credit_off, PeerRing::tag(call, c));
    sent = true;
  }
  // Every release sent so far has landed (also run when the thread leaves its role);
  // with_puts: the thread's puts too, where it made some (one quiet for both).
  __device__ void quiet(bool with_puts = false) {
    if (sent || with_puts) rdma.quiet();
    sent = false;
  }
  __device__ ~RingReleases() { quiet(); }
};

// The rings of a call, from its layout (common/params.h; sized by csrc/bindings/buffer_layout.h).
namespace peer_rings {
// A ring's two phases: the writer's wait for a free slot, the reader's for a chunk's signal.
__device__ inline PeerRing of(const RingLayout& r, Phase write, Phase read) {
  return PeerRing{static_cast<int>(r.slots), write, read};
}
__device__ inline PeerRing recv(const Geometry& g) { return of(g.reg.recv, kPhaseRecvRing, kPhaseDispatchRows); }
__device__ inline PeerRing staged(const Geometry& g) { return of(g.rdma.staged, kPhaseStagedRing, kPhaseRdmaRows); }
__device__ inline PeerRing partial(const Geometry& g) {
  return of(g.reg.partial, kPhasePartialRing, kPhaseCombineRows);
}
__device__ inline PeerRing forward(const Geometry& g) {
  return of(g.reg.forward, kPhaseForwardRing, kPhaseNodePartials);
}
__device__ inline PeerRing node_part(const Geometry& g) {
  return of(g.rdma.node_part, kPhaseNodePartRing, kPhaseRdmaPartials);
}
}  // namespace peer_rings

}  // namespace hybrid_ep
