#include <stdexcept>
#include <string>
#include <vector>

#include "kvshuttle/errors.h"
#include "kvshuttle/paged_copy.h"

namespace kvshuttle {
namespace {
// The raw entry points' checks: the Python layer checked the same first, so a failure here is a caller that
// built a PagedCopySpec by hand. Each names the field; rebuild the spec with CopyPlan.native_spec().
template <typename Error>
void require(bool ok, const std::string& what) {
  if (!ok) throw Error("kvshuttle paged copy: " + what);
}
}  // namespace

void check_paged_copy(const PagedCopySpec& s, const uint64_t* plane_bases, int64_t num_plane_bases,
                      const int64_t* ids, int64_t num_ids) {
  require<LayoutError>(s.num_layers > 0 && (s.planes_per_layer == 1 || s.planes_per_layer == 2),
                       "need num_layers > 0 and 1 or 2 planes per layer");
  require<LayoutError>(num_plane_bases == s.num_planes(),
                       "plane table has " + std::to_string(num_plane_bases) + " entries, need " +
                           std::to_string(s.num_planes()) + " (one per layer and plane)");
  require<LayoutError>(s.block_size > 0 && s.staging_block_size > 0, "block sizes must be positive");
  require<LayoutError>(s.num_heads > 0 && s.staging_heads > 0 && s.row_bytes > 0,
                       "heads and row bytes must be positive");
  require<LayoutError>(s.head_offset >= 0 && s.head_offset + s.staging_heads <= s.num_heads,
                       "head slice [" + std::to_string(s.head_offset) + ", " +
                           std::to_string(s.head_offset + s.staging_heads) + ") outside the paged cache's " +
                           std::to_string(s.num_heads) + " heads");
  require<LayoutError>(s.block_stride >= 0 && s.token_stride >= 0 && s.head_stride >= 0,
                       "block_stride, token_stride and head_stride must be >= 0");
  require<LayoutError>(s.num_blocks <= 1 || s.block_stride >= s.row_bytes,
                       "block_stride smaller than one row: blocks would overlap");
  require<LayoutError>((s.block_size == 1 || s.token_stride >= s.row_bytes) &&
                           (s.num_heads == 1 || s.head_stride >= s.row_bytes),
                       "token_stride and head_stride must be at least row_bytes (rows would overlap)");
  require<LayoutError>(s.num_blocks >= 0, "num_blocks must be >= 0");
  require<BlockIdError>(s.num_tokens >= 0, "num_tokens must be >= 0");
  const int64_t blocks_needed = (s.num_tokens + s.block_size - 1) / s.block_size;
  require<BlockIdError>(num_ids == blocks_needed,
                        std::to_string(num_ids) + " block ids for " + std::to_string(s.num_tokens) +
                            " tokens of block size " + std::to_string(s.block_size) + " (need " +
                            std::to_string(blocks_needed) + ": one per started block)");
  require<StagingError>(s.staging_bytes >= s.required_staging_bytes(),
                        "staging holds " + std::to_string(s.staging_bytes) + " bytes, need " +
                            std::to_string(s.required_staging_bytes()) + " (see staging_nbytes)");
  require<LayoutError>(num_ids == 0 || (plane_bases != nullptr && ids != nullptr), "null plane table or ids");
  std::vector<bool> seen(static_cast<size_t>(s.num_blocks), false);
  for (int64_t i = 0; i < num_ids; ++i) {
    const int64_t b = ids[i];
    require<BlockIdError>(b >= 0 && b < s.num_blocks, "block id " + std::to_string(b) + " outside [0, " +
                                                          std::to_string(s.num_blocks) + ")");
    require<BlockIdError>(!seen[static_cast<size_t>(b)],
                          "block id " + std::to_string(b) + " repeated (pass each block once)");
    seen[static_cast<size_t>(b)] = true;
  }
}

}  // namespace kvshuttle
