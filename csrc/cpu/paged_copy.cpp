// CPU pack/unpack: one work item per (block id, layer-plane), split over the thread pool.
#include <algorithm>
#include <cstring>

#include "kvshuttle/cpu_copy.h"
#include "kvshuttle/thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#define KVSHUTTLE_HAVE_SSE2 1
#endif

namespace kvshuttle {
namespace {

// Large copies bypass the cache (non-temporal stores): the destination is not read again soon, and
// skipping the read-for-ownership saves a third of the memory traffic. Small ones use memcpy.
constexpr int64_t kStreamingMinTotalBytes = 16 << 20;

inline void copy_streaming(char* dst, const char* src, int64_t n) {
#ifdef KVSHUTTLE_HAVE_SSE2
  while (n > 0 && (reinterpret_cast<uintptr_t>(dst) & 15) != 0) {
    *dst++ = *src++;
    --n;
  }
  for (; n >= 64; n -= 64, src += 64, dst += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
  }
#endif
  if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n));
}

inline void store_fence() {
#ifdef KVSHUTTLE_HAVE_SSE2
  _mm_sfence();
#endif
}

struct Copier {
  bool streaming;
  inline void operator()(char* dst, const char* src, int64_t n) const {
    if (streaming && n >= 256) {
      copy_streaming(dst, src, n);
    } else {
      std::memcpy(dst, src, static_cast<size_t>(n));
    }
  }
};

// Copies tokens [j, j + len) of one paged piece to slots [k, k + len) of one staging piece (or back), in the
// largest runs contiguous on both sides: whole token rows, a token's heads, a head's tokens, or single rows.
template <Direction kDir>
inline void copy_segment(const PagedCopySpec& s, char* paged, char* staged, int64_t j, int64_t k,
                         int64_t len, const Copier& copy) {
  const int64_t R = s.row_bytes, Hp = s.num_heads, Hs = s.staging_heads, h0 = s.head_offset;
  const int64_t Bs = s.staging_block_size, ts = s.token_stride, hs = s.head_stride;
  auto move = [&](int64_t paged_off, int64_t staged_off, int64_t n) {
    if (kDir == Direction::Pack) {
      copy(staged + staged_off, paged + paged_off, n);
    } else {
      copy(paged + paged_off, staged + staged_off, n);
    }
  };
  const bool heads_adjacent = Hs == 1 || hs == R;  // a token's copied heads are one paged run
  const bool tokens_adjacent = len == 1 || ts == R;  // a head's copied tokens are one paged run
  if (s.staging_order == TokenOrder::NHD) {
    if (heads_adjacent && Hs == Hp && (len == 1 || ts == Hp * R)) {
      move(j * ts + h0 * hs, k * Hs * R, len * Hs * R);  // whole token rows are contiguous on both sides
    } else if (Hs == 1 && tokens_adjacent) {
      move(j * ts + h0 * hs, k * R, len * R);
    } else if (heads_adjacent) {
      for (int64_t t = 0; t < len; ++t) move((j + t) * ts + h0 * hs, (k + t) * Hs * R, Hs * R);
    } else {
      for (int64_t t = 0; t < len; ++t) {
        for (int64_t h = 0; h < Hs; ++h) move((j + t) * ts + (h0 + h) * hs, ((k + t) * Hs + h) * R, R);
      }
    }
  } else if (tokens_adjacent) {
    for (int64_t h = 0; h < Hs; ++h) move(j * ts + (h0 + h) * hs, (h * Bs + k) * R, len * R);
  } else {
    for (int64_t t = 0; t < len; ++t) {
      for (int64_t h = 0; h < Hs; ++h) move((j + t) * ts + (h0 + h) * hs, (h * Bs + k + t) * R, R);
    }
  }
}

template <Direction kDir>
void copy_items(const PagedCopySpec& s, const uint64_t* bases, const int64_t* ids, int64_t begin,
                int64_t end, const Copier& copy) {
  const int64_t planes = s.num_planes();
  const int64_t unit_bytes = s.staging_unit_bytes(), piece_bytes = s.staging_piece_bytes();
  char* staging = reinterpret_cast<char*>(s.staging_addr);
  const bool flat = s.is_flat();
  for (int64_t item = begin; item < end; ++item) {
    const int64_t i = item / planes, lp = item % planes;
    char* paged = reinterpret_cast<char*>(bases[lp]) + ids[i] * s.block_stride;
    const int64_t first = i * s.block_size;
    const int64_t ntok = std::min(s.block_size, s.num_tokens - first);
    if (flat && (ntok == s.block_size || s.staging_order == TokenOrder::NHD)) {
      char* staged = staging + i * unit_bytes + lp * piece_bytes;
      const int64_t n = ntok * s.num_heads * s.row_bytes;
      if (kDir == Direction::Pack) copy(staged, paged, n); else copy(paged, staged, n);
      continue;
    }
    for (int64_t j = 0; j < ntok;) {
      const int64_t t = first + j, unit = t / s.staging_block_size, k = t % s.staging_block_size;
      const int64_t len = std::min(ntok - j, s.staging_block_size - k);
      copy_segment<kDir>(s, paged, staging + unit * unit_bytes + lp * piece_bytes, j, k, len, copy);
      j += len;
    }
  }
}

}  // namespace

void paged_copy_cpu(const PagedCopySpec& spec, const uint64_t* plane_bases,
                    int64_t num_plane_bases, const int64_t* ids, int64_t num_ids, Direction direction) {
  check_paged_copy(spec, plane_bases, num_plane_bases, ids, num_ids);
  const int64_t total_bytes = spec.num_tokens * spec.staging_heads * spec.row_bytes * spec.num_planes();
  const Copier copy{total_bytes >= kStreamingMinTotalBytes};
  parallel_for(num_ids * spec.num_planes(), [&](int64_t begin, int64_t end) {
    if (direction == Direction::Pack) {
      copy_items<Direction::Pack>(spec, plane_bases, ids, begin, end, copy);
    } else {
      copy_items<Direction::Unpack>(spec, plane_bases, ids, begin, end, copy);
    }
    if (copy.streaming) store_fence();
  });
}

void parallel_memcpy(uint64_t dst, uint64_t src, int64_t nbytes) {
  parallel_for(nbytes, [&](int64_t begin, int64_t end) {
    std::memcpy(reinterpret_cast<char*>(dst) + begin, reinterpret_cast<const char*>(src) + begin,
                static_cast<size_t>(end - begin));
  });
}

}  // namespace kvshuttle
