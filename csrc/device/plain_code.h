// Blocks of plain code that a kernel names for the CPU model's timing, where the device layer's
// accessors (dev::ld, dev::st) and pair conversions do not show what runs: a loop of compares,
// integer divisions, ballots and their bookkeeping. The kernel says which blocks ran and how
// many times each (dev::plain_code, one call per stretch of code); what a block costs, its warp
// instructions per lane counted on the kernel's SASS, is a constant of the timing model
// (HYBRID_EP_TIMING_COSTS in device/model/timing.h, valued in the timing tables of
// tools/timing/), so no kernel carries an instruction count. dev::plain_code is nothing on the
// GPU.
#pragma once

namespace hybrid_ep::dev {

// One per block; the timing model's constant of each is named in its comment.
enum class PlainCode : int {
  kCountTile = 0,    // count_tile_instructions: a tile of the count kernel, once
  kCountRoute,       // count_route_instructions: per route of the tile's token
  kCountRoutePair,   // count_route_pair_instructions: per pair of the token's routes
  kCountDest,        // count_dest_instructions: per destination rank
  kCountNode,        // count_node_instructions: per destination node
  kCountScanColumn,  // count_scan_column_instructions: per counter column a lane scans
  // bounded_vector_instructions and bounded_vector_ns: per vector a reducer thread adds in a loop
  // with a uniform branch around each vector's load and one around its add (a part narrower than
  // the straight block takes, kernels/segments.cuh), beyond the vector's accesses and pairs
  kBoundedVector,
};

// A block of plain code and how many times it ran.
struct PlainRun {
  PlainCode code;
  int times;
};

}  // namespace hybrid_ep::dev
