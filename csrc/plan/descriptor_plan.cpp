// Read planning in one pass over the pieces: compute both addresses, extend the open row or start one.
//
// Fast path: when every walk group is dense on both sides (its columns back to back inside a block, blocks
// back to back), the pieces of one id in one group are a single contiguous stretch on each side, and id
// i + 1 joins id i exactly when both sides' stretches step by one group. So ids split once into runs, and
// each group writes one row per run with no test inside the group: consecutive runs never join by
// construction. Only a group's first run may join the previous group's last row. Both paths write identical
// rows.
#include <string>
#include <vector>

#include "kvshuttle/descriptor_plan.h"
#include "kvshuttle/errors.h"

namespace kvshuttle {
namespace {

bool side_is_dense(const ReadPlanSpec& spec, const int64_t* walk_group_planes, const uint64_t* bases,
                   uint64_t block_stride) {
  const uint64_t per_group = static_cast<uint64_t>(spec.planes_per_walk_group);
  if (block_stride != per_group * spec.piece_bytes) return false;
  for (int64_t group = 0; group < spec.num_walk_groups; ++group) {
    const int64_t* planes = walk_group_planes + group * spec.planes_per_walk_group;
    for (int64_t k = 1; k < spec.planes_per_walk_group; ++k) {
      if (bases[planes[k]] != bases[planes[0]] + static_cast<uint64_t>(k) * spec.piece_bytes) return false;
    }
  }
  return true;
}

bool groups_are_dense(const ReadPlanSpec& spec, const int64_t* walk_group_planes, const uint64_t* local_bases,
                      const uint64_t* remote_bases) {
  return side_is_dense(spec, walk_group_planes, local_bases, spec.local_block_stride) &&
         side_is_dense(spec, walk_group_planes, remote_bases, spec.remote_block_stride);
}

// Runs of ids whose group stretches follow each other on both sides (dense groups only). Offsets are
// modulo 2^64 like the addresses, so the join test is the one the piece path makes.
struct IdRuns {
  std::vector<uint64_t> local_offset, remote_offset, bytes;  // per run, from a group's first column base

  IdRuns(const ReadPlanSpec& spec, const int64_t* local_ids, const int64_t* remote_ids, int64_t num_ids) {
    const uint64_t group = static_cast<uint64_t>(spec.planes_per_walk_group) * spec.piece_bytes;
    const uint64_t local_stride = spec.local_block_stride, remote_stride = spec.remote_block_stride;
    local_offset.reserve(static_cast<size_t>(num_ids));
    remote_offset.reserve(static_cast<size_t>(num_ids));
    bytes.reserve(static_cast<size_t>(num_ids));
    uint64_t local_end = 0, remote_end = 0;  // where the last run ends on each side
    for (int64_t i = 0; i < num_ids; ++i) {
      const uint64_t local = static_cast<uint64_t>(local_ids[i]) * local_stride;
      const uint64_t remote = static_cast<uint64_t>(remote_ids[i]) * remote_stride;
      if (i > 0 && local == local_end && remote == remote_end) {
        bytes.back() += group;
      } else {
        local_offset.push_back(local);
        remote_offset.push_back(remote);
        bytes.push_back(group);
      }
      local_end = local + group;
      remote_end = remote + group;
    }
  }
  int64_t size() const { return static_cast<int64_t>(bytes.size()); }
};

// The output arrays and the open row. A local object, so its fields stay in registers (were they
// members reached through `this`, every row store through uint64_t* could alias them).
struct RowWriter {
  uint64_t local_device, remote_device;
  uint64_t* local;
  uint64_t* remote;
  int64_t rows = 0;
  uint64_t local_end = 0, remote_end = 0;  // where row rows - 1 ends on each side

  void start(uint64_t local_addr, uint64_t remote_addr, uint64_t bytes) {
    uint64_t* l = local + 3 * rows;
    uint64_t* r = remote + 3 * rows;
    l[0] = local_addr, l[1] = bytes, l[2] = local_device;
    r[0] = remote_addr, r[1] = bytes, r[2] = remote_device;
    ++rows;
    local_end = local_addr + bytes;
    remote_end = remote_addr + bytes;
  }

  // Extends the open row when the segment starts where it ends on both sides, else starts a row.
  void add(uint64_t local_addr, uint64_t remote_addr, uint64_t bytes) {
    // One branch on the combined test: with sorted local ids the local test alone is often true and
    // unpredictable, while a join on both sides is rare (permuted ids) or nearly certain (contiguous).
    const bool joins = (rows > 0) & (local_addr == local_end) & (remote_addr == remote_end);
    if (joins) {
      local[3 * (rows - 1) + 1] += bytes;
      remote[3 * (rows - 1) + 1] += bytes;
      local_end += bytes;
      remote_end += bytes;
    } else {
      start(local_addr, remote_addr, bytes);
    }
  }
};

int64_t plan_dense(const ReadPlanSpec& spec, const int64_t* walk_group_planes, const uint64_t* local_bases,
                   const uint64_t* remote_bases, const IdRuns& runs, RowWriter& out) {
  const int64_t num_runs = runs.size();
  if (num_runs == 0) return 0;
  const uint64_t* local_offset = runs.local_offset.data();
  const uint64_t* remote_offset = runs.remote_offset.data();
  const uint64_t* bytes = runs.bytes.data();
  for (int64_t group = 0; group < spec.num_walk_groups; ++group) {
    const uint64_t local_base = local_bases[walk_group_planes[group * spec.planes_per_walk_group]];
    const uint64_t remote_base = remote_bases[walk_group_planes[group * spec.planes_per_walk_group]];
    out.add(local_base + local_offset[0], remote_base + remote_offset[0], bytes[0]);
    for (int64_t run = 1; run < num_runs; ++run) {
      out.start(local_base + local_offset[run], remote_base + remote_offset[run], bytes[run]);
    }
  }
  return out.rows;
}

int64_t plan_pieces(const ReadPlanSpec& spec, const int64_t* walk_group_planes, const uint64_t* local_bases,
                    const int64_t* local_ids, const uint64_t* remote_bases, const int64_t* remote_ids,
                    int64_t num_ids, RowWriter& out) {
  // Locals, not spec fields: a row store through uint64_t* could alias spec and force reloads.
  const uint64_t piece = spec.piece_bytes;
  const uint64_t local_stride = spec.local_block_stride, remote_stride = spec.remote_block_stride;
  const int64_t per_group = spec.planes_per_walk_group, num_walk_groups = spec.num_walk_groups;
  for (int64_t group = 0; group < num_walk_groups; ++group) {
    const int64_t* planes = walk_group_planes + group * per_group;
    for (int64_t i = 0; i < num_ids; ++i) {
      const uint64_t local_block = static_cast<uint64_t>(local_ids[i]) * local_stride;
      const uint64_t remote_block = static_cast<uint64_t>(remote_ids[i]) * remote_stride;
      for (int64_t k = 0; k < per_group; ++k) {
        out.add(local_bases[planes[k]] + local_block, remote_bases[planes[k]] + remote_block, piece);
      }
    }
  }
  return out.rows;
}

}  // namespace

bool read_ids_are_ready(const int64_t* local_ids, const int64_t* remote_ids, int64_t num_ids,
                        int64_t local_blocks, int64_t remote_blocks) {
  if (num_ids == 0) return true;
  // Unsigned compares reject negative ids too; `&` instead of `&&` keeps the loop free of branches.
  const uint64_t local_limit = static_cast<uint64_t>(local_blocks);
  const uint64_t remote_limit = static_cast<uint64_t>(remote_blocks);
  bool ready = (static_cast<uint64_t>(local_ids[0]) < local_limit) &
               (static_cast<uint64_t>(remote_ids[0]) < remote_limit);
  for (int64_t i = 1; i < num_ids; ++i) {
    ready &= (static_cast<uint64_t>(local_ids[i]) < local_limit) &
             (static_cast<uint64_t>(remote_ids[i]) < remote_limit) & (local_ids[i] > local_ids[i - 1]);
  }
  return ready && local_blocks >= 0 && remote_blocks >= 0;
}

void check_read_plan(const ReadPlanSpec& spec, const int64_t* walk_group_planes, int64_t num_walk_group_planes,
                     int64_t num_local_planes, int64_t num_remote_planes) {
  if (spec.num_walk_groups < 0 || spec.planes_per_walk_group <= 0 || spec.piece_bytes == 0) {
    throw LayoutError("read plan needs num_walk_groups >= 0, planes_per_walk_group > 0, piece_bytes > 0 "
                      "(build the spec from SideGeometry, as plan_read does)");
  }
  if (num_walk_group_planes != spec.num_walk_groups * spec.planes_per_walk_group) {
    throw LayoutError("walk group table has " + std::to_string(num_walk_group_planes) +
                      " entries, expected num_walk_groups * planes_per_walk_group");
  }
  for (int64_t k = 0; k < num_walk_group_planes; ++k) {
    const int64_t plane = walk_group_planes[k];
    if (plane < 0 || plane >= num_local_planes || plane >= num_remote_planes) {
      throw LayoutError("plane index " + std::to_string(plane) + " is outside the base tables (pass every "
                        "plane's base address on both sides)");
    }
  }
}

int64_t plan_read_descriptors(const ReadPlanSpec& spec, const int64_t* walk_group_planes,
                              const uint64_t* local_bases, const int64_t* local_ids,
                              const uint64_t* remote_bases, const int64_t* remote_ids, int64_t num_ids,
                              uint64_t* local_out, uint64_t* remote_out) {
  RowWriter out{spec.local_device, spec.remote_device, local_out, remote_out};
  if (groups_are_dense(spec, walk_group_planes, local_bases, remote_bases)) {
    const IdRuns runs(spec, local_ids, remote_ids, num_ids);
    return plan_dense(spec, walk_group_planes, local_bases, remote_bases, runs, out);
  }
  return plan_pieces(spec, walk_group_planes, local_bases, local_ids, remote_bases, remote_ids, num_ids, out);
}

}  // namespace kvshuttle
