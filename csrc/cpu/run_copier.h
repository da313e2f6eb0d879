// RunCopier: copies a stream of disjoint runs (dst, src, n), streaming large copies past the cache, from one
// source page at a time or from several at once (lanes).
//
// Why lanes: pack reads pieces scattered over the cache. On a Xeon VM, one non-temporal copy loop reading one page
// at a time stalled at every 4 KiB page boundary (the hardware prefetcher stops there): a scattered 32 KiB piece
// ran at ~0.65x of a contiguous memcpy. Copying 64-byte lines from kLanes chunks in turn keeps kLanes page streams
// in flight (glibc's large memcpy does the same across 4 pages). Runs are queued until that many chunks of one
// length are waiting, so short runs (one 4 KiB TP8 piece) are interleaved too; rows of a vLLM 0.32 FlashAttention
// page (256 B) go 8 at a time through copy_rows. Lanes do not move in lockstep at equal offsets: page-aligned runs
// would then load and store addresses with the same low 12 bits back to back (see stream_lanes).
// Why one lane too: on one EPYC VM (vm5) one stream per run is faster for 32 KiB pieces and row-by-row pages (lanes
// still win for 4 KiB pieces), and an unpack reads its staging in order. Which to take is measured per kind of
// copy (kvshuttle/lane_tuner.h); with one lane a run streams whole, and strided rows go through copy_strided.
//
// Runs must not overlap each other (pack and unpack write disjoint bytes); call flush() before the bytes are
// read, then fence (store_fence) before another thread reads them.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#define KVSHUTTLE_HAVE_SSE2 1
#endif

namespace kvshuttle {

inline void store_fence() {
#ifdef KVSHUTTLE_HAVE_SSE2
  _mm_sfence();
#endif
}

class RunCopier {
 public:
  static constexpr int kLanes = 4;     // most queued chunks copied together (4 pages: as fast as 8, fewer streams)
  static constexpr int kRowLanes = 8;  // rows copied together by copy_rows (rows are short: more in flight)
  static constexpr int64_t kLine = 64;
  static constexpr int64_t kChunk = 4096;       // one source page per lane
  static constexpr int64_t kMinStreamed = 256;  // shorter runs: memcpy (a few lines gain nothing)

  // lanes: chunks copied together, 1..kLanes (1: each run in order, rows one at a time).
  RunCopier(bool streaming, int lanes)
      : streaming_(streaming), lanes_(lanes < 1 ? 1 : lanes > kLanes ? kLanes : lanes) {}
  RunCopier(const RunCopier&) = delete;
  RunCopier& operator=(const RunCopier&) = delete;
  ~RunCopier() { flush(); }

  void operator()(char* dst, const char* src, int64_t n) {
#ifdef KVSHUTTLE_HAVE_SSE2
    if (streaming_ && n >= kMinStreamed) {
      // Head and tail bytes outside whole destination lines go through memcpy: a non-temporal store to a
      // partly written line would cost a read of that line.
      const int64_t head = static_cast<int64_t>((kLine - (reinterpret_cast<uintptr_t>(dst) & (kLine - 1))) &
                                                (kLine - 1));
      if (head) std::memcpy(dst, src, static_cast<size_t>(head));
      dst += head, src += head, n -= head;
      const int64_t body = n & ~(kLine - 1);
      if (n > body) std::memcpy(dst + body, src + body, static_cast<size_t>(n - body));
      if (lanes_ == 1) {  // one stream: the whole run at once
        stream_run(dst, src, body);
        return;
      }
      for (int64_t off = 0; off < body; off += kChunk) {
        queue(dst + off, src + off, body - off < kChunk ? body - off : kChunk);
      }
      return;
    }
#endif
    std::memcpy(dst, src, static_cast<size_t>(n));
  }

  // Whether rows of n bytes at these addresses can go to copy_rows: streaming, whole lines, line-aligned
  // destinations.
  bool rows_streamable(uintptr_t dst_bits, int64_t n) const {
#ifdef KVSHUTTLE_HAVE_SSE2
    return streaming_ && lanes_ > 1 && n >= kLine && (n & (kLine - 1)) == 0 && (dst_bits & (kLine - 1)) == 0;
#else
    (void)dst_bits, (void)n;
    return false;
#endif
  }

  // Copies `rows` rows of n bytes, row r from src + r * src_stride to dst + r * dst_stride, one after another in
  // one tight loop (one lane: a vLLM 0.32 FlashAttention head's K rows, then its V rows from the same lines).
  void copy_strided(char* dst, int64_t dst_stride, const char* src, int64_t src_stride, int64_t rows, int64_t n) {
    flush();
#ifdef KVSHUTTLE_HAVE_SSE2
    if (streaming_ && n >= kLine && (n & (kLine - 1)) == 0 &&
        ((reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(dst_stride)) & (kLine - 1)) == 0) {
      for (int64_t r = 0; r < rows; ++r) stream_run(dst + r * dst_stride, src + r * src_stride, n);
      return;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) (*this)(dst + r * dst_stride, src + r * src_stride, n);
  }

  // Copies count (<= kRowLanes) rows of n bytes now, their lines in turn (see rows_streamable).
  void copy_rows(char* const* dst, const char* const* src, int count, int64_t n) {
    flush();
    for (int k = 0; k < count; ++k) dst_[k] = dst[k], src_[k] = src[k];
    length_ = n;
    count_ = count;
    flush();
  }

  // Copies every queued chunk.
  void flush() {
    if (count_ == 0) return;
#ifdef KVSHUTTLE_HAVE_SSE2
    switch (count_) {
      case 1: stream_run(dst_[0], src_[0], length_); break;
      case 2: stream_lanes<2>(); break;
      case 3: stream_lanes<3>(); break;
      case 4: stream_lanes<4>(); break;
      case 8: stream_lanes<8>(); break;
      case 5: stream_lanes<5>(); break;
      case 6: stream_lanes<6>(); break;
      case 7: stream_lanes<7>(); break;
      default: stream_lanes<kRowLanes>(); break;
    }
#endif
    count_ = 0;
  }

 private:
  void queue(char* dst, const char* src, int64_t n) {
    if (count_ > 0 && n != length_) flush();  // lanes move in lockstep: one length per group
    dst_[count_] = dst;
    src_[count_] = src;
    length_ = n;
    if (++count_ == lanes_) flush();
  }

#ifdef KVSHUTTLE_HAVE_SSE2
  // One 64-byte line to a line-aligned destination, past the cache.
  static void stream_line(char* dst, const char* src) {
    const __m128i* s = reinterpret_cast<const __m128i*>(src);
    __m128i* d = reinterpret_cast<__m128i*>(dst);
    const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
    const __m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
    _mm_stream_si128(d, a);
    _mm_stream_si128(d + 1, b);
    _mm_stream_si128(d + 2, c);
    _mm_stream_si128(d + 3, e);
  }

  // n bytes (whole lines) in order.
  static void stream_run(char* dst, const char* src, int64_t n) {
    for (int64_t off = 0; off < n; off += kLine) stream_line(dst + off, src + off);
  }

  // One 64-byte line of each lane in turn; destinations are line-aligned, sources may be anywhere. Lane k starts
  // k/kCount of the way into its run and wraps around: lanes in lockstep at the same offset touch addresses
  // with the same low 12 bits (page-aligned pieces), which the core treats as possible store-to-load
  // dependences (4K aliasing): on one EPYC VM that ran packs at 0.22-0.51x of memcpy, staggered 0.71-1.03x
  // (benchmarks/results/history/vm4_pack_cpu_before.json and vm4_pack_cpu.json).
  template <int kCount>
  void stream_lanes() {
    const int64_t lines = length_ / kLine;  // whole lines: operator() and copy_rows queue only those
    const int64_t step = lines / kCount > 0 ? lines / kCount : 1;
    int64_t next[kCount];
    for (int k = 0; k < kCount; ++k) next[k] = (k * step) % lines;
    for (int64_t i = 0; i < lines; ++i) {
      for (int k = 0; k < kCount; ++k) {
        const int64_t off = next[k] * kLine;
        next[k] = next[k] + 1 == lines ? 0 : next[k] + 1;
        stream_line(dst_[k] + off, src_[k] + off);
      }
    }
  }
#endif

  const bool streaming_;
  const int lanes_;
  char* dst_[kRowLanes] = {};
  const char* src_[kRowLanes] = {};
  int64_t length_ = 0;
  int count_ = 0;
};

}  // namespace kvshuttle
