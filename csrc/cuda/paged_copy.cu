// CUDA pack/unpack: one launch covers every (block id, layer-plane) piece; one warp per piece.
// Vector width is the widest of 16/8/4/2/1 bytes that divides the row and every address and stride.
// Paged rows sit at token and head strides (dense NHD/HND blocks, or vLLM 0.32 pages whose planes interleave
// row by row); a piece that is dense in the staging order is copied as one run (the flat path).
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <string>

#include "cuda_check.h"
#include "kvshuttle/cuda_copy.h"
#include "kvshuttle/errors.h"
#include "upload_ring.h"

// Tuning knobs (compile-time): vectors in flight per lane, and streaming cache hints for one-touch data.
#ifndef KVSHUTTLE_CUDA_UNROLL
#define KVSHUTTLE_CUDA_UNROLL 4
#endif
#ifndef KVSHUTTLE_CUDA_CACHE_HINTS
#define KVSHUTTLE_CUDA_CACHE_HINTS 1
#endif

namespace kvshuttle {
namespace {

// 32-bit geometry for the index math in the kernel (every per-piece quantity fits).
struct KernelGeometry {
  uint32_t planes, block_size, num_heads, head_offset, staging_block_size, staging_heads, num_tokens;
  uint32_t row_vecs;  // vectors per row
  bool heads_inner;   // paged heads of a token are closer than tokens of a head (walk heads in the lanes)
  bool staged_nhd;
  uint64_t block_stride, token_stride, head_stride, unit_bytes, piece_bytes, row_bytes;
  char* staging;
};

template <typename Vec>
__device__ __forceinline__ Vec load_once(const Vec* p) { return *p; }
template <typename Vec>
__device__ __forceinline__ void store_once(Vec* p, Vec v) { *p = v; }
#if KVSHUTTLE_CUDA_CACHE_HINTS
template <>
__device__ __forceinline__ uint4 load_once<uint4>(const uint4* p) { return __ldcs(p); }
template <>
__device__ __forceinline__ void store_once<uint4>(uint4* p, uint4 v) { __stcs(p, v); }
#endif

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kUnroll = KVSHUTTLE_CUDA_UNROLL;  // vectors in flight per lane: loads issue before the stores

// One (block id, layer-plane) piece being copied.
struct Piece {
  char* paged;      // the paged block of this plane
  char* staged;     // the staging piece of unit i (flat path) or of this plane in unit 0 (general path)
  uint32_t first;   // first token of the piece in the copied sequence
  uint32_t ntok;    // tokens of this piece that are copied (the last block may be partial)
};

// Addresses of vector e of a piece on both sides.
template <typename Vec, bool kFlat>
__device__ __forceinline__ void locate(const KernelGeometry& g, const Piece& piece, uint32_t e, char*& paged,
                                       char*& staged) {
  if (kFlat) {  // same geometry on both sides: the piece is one contiguous run
    paged = piece.paged + uint64_t(e) * sizeof(Vec);
    staged = piece.staged + uint64_t(e) * sizeof(Vec);
    return;
  }
  const uint32_t v = e % g.row_vecs, row = e / g.row_vecs;
  // Walk rows in the paged side's order so consecutive lanes read the closest memory.
  uint32_t j, h;
  if (g.heads_inner) {
    h = row % g.staging_heads;
    j = row / g.staging_heads;
  } else {
    j = row % piece.ntok;
    h = row / piece.ntok;
  }
  const uint32_t t = piece.first + j, unit = t / g.staging_block_size, k = t % g.staging_block_size;
  const uint64_t paged_off = uint64_t(j) * g.token_stride + uint64_t(g.head_offset + h) * g.head_stride;
  const uint64_t staged_row = g.staged_nhd ? uint64_t(k) * g.staging_heads + h
                                           : uint64_t(h) * g.staging_block_size + k;
  paged = piece.paged + paged_off + v * sizeof(Vec);
  staged = piece.staged + uint64_t(unit) * g.unit_bytes + staged_row * g.row_bytes + v * sizeof(Vec);
}

// One warp per piece, pieces strided over a grid of about one wave: small pieces (4 KiB at TP8) would
// otherwise pay a CTA launch each, and large ones keep kUnroll vectors in flight per lane.
template <typename Vec, bool kPack, bool kFlat>
__global__ void __launch_bounds__(kThreads)
    paged_copy_kernel(KernelGeometry g, uint32_t items, const uint64_t* __restrict__ bases,
                      const int32_t* __restrict__ ids) {
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warps = gridDim.x * kWarpsPerBlock;
  for (uint32_t item = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32; item < items; item += warps) {
    const uint32_t i = item / g.planes, lp = item % g.planes;
    Piece piece;
    piece.paged = reinterpret_cast<char*>(bases[lp]) + static_cast<uint64_t>(ids[i]) * g.block_stride;
    piece.first = i * g.block_size;
    piece.ntok = min(g.block_size, g.num_tokens - piece.first);
    piece.staged = g.staging + uint64_t(lp) * g.piece_bytes + (kFlat ? uint64_t(i) * g.unit_bytes : 0);
    const uint32_t n = piece.ntok * g.staging_heads * g.row_vecs;
    for (uint32_t base = lane; base < n; base += 32 * kUnroll) {
      Vec values[kUnroll];
      char* targets[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t e = base + u * 32;
        if (e < n) {
          char *paged, *staged;
          locate<Vec, kFlat>(g, piece, e, paged, staged);
          values[u] = load_once(reinterpret_cast<const Vec*>(kPack ? paged : staged));
          targets[u] = kPack ? staged : paged;
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * 32 < n) store_once(reinterpret_cast<Vec*>(targets[u]), values[u]);
      }
    }
  }
}

// Streaming multiprocessors of the current device, read once per device (an attribute query per call costs
// more than a small launch).
int multiprocessors() {
  static std::array<std::atomic<int>, 64> counts{};
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  std::atomic<int>& count = counts[static_cast<size_t>(device) % counts.size()];
  int sms = device < static_cast<int>(counts.size()) ? count.load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    if (device < static_cast<int>(counts.size())) count.store(sms, std::memory_order_relaxed);
  }
  return sms;
}

// Blocks that fit on the whole GPU at once for this kernel: the grid-stride loop does the rest.
template <typename Kernel>
uint32_t one_wave_of_blocks(Kernel kernel) {
  static std::atomic<int> blocks_per_sm{0};  // per kernel instantiation; depends only on the architecture
  int per_sm = blocks_per_sm.load(std::memory_order_relaxed);
  if (per_sm == 0) {
    cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    blocks_per_sm.store(std::max(1, per_sm), std::memory_order_relaxed);
  }
  return static_cast<uint32_t>(multiprocessors() * std::max(1, per_sm));
}

template <typename Vec, bool kPack, bool kFlat>
void launch_one(const KernelGeometry& g, uint32_t items, const uint64_t* bases, const int32_t* ids,
                cudaStream_t stream) {
  auto kernel = paged_copy_kernel<Vec, kPack, kFlat>;
  const uint32_t wanted = (items + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const uint32_t grid = std::min(wanted, one_wave_of_blocks(kernel));
  kernel<<<grid, kThreads, 0, stream>>>(g, items, bases, ids);
}

template <typename Vec, bool kPack>
void launch(const KernelGeometry& g, bool flat, uint32_t items, const uint64_t* bases, const int32_t* ids,
            cudaStream_t stream) {
  if (flat) {
    launch_one<Vec, kPack, true>(g, items, bases, ids, stream);
  } else {
    launch_one<Vec, kPack, false>(g, items, bases, ids, stream);
  }
}

template <bool kPack>
void launch_widest(int width, const KernelGeometry& g, bool flat, uint32_t items, const uint64_t* bases,
                   const int32_t* ids, cudaStream_t stream) {
  switch (width) {
    case 16: return launch<uint4, kPack>(g, flat, items, bases, ids, stream);
    case 8: return launch<uint2, kPack>(g, flat, items, bases, ids, stream);
    case 4: return launch<uint32_t, kPack>(g, flat, items, bases, ids, stream);
    case 2: return launch<uint16_t, kPack>(g, flat, items, bases, ids, stream);
    default: return launch<uint8_t, kPack>(g, flat, items, bases, ids, stream);
  }
}

int widest_vector(const PagedCopySpec& s, const uint64_t* bases) {
  uint64_t bits = static_cast<uint64_t>(s.row_bytes) | static_cast<uint64_t>(s.block_stride) |
                  static_cast<uint64_t>(s.token_stride) | static_cast<uint64_t>(s.head_stride) | s.staging_addr;
  for (int64_t lp = 0; lp < s.num_planes(); ++lp) bits |= bases[lp];
  for (int width = 16; width > 1; width /= 2) {
    if ((bits & (width - 1)) == 0) return width;
  }
  return 1;
}

KernelGeometry kernel_geometry(const PagedCopySpec& spec, const uint64_t* plane_bases) {
  const int width = widest_vector(spec, plane_bases);
  KernelGeometry g{};
  g.planes = static_cast<uint32_t>(spec.num_planes());
  g.block_size = static_cast<uint32_t>(spec.block_size);
  g.num_heads = static_cast<uint32_t>(spec.num_heads);
  g.head_offset = static_cast<uint32_t>(spec.head_offset);
  g.staging_block_size = static_cast<uint32_t>(spec.staging_block_size);
  g.staging_heads = static_cast<uint32_t>(spec.staging_heads);
  g.num_tokens = static_cast<uint32_t>(spec.num_tokens);
  g.row_vecs = static_cast<uint32_t>(spec.row_bytes / width);
  g.heads_inner = spec.num_heads == 1 || (spec.block_size > 1 && spec.head_stride < spec.token_stride);
  g.staged_nhd = spec.staging_order == TokenOrder::NHD;
  g.block_stride = static_cast<uint64_t>(spec.block_stride);
  g.token_stride = static_cast<uint64_t>(spec.token_stride);
  g.head_stride = static_cast<uint64_t>(spec.head_stride);
  g.unit_bytes = static_cast<uint64_t>(spec.staging_unit_bytes());
  g.piece_bytes = static_cast<uint64_t>(spec.staging_piece_bytes());
  g.row_bytes = static_cast<uint64_t>(spec.row_bytes);
  g.staging = reinterpret_cast<char*>(spec.staging_addr);
  return g;
}

}  // namespace

void paged_copy_cuda(const PagedCopySpec& spec, const uint64_t* plane_bases,
                     int64_t num_plane_bases, const int64_t* ids, int64_t num_ids, Direction direction,
                     uint64_t stream_handle) {
  check_paged_copy(spec, plane_bases, num_plane_bases, ids, num_ids);
  const int64_t items = num_ids * spec.num_planes();
  if (items == 0) return;
  if (items > INT32_MAX || spec.num_tokens > INT32_MAX || spec.num_blocks > INT32_MAX) {
    throw LayoutError("kvshuttle CUDA paged copy: more than 2^31 pieces, tokens or blocks; split the copy "
                      "into calls of fewer blocks");
  }
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int64_t planes = spec.num_planes();
  const KernelGeometry g = kernel_geometry(spec, plane_bases);
  const int width = widest_vector(spec, plane_bases);
  // A partial last block is contiguous only in NHD order.
  const bool flat = spec.is_flat() &&
                    (spec.staging_order == TokenOrder::NHD || spec.num_tokens % spec.block_size == 0);

  // Plane table and block ids go through a pinned upload slot: no allocation and no pageable copy per call.
  const size_t table_bytes = planes * sizeof(uint64_t) + num_ids * sizeof(int32_t);
  UploadRing& ring = upload_ring_for_current_device();
  std::lock_guard<std::mutex> guard(ring.lock());
  UploadSlot& slot = ring.acquire(table_bytes);
  std::copy(plane_bases, plane_bases + planes, reinterpret_cast<uint64_t*>(slot.host));
  auto* host_ids = reinterpret_cast<int32_t*>(slot.host + planes * sizeof(uint64_t));
  for (int64_t i = 0; i < num_ids; ++i) host_ids[i] = static_cast<int32_t>(ids[i]);
  ring.upload(slot, table_bytes, stream);
  const auto* dev_bases = reinterpret_cast<const uint64_t*>(slot.device);
  const auto* dev_ids = reinterpret_cast<const int32_t*>(slot.device + planes * sizeof(uint64_t));
  cudaError_t err = cudaSuccess;
  try {
    if (direction == Direction::Pack) {
      launch_widest<true>(width, g, flat, static_cast<uint32_t>(items), dev_bases, dev_ids, stream);
    } else {
      launch_widest<false>(width, g, flat, static_cast<uint32_t>(items), dev_bases, dev_ids, stream);
    }
    err = cudaGetLastError();
  } catch (...) {
    ring.retire(slot, stream);  // the upload was enqueued: the slot waits for it either way
    throw;
  }
  ring.retire(slot, stream);
  cuda_check(err, "paged copy launch");
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

}  // namespace kvshuttle
