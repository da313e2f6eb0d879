// Paged KV <-> staging copies: the one parameter struct shared by the CPU and CUDA paths.
//
// A paged cache is `num_layers * planes_per_layer` planes (K and V, or one MLA latent plane). Plane `lp`
// holds block `b` at `plane_bases[lp] + b * block_stride`; inside a block, token j of head h is a row of
// `row_bytes` contiguous bytes at `j * token_stride + h * head_stride`. Dense NHD blocks
// ([block_size][num_heads][row], token_stride = num_heads * row_bytes, head_stride = row_bytes) and dense
// HND blocks ([num_heads][block_size][row]) are the common cases, copied in the largest runs; the planes of
// a layer may interleave row by row (vLLM 0.32 pages), the rows are then copied one by one.
//
// Staging is block-major and canonical (see docs/ARCHITECTURE.md):
//   staging[unit][layer][plane][piece],  piece = [staging_block_size][staging_heads][row] (NHD)
//                                              or [staging_heads][staging_block_size][row] (HND)
// Token t of the copied sequence lives in paged block ids[t / block_size] at slot t % block_size and in
// staging unit t / staging_block_size at slot t % staging_block_size. Paged heads
// [head_offset, head_offset + staging_heads) map to staging heads [0, staging_heads).
#pragma once

#include <cstdint>

namespace kvshuttle {

enum class TokenOrder : int32_t { NHD = 0, HND = 1 };
enum class Direction : int32_t { Pack = 0, Unpack = 1 };  // Pack: paged -> staging.

struct PagedCopySpec {
  // Paged side.
  int64_t num_layers = 0;
  int64_t planes_per_layer = 0;  // 2 (K, V) or 1 (MLA)
  int64_t num_blocks = 0;        // blocks per plane; ids must lie in [0, num_blocks)
  int64_t block_stride = 0;      // bytes between consecutive blocks of one plane
  int64_t block_size = 0;        // tokens per paged block
  int64_t num_heads = 0;         // heads per token in the paged cache
  int64_t head_offset = 0;       // first paged head copied (tensor-parallel shard)
  int64_t token_stride = 0;      // bytes between consecutive tokens of one head inside a block
  int64_t head_stride = 0;       // bytes between consecutive heads of one token inside a block
  // Staging side.
  uint64_t staging_addr = 0;
  int64_t staging_bytes = 0;
  int64_t staging_block_size = 0;  // tokens per staging unit
  int64_t staging_heads = 0;       // heads copied per token
  TokenOrder staging_order = TokenOrder::NHD;
  // Both sides.
  int64_t row_bytes = 0;   // head_size * element size
  int64_t num_tokens = 0;  // tokens copied; ids cover exactly ceil(num_tokens / block_size) blocks

  int64_t num_planes() const { return num_layers * planes_per_layer; }
  int64_t paged_piece_bytes() const { return block_size * num_heads * row_bytes; }
  int64_t staging_piece_bytes() const { return staging_block_size * staging_heads * row_bytes; }
  int64_t staging_unit_bytes() const { return num_planes() * staging_piece_bytes(); }
  int64_t num_units() const { return (num_tokens + staging_block_size - 1) / staging_block_size; }
  int64_t required_staging_bytes() const { return num_units() * staging_unit_bytes(); }
  // Whether paged blocks are dense in `o` (one contiguous [B][H][row] or [H][B][row] piece).
  bool paged_dense(TokenOrder o) const {
    const bool nhd = o == TokenOrder::NHD;
    const bool heads_dense = num_heads == 1 || head_stride == (nhd ? 1 : block_size) * row_bytes;
    const bool tokens_dense = block_size == 1 || token_stride == (nhd ? num_heads : 1) * row_bytes;
    return heads_dense && tokens_dense;
  }
  // One contiguous copy per piece: paged blocks dense in the staging order, same block size and heads.
  bool is_flat() const {
    return paged_dense(staging_order) && block_size == staging_block_size && num_heads == staging_heads &&
           head_offset == 0;
  }
};

// Throws LayoutError when the spec is inconsistent, BlockIdError when an id is out of range or repeated or the id
// count does not match num_tokens, StagingError when staging is too small (kvshuttle/errors.h).
// The Python layer validates first with named errors; this guards the raw native entry points.
// plane_bases must hold spec.num_planes() entries.
void check_paged_copy(const PagedCopySpec& spec, const uint64_t* plane_bases, int64_t num_plane_bases,
                      const int64_t* ids, int64_t num_ids);

}  // namespace kvshuttle
