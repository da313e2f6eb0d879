// LaneTuner: which lane count (csrc/cpu/run_copier.h) has streamed each kind of host copy fastest on this host.
//
// Why measured: reading 1 source page at a time or 4 pages in turn is a property of the host's prefetchers, and
// it flips between machines of one cloud kind and between shapes on one machine. On the vm4 EPYC VM, packs of
// 32 KiB pieces ran at 0.86x of memcpy with 1 lane and 0.76x with 4, TP8's 4 KiB pieces at 0.82x and 0.92x; on a
// Xeon VM lanes took scattered packs from 0.65x to memcpy speed (benchmarks/HISTORY.md, "RunCopier").
//
// The rules are transfer/path_model.py's (the auto path's model of direct against packed reads): per kind of copy
// (CopyShape: direction, geometry and threads, not size or addresses) the rates (bytes / wall seconds) of the
// last kWindow timed copies of each candidate; with fewer than kWarmup of some candidate, that one (the prior
// first); else the higher median, and every explore_every-th decision the other one again, so a host whose load
// changes is followed. Decisions are deterministic (counters, no randomness). Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "kvshuttle/paged_copy.h"

namespace kvshuttle {

// What decides how a copy streams: its direction, its geometry and the threads it runs on.
struct CopyShape {
  Direction direction = Direction::Pack;
  int64_t block_size = 0, num_heads = 0, token_stride = 0, head_stride = 0, planes_per_layer = 0;
  int64_t staging_block_size = 0, staging_heads = 0, row_bytes = 0;
  TokenOrder staging_order = TokenOrder::NHD;
  int threads = 1;

  static CopyShape of(const PagedCopySpec& spec, Direction direction, int threads);
  bool operator==(const CopyShape& o) const;
};

// One kind of copy's state, for telemetry and tests. Candidate i is LaneTuner::kCandidates[i].
struct LaneTuning {
  CopyShape shape;
  int lanes = 0;            // what the next copy would take without exploring
  int64_t decisions = 0;    // timed copies decided
  std::vector<int64_t> timed;       // per candidate: timed copies recorded
  std::vector<double> median_gbps;  // per candidate: median of the window (0: not measured)
};

class LaneTuner {
 public:
  static constexpr int kCandidates[2] = {1, 4};
  static constexpr int kWindow = 7;              // rates kept per candidate (as path_model.WINDOW)
  static constexpr int kWarmup = 3;              // timed copies of each candidate before the medians decide
  static constexpr int kExploreEvery = 16;       // as EngineConfig.auto_explore_every
  static constexpr std::size_t kMaxShapes = 64;  // kinds tracked; copies of further kinds take the prior

  explicit LaneTuner(int explore_every = kExploreEvery) : explore_every_(explore_every) {}

  // The lanes for a copy of `shape`. timed: the caller will record() it (counts as a decision, may explore);
  // untimed copies (too short to time well) take the best known without exploring. prior: the lanes before
  // any measurement.
  int choose(const CopyShape& shape, int prior, bool timed);
  // Folds one timed copy's rate into its shape's window (ignored when not positive).
  void record(const CopyShape& shape, int lanes, double bytes_per_second);
  std::vector<LaneTuning> snapshot() const;
  void reset();

 private:
  struct Entry {
    CopyShape shape;
    int prior = 1;
    int64_t decisions = 0;
    std::deque<double> rates[2];
    int64_t timed[2] = {0, 0};
  };
  Entry* find(const CopyShape& shape, int prior);  // nullptr when full; caller holds mutex_
  static int best(const Entry& e);

  const int explore_every_;
  mutable std::mutex mutex_;
  std::vector<Entry> entries_;
};

// The process's tuner, used by paged_copy_cpu.
LaneTuner& lane_tuner();

}  // namespace kvshuttle
