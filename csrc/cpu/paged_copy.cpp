// CPU pack/unpack: one work item per (block id, layer-plane), split over the thread pool.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include "kvshuttle/cpu_copy.h"
#include "kvshuttle/lane_tuner.h"
#include "kvshuttle/thread_pool.h"

#include "run_copier.h"

namespace kvshuttle {
namespace {

// Copies into memory that is not read again soon bypass the cache (non-temporal stores): skipping the
// read-for-ownership saves a third of the memory traffic, and the cache keeps what is read next. An unpack's
// destination is the paged cache: always streamed, so a packed read's next staging chunk stays cached (2 MiB
// chunks with no protocol: 8.91 against 7.35 GB/s, benchmarks/results/history/vm3_packed_bound.json). A pack's is
// a staging chunk the transport reads next: streamed only when too large to stay cached anyway.
constexpr int64_t kDefaultStreamingMinBytes[2] = {16 << 20, 0};  // by Direction: Pack, Unpack
std::atomic<int64_t> g_streaming_min_bytes[2] = {kDefaultStreamingMinBytes[0], kDefaultStreamingMinBytes[1]};

int direction_index(Direction direction) { return direction == Direction::Pack ? 0 : 1; }

// Lanes (csrc/cpu/run_copier.h) by Direction: fixed by set_copy_lanes, else (0) chosen by lane_tuner(), which
// starts from the prior: 4 for packs (their sources are scattered), 1 for unpacks (they read staging in order).
std::atomic<int> g_fixed_lanes[2] = {0, 0};
constexpr int kPriorLanes[2] = {RunCopier::kLanes, 1};
// Copies shorter than this are not timed for the tuner: a thread wake-up (tens of microseconds on a VM) would
// be a large part of their time.
constexpr int64_t kTimedMinBytes = 4 << 20;

using Copier = RunCopier;

// A second thread pays off only for copies of a few MiB: waking it costs tens of microseconds on a VM, about
// what one thread copies in 1 MiB, and a packed read copies its chunks while the other core runs the READ.
constexpr int64_t kDefaultBytesPerThread = 2 << 20;
std::atomic<int64_t> g_bytes_per_thread{kDefaultBytesPerThread};

int threads_for(int64_t nbytes) {
  const int64_t per = g_bytes_per_thread.load(std::memory_order_relaxed);
  return per <= 0 ? 1 << 30 : static_cast<int>(std::clamp<int64_t>(nbytes / per, 1, 1 << 30));
}

// The pieces of one block in the planes of one layer that an item copies together: a vLLM 0.32 FlashAttention
// page interleaves K and V rows, so copying both planes row by row reads the page in order.
constexpr int64_t kMaxGroupPlanes = 2;
struct PlaneGroup {
  int64_t count = 0;
  char* paged[kMaxGroupPlanes] = {};
  char* staged[kMaxGroupPlanes] = {};
};

// Whether every row of the group can be streamed straight away (RunCopier::rows_streamable on both sides'
// alignments: row starts differ by multiples of the strides).
inline bool lanes_fit(const PagedCopySpec& s, const PlaneGroup& g, const Copier& copy) {
  uintptr_t bits = static_cast<uintptr_t>(s.token_stride | s.head_stride | s.row_bytes);
  for (int64_t p = 0; p < g.count; ++p) {
    bits |= reinterpret_cast<uintptr_t>(g.paged[p]) | reinterpret_cast<uintptr_t>(g.staged[p]);
  }
  return copy.rows_streamable(bits, s.row_bytes);
}

// Row by row into HND staging (a vLLM 0.32 FlashAttention page: K and V rows interleaved), without queueing
// each row: one head's rows for each plane per lane, so the lanes read pages of up to kRowLanes heads at once.
template <Direction kDir>
void copy_rows_hnd(const PagedCopySpec& s, const PlaneGroup& g, int64_t j, int64_t k, int64_t len,
                   Copier& copy) {
  const int64_t R = s.row_bytes, Hs = s.staging_heads, h0 = s.head_offset, Bs = s.staging_block_size;
  const int64_t ts = s.token_stride, hs = s.head_stride;
  const int64_t heads_per_step = std::max<int64_t>(1, RunCopier::kRowLanes / g.count);
  char* dst[RunCopier::kRowLanes];
  const char* src[RunCopier::kRowLanes];
  for (int64_t h = 0; h < Hs; h += heads_per_step) {
    const int64_t nh = std::min(heads_per_step, Hs - h);
    for (int64_t t = 0; t < len; ++t) {
      int lanes = 0;
      for (int64_t dh = 0; dh < nh; ++dh) {
        for (int64_t p = 0; p < g.count; ++p, ++lanes) {
          char* paged = g.paged[p] + (j + t) * ts + (h0 + h + dh) * hs;
          char* staged = g.staged[p] + ((h + dh) * Bs + k + t) * R;
          dst[lanes] = kDir == Direction::Pack ? staged : paged;
          src[lanes] = kDir == Direction::Pack ? paged : staged;
        }
      }
      copy.copy_rows(dst, src, lanes, R);
    }
  }
}

// Copies tokens [j, j + len) of each paged piece of a group to slots [k, k + len) of its staging piece (or back),
// in the largest runs contiguous on both sides: whole token rows, a token's heads, a head's tokens, or single
// rows (then plane by plane for each row).
template <Direction kDir>
inline void copy_segment(const PagedCopySpec& s, const PlaneGroup& g, int64_t j, int64_t k, int64_t len,
                         Copier& copy) {
  const int64_t R = s.row_bytes, Hp = s.num_heads, Hs = s.staging_heads, h0 = s.head_offset;
  const int64_t Bs = s.staging_block_size, ts = s.token_stride, hs = s.head_stride;
  auto move = [&](int64_t p, int64_t paged_off, int64_t staged_off, int64_t n) {
    if (kDir == Direction::Pack) {
      copy(g.staged[p] + staged_off, g.paged[p] + paged_off, n);
    } else {
      copy(g.paged[p] + paged_off, g.staged[p] + staged_off, n);
    }
  };
  const bool heads_adjacent = Hs == 1 || hs == R;  // a token's copied heads are one paged run
  const bool tokens_adjacent = len == 1 || ts == R;  // a head's copied tokens are one paged run
  const bool nhd = s.staging_order == TokenOrder::NHD;
  const bool whole_rows = nhd && heads_adjacent && Hs == Hp && (len == 1 || ts == Hp * R);
  const bool runs = nhd ? heads_adjacent : tokens_adjacent;  // else row by row, below
  if (runs && !nhd) {
    // Head by head, each plane's run in turn: a vLLM 0.32 CPU_ATTN page (a head's K run, then its V run) is
    // read in order.
    for (int64_t h = 0; h < Hs; ++h) {
      for (int64_t p = 0; p < g.count; ++p) move(p, j * ts + (h0 + h) * hs, (h * Bs + k) * R, len * R);
    }
    return;
  }
  if (runs) {
    for (int64_t p = 0; p < g.count; ++p) {
      if (whole_rows) {
        move(p, j * ts + h0 * hs, k * Hs * R, len * Hs * R);  // whole token rows are contiguous on both sides
      } else if (Hs == 1 && tokens_adjacent) {
        move(p, j * ts + h0 * hs, k * R, len * R);
      } else {
        for (int64_t t = 0; t < len; ++t) move(p, (j + t) * ts + h0 * hs, (k + t) * Hs * R, Hs * R);
      }
    }
    return;
  }
  if (s.staging_order == TokenOrder::NHD) {
    for (int64_t t = 0; t < len; ++t) {
      for (int64_t h = 0; h < Hs; ++h) {
        for (int64_t p = 0; p < g.count; ++p) move(p, (j + t) * ts + (h0 + h) * hs, ((k + t) * Hs + h) * R, R);
      }
    }
  } else if (lanes_fit(s, g, copy)) {
    copy_rows_hnd<kDir>(s, g, j, k, len, copy);
  } else {
    // Head by head, each plane's rows in one strided run: staging rows are written in order, and a page's
    // interleaved rows are read in two passes over the same lines.
    for (int64_t h = 0; h < Hs; ++h) {
      for (int64_t p = 0; p < g.count; ++p) {
        char* paged = g.paged[p] + j * ts + (h0 + h) * hs;
        char* staged = g.staged[p] + (h * Bs + k) * R;
        if (kDir == Direction::Pack) {
          copy.copy_strided(staged, R, paged, ts, len, R);
        } else {
          copy.copy_strided(paged, ts, staged, R, len, R);
        }
      }
    }
  }
}

// The number of planes an item copies together (see PlaneGroup).
int64_t group_planes(const PagedCopySpec& s) {
  return s.planes_per_layer <= kMaxGroupPlanes ? s.planes_per_layer : 1;
}

template <Direction kDir>
void copy_items(const PagedCopySpec& s, const uint64_t* bases, const int64_t* ids, int64_t begin,
                int64_t end, Copier& copy) {
  const int64_t group = group_planes(s), groups = s.num_planes() / group;
  const int64_t unit_bytes = s.staging_unit_bytes(), piece_bytes = s.staging_piece_bytes();
  char* staging = reinterpret_cast<char*>(s.staging_addr);
  const bool flat = s.is_flat();
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item / groups, lp0 = (item % groups) * group;
    const int64_t first = i * s.block_size;
    const int64_t ntok = std::min(s.block_size, s.num_tokens - first);
    if (flat && (ntok == s.block_size || s.staging_order == TokenOrder::NHD)) {
      const int64_t n = ntok * s.num_heads * s.row_bytes;
      for (int64_t lp = lp0; lp < lp0 + group; ++lp) {
        char* paged = reinterpret_cast<char*>(bases[lp]) + ids[i] * s.block_stride;
        char* staged = staging + i * unit_bytes + lp * piece_bytes;
        if (kDir == Direction::Pack) copy(staged, paged, n); else copy(paged, staged, n);
      }
      continue;
    }
    for (int64_t j = 0; j < ntok;) {
      const int64_t t = first + j, unit = t / s.staging_block_size, k = t % s.staging_block_size;
      const int64_t len = std::min(ntok - j, s.staging_block_size - k);
      PlaneGroup g;
      g.count = group;
      for (int64_t p = 0; p < group; ++p) {
        g.paged[p] = reinterpret_cast<char*>(bases[lp0 + p]) + ids[i] * s.block_stride;
        g.staged[p] = staging + unit * unit_bytes + (lp0 + p) * piece_bytes;
      }
      copy_segment<kDir>(s, g, j, k, len, copy);
      j += len;
    }
  }
}

}  // namespace

void paged_copy_cpu(const PagedCopySpec& spec, const uint64_t* plane_bases,
                    int64_t num_plane_bases, const int64_t* ids, int64_t num_ids, Direction direction) {
  check_paged_copy(spec, plane_bases, num_plane_bases, ids, num_ids);
  const int64_t total_bytes = spec.num_tokens * spec.staging_heads * spec.row_bytes * spec.num_planes();
  const int d = direction_index(direction);
  const bool streaming = total_bytes >= g_streaming_min_bytes[d].load(std::memory_order_relaxed);
  const int threads = std::min(threads_for(total_bytes), num_threads());
  int lanes = g_fixed_lanes[d].load(std::memory_order_relaxed);
  const bool timed = streaming && lanes == 0 && total_bytes >= kTimedMinBytes;
  const CopyShape shape = CopyShape::of(spec, direction, threads);
  if (lanes == 0) lanes = streaming ? lane_tuner().choose(shape, kPriorLanes[d], timed) : kPriorLanes[d];
  const auto start = std::chrono::steady_clock::now();
  parallel_for(num_ids * (spec.num_planes() / group_planes(spec)), [&](int64_t begin, int64_t end) {
    Copier copy(streaming, lanes);
    if (direction == Direction::Pack) {
      copy_items<Direction::Pack>(spec, plane_bases, ids, begin, end, copy);
    } else {
      copy_items<Direction::Unpack>(spec, plane_bases, ids, begin, end, copy);
    }
    copy.flush();
    if (streaming) store_fence();
  }, threads);
  if (timed) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    lane_tuner().record(shape, lanes, seconds > 0 ? static_cast<double>(total_bytes) / seconds : 0.0);
  }
}

int64_t streaming_min_bytes(Direction direction) { return g_streaming_min_bytes[direction_index(direction)].load(); }

void set_streaming_min_bytes(int64_t nbytes, Direction direction) {
  const int i = direction_index(direction);
  g_streaming_min_bytes[i].store(nbytes < 0 ? kDefaultStreamingMinBytes[i] : nbytes);
}

int copy_lanes(Direction direction) { return g_fixed_lanes[direction_index(direction)].load(); }

void set_copy_lanes(int lanes, Direction direction) {
  g_fixed_lanes[direction_index(direction)].store(std::clamp(lanes, 0, static_cast<int>(RunCopier::kLanes)));
}

int64_t bytes_per_thread() { return g_bytes_per_thread.load(); }

void set_bytes_per_thread(int64_t nbytes) {
  g_bytes_per_thread.store(nbytes < 0 ? kDefaultBytesPerThread : nbytes);
}

void parallel_memcpy(uint64_t dst, uint64_t src, int64_t nbytes) {
  parallel_for(nbytes, [&](int64_t begin, int64_t end) {
    std::memcpy(reinterpret_cast<char*>(dst) + begin, reinterpret_cast<const char*>(src) + begin,
                static_cast<size_t>(end - begin));
  }, threads_for(nbytes));
}

}  // namespace kvshuttle
