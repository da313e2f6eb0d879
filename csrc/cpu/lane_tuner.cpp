// LaneTuner (kvshuttle/lane_tuner.h).
#include "kvshuttle/lane_tuner.h"

#include <algorithm>

namespace kvshuttle {
namespace {

int candidate_index(int lanes) { return lanes == LaneTuner::kCandidates[0] ? 0 : 1; }

double median(std::deque<double> rates) {
  if (rates.empty()) return 0.0;
  std::sort(rates.begin(), rates.end());
  const std::size_t n = rates.size();
  return n % 2 ? rates[n / 2] : (rates[n / 2 - 1] + rates[n / 2]) / 2;
}

}  // namespace

CopyShape CopyShape::of(const PagedCopySpec& s, Direction direction, int threads) {
  CopyShape c;
  c.direction = direction;
  c.block_size = s.block_size, c.num_heads = s.num_heads, c.token_stride = s.token_stride;
  c.head_stride = s.head_stride, c.planes_per_layer = s.planes_per_layer;
  c.staging_block_size = s.staging_block_size, c.staging_heads = s.staging_heads, c.row_bytes = s.row_bytes;
  c.staging_order = s.staging_order;
  c.threads = threads;
  return c;
}

bool CopyShape::operator==(const CopyShape& o) const {
  return direction == o.direction && block_size == o.block_size && num_heads == o.num_heads &&
         token_stride == o.token_stride && head_stride == o.head_stride && planes_per_layer == o.planes_per_layer &&
         staging_block_size == o.staging_block_size && staging_heads == o.staging_heads &&
         row_bytes == o.row_bytes && staging_order == o.staging_order && threads == o.threads;
}

LaneTuner::Entry* LaneTuner::find(const CopyShape& shape, int prior) {
  for (Entry& e : entries_) {
    if (e.shape == shape) return &e;
  }
  if (entries_.size() >= kMaxShapes) return nullptr;
  entries_.push_back(Entry{});
  entries_.back().shape = shape;
  entries_.back().prior = prior;
  return &entries_.back();
}

// The candidate with the higher median; the prior until both are measured.
int LaneTuner::best(const Entry& e) {
  if (e.rates[0].empty() || e.rates[1].empty()) return e.prior;
  return median(e.rates[0]) >= median(e.rates[1]) ? kCandidates[0] : kCandidates[1];
}

int LaneTuner::choose(const CopyShape& shape, int prior, bool timed) {
  std::lock_guard<std::mutex> lock(mutex_);
  Entry* e = find(shape, prior);
  if (e == nullptr) return prior;
  if (!timed) return best(*e);
  ++e->decisions;
  const int first = candidate_index(e->prior), second = 1 - first;
  if (e->timed[first] < kWarmup || e->timed[second] < kWarmup) {
    return kCandidates[e->timed[first] <= e->timed[second] ? first : second];  // alternate, the prior first
  }
  const int faster = best(*e);
  if (explore_every_ > 0 && e->decisions % explore_every_ == 0) {
    return faster == kCandidates[0] ? kCandidates[1] : kCandidates[0];
  }
  return faster;
}

void LaneTuner::record(const CopyShape& shape, int lanes, double bytes_per_second) {
  if (!(bytes_per_second > 0)) return;
  std::lock_guard<std::mutex> lock(mutex_);
  Entry* e = find(shape, lanes);
  if (e == nullptr) return;
  const int i = candidate_index(lanes);
  e->rates[i].push_back(bytes_per_second);
  if (e->rates[i].size() > static_cast<std::size_t>(kWindow)) e->rates[i].pop_front();
  ++e->timed[i];
}

std::vector<LaneTuning> LaneTuner::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<LaneTuning> out;
  for (const Entry& e : entries_) {
    LaneTuning t;
    t.shape = e.shape;
    t.lanes = best(e);
    t.decisions = e.decisions;
    for (int i = 0; i < 2; ++i) {
      t.timed.push_back(e.timed[i]);
      t.median_gbps.push_back(median(e.rates[i]) / 1e9);
    }
    out.push_back(std::move(t));
  }
  return out;
}

void LaneTuner::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.clear();
}

LaneTuner& lane_tuner() {
  static LaneTuner tuner;
  return tuner;
}

}  // namespace kvshuttle
