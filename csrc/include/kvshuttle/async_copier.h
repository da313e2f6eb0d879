// AsyncCopier: host paged copies run in order on one native worker thread, each with a ticket the caller polls.
//
// Why: a packed read unpacks chunk i while it READs chunk i+1. On a Python thread pool every chunk paid two
// GIL hand-offs and two thread wake-ups on top of the copy (about 0.1 ms of CPU on a 2-vCPU VM, several times
// a small chunk's copy). Here the worker never takes the GIL: submit() queues the copy, CopyTicket::done() is one
// atomic load, and wait() sleeps on a condition variable with the GIL released by the binding.
//
// The caller keeps the cache and the staging bytes alive and unwritten until the ticket is done (the Python
// completion holds the copy's plan, which holds both); the block ids and plane table are copied into the job.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kvshuttle/paged_copy.h"

namespace kvshuttle {

class CopyTicket {
 public:
  bool done() const { return finished_.load(std::memory_order_acquire); }
  // Blocks up to timeout_s (call with the GIL released); whether the copy finished.
  bool wait(double timeout_s);
  // Seconds the copy took; rethrows the copy's error. Call only once done().
  double result() const;

 private:
  friend class AsyncCopier;
  void finish(double seconds, std::exception_ptr error);

  std::atomic<bool> finished_{false};
  double seconds_ = 0.0;
  std::exception_ptr error_;
  std::mutex mutex_;
  std::condition_variable cv_;
};

class AsyncCopier {
 public:
  AsyncCopier();
  ~AsyncCopier();
  AsyncCopier(const AsyncCopier&) = delete;
  AsyncCopier& operator=(const AsyncCopier&) = delete;

  // Queues one paged_copy_cpu; BackendError once closed.
  std::shared_ptr<CopyTicket> submit(const PagedCopySpec& spec, std::vector<uint64_t> plane_bases,
                                     std::vector<int64_t> ids, Direction direction);
  // Runs what is queued, then stops the worker (idempotent; call with the GIL released).
  void close();
  int64_t pending() const;

 private:
  struct Job {
    PagedCopySpec spec;
    std::vector<uint64_t> plane_bases;
    std::vector<int64_t> ids;
    Direction direction;
    std::shared_ptr<CopyTicket> ticket;
  };
  void run();

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool closing_ = false;
  std::thread worker_;
};

}  // namespace kvshuttle
