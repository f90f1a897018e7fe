// A self-test of the NVSHMEM transport (transport/nvshmem.cuh) between real processes: each
// PE sends a known pattern to the next PE (rank + 1 mod n) through the transport contract,
// half with put_signal, half with put + fence + signal, and a put_signal of 0 bytes (a signal
// alone, as the kernels send for a chunk without rows), then waits for its own three signals
// with a bounded wait and checks the bytes it received from the previous PE.
#pragma once
#include <cstdint>
#include <vector>

namespace hybrid_ep::nvshmem_selftest {

struct Result {
  int32_t mismatches;  // 32-bit words of the received pattern that differ
  int32_t first_bad;   // index of the first such word, -1 when none
  int32_t timed_out;   // 1 when a signal did not arrive within the timeout
  int32_t pad;
  uint64_t signal_put;     // observed value of the put_signal word
  uint64_t signal_fenced;  // observed value of the put + fence + signal word
  uint64_t signal_empty;   // observed value of the 0-byte put_signal's word
};

// Bytes of the symmetric region one call needs for `bytes` of pattern (a multiple of 32).
uint64_t region_bytes(uint64_t bytes);

// Zeroes this PE's region (signal words included: nvshmem_malloc does not clear them). Every
// PE clears its own and then waits for the others (the caller's barrier) before the first run.
void clear(uint64_t region, uint64_t bytes, uint64_t stream);

// Runs the exchange on `stream` and waits for it. `region` is this PE's address of a symmetric
// allocation of region_bytes(bytes); `pes[r]` is the PE of rank r; `call` must grow from one
// call to the next and be the same on every PE; the PEs must not start call e + 1 before every
// PE finished call e (the caller's barrier).
Result run(uint64_t region, const std::vector<int32_t>& pes, int rank, uint64_t bytes, uint64_t call,
           uint64_t timeout_ns, uint64_t stream);

}  // namespace hybrid_ep::nvshmem_selftest
