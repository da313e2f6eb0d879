// A small cache of already-mapped row buffers for the read planner's outputs.
//
// A 196,608-row plan is 9.4 MB for both sides, and faulting fresh pages in costs ten times more than
// writing the rows; buffers of kPooledMinBytes or more are reused instead (up to kPoolMaxCachedBytes held).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

namespace kvshuttle {

constexpr size_t kPooledMinBytes = size_t{1} << 20;  // smaller arrays: plain numpy allocation
constexpr size_t kPoolMaxCachedBytes = size_t{64} << 20;
constexpr size_t kHeaderBytes = 64;  // capacity in front of the rows, keeps them cache-line aligned

class RowBufferPool {
 public:
  // Rows for at least `bytes`: the smallest cached buffer that fits, else a fresh one.
  uint64_t* acquire(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      size_t best = cached_.size();
      for (size_t i = 0; i < cached_.size(); ++i) {
        const bool fits = capacity(cached_[i]) >= bytes;
        if (fits && (best == cached_.size() || capacity(cached_[i]) < capacity(cached_[best]))) {
          best = i;
        }
      }
      if (best != cached_.size()) {
        uint64_t* rows = cached_[best];
        cached_bytes_ -= capacity(rows);
        cached_.erase(cached_.begin() + static_cast<std::ptrdiff_t>(best));
        return rows;
      }
    }
    char* raw = static_cast<char*>(std::aligned_alloc(kHeaderBytes, kHeaderBytes + round_up(bytes)));
    if (raw == nullptr) throw std::bad_alloc();
    *reinterpret_cast<size_t*>(raw) = round_up(bytes);
    return reinterpret_cast<uint64_t*>(raw + kHeaderBytes);
  }

  void release(uint64_t* rows) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_bytes_ + capacity(rows) <= kPoolMaxCachedBytes) {
        cached_bytes_ += capacity(rows);
        cached_.push_back(rows);
        return;
      }
    }
    std::free(reinterpret_cast<char*>(rows) - kHeaderBytes);
  }

 private:
  static size_t round_up(size_t bytes) { return (bytes + kHeaderBytes - 1) / kHeaderBytes * kHeaderBytes; }
  static size_t capacity(const uint64_t* rows) {
    return *reinterpret_cast<const size_t*>(reinterpret_cast<const char*>(rows) - kHeaderBytes);
  }

  std::mutex mutex_;
  std::vector<uint64_t*> cached_;
  size_t cached_bytes_ = 0;
};

// Never destroyed: arrays may outlive module teardown and still return their buffers.
inline RowBufferPool& row_pool() {
  static RowBufferPool* pool = new RowBufferPool();
  return *pool;
}

}  // namespace kvshuttle
