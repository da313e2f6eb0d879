// Read planning: NIXL descriptor rows (addr, len, dev) for both sides of a paged KV-cache read.
//
// Piece (column p, pair i) is local `local_bases[p] + local_ids[i] * local_block_stride`, read from
// `remote_bases[p] + remote_ids[i] * remote_block_stride`, `piece_bytes` long. A column is a plane of a
// layer, or a layer's page when its planes interleave in a block (kvshuttle/core/pages.py). Pieces are walked
//   for group in walk groups: for i in ids: for column in walk_group_planes[group]
// (the Python layer picks the walk groups and sorts ids so this is local address order) and a piece joins
// the previous descriptor when it starts exactly where that descriptor ends on both sides.
#pragma once

#include <cstdint>

namespace pybind11 {
class module_;
}

namespace kvshuttle {

struct ReadPlanSpec {
  int64_t num_walk_groups = 0;        // rows of the walk group table
  int64_t planes_per_walk_group = 0;  // columns per group: 1 when each is a separate region, more when they
                                      // interleave inside a block (a layer's K and V, or every layer's page)
  uint64_t piece_bytes = 0;     // bytes of one (plane, block) piece, equal on both sides
  uint64_t local_block_stride = 0;
  uint64_t remote_block_stride = 0;
  uint64_t local_device = 0;  // NIXL devId written in every local row
  uint64_t remote_device = 0;

  int64_t num_pieces(int64_t num_ids) const { return num_walk_groups * planes_per_walk_group * num_ids; }
};

// Writes at most spec.num_pieces(num_ids) rows of 3 uint64 to each of local_out and remote_out and
// returns how many it wrote (only those rows are touched). Every walk_group_planes entry must index both base
// tables (check_read_plan).
int64_t plan_read_descriptors(const ReadPlanSpec& spec, const int64_t* walk_group_planes,
                              const uint64_t* local_bases, const int64_t* local_ids,
                              const uint64_t* remote_bases, const int64_t* remote_ids, int64_t num_ids,
                              uint64_t* local_out, uint64_t* remote_out);

// True when the local ids rise strictly (sorted, no repeats) and both sides' ids are in range: the
// planner's input contract, checked in one pass so valid sorted ids need no Python-side checks.
bool read_ids_are_ready(const int64_t* local_ids, const int64_t* remote_ids, int64_t num_ids,
                        int64_t local_blocks, int64_t remote_blocks);

// Throws LayoutError (kvshuttle/errors.h) when the spec is inconsistent or a plane index is outside a base table.
// Ids only enter address arithmetic, never a memory access here, so they are not needed for safety.
void check_read_plan(const ReadPlanSpec& spec, const int64_t* walk_group_planes, int64_t num_walk_group_planes,
                     int64_t num_local_planes, int64_t num_remote_planes);

// Binds ReadPlanSpec and plan_read_descriptors (csrc/plan/plan_bindings.cpp).
void register_plan(pybind11::module_& m);

}  // namespace kvshuttle
