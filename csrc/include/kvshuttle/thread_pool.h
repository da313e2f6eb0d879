// A small persistent thread pool for memory-bound copies: static partitioning, caller participates.
#pragma once

#include <cstdint>
#include <functional>

namespace kvshuttle {

// Number of worker threads used by parallel_for (including the caller). Default: usable cores.
int num_threads();
void set_num_threads(int n);

// Runs fn(begin, end) over [0, n) split into num_threads() contiguous chunks; rethrows the first error.
// Concurrent callers are serialized.
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace kvshuttle
