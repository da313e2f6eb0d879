#include "kvshuttle/async_copier.h"

#include <chrono>
#include <utility>

#include "kvshuttle/cpu_copy.h"
#include "kvshuttle/errors.h"

namespace kvshuttle {

bool CopyTicket::wait(double timeout_s) {
  if (done()) return true;
  std::unique_lock<std::mutex> lock(mutex_);
  const auto limit = std::chrono::duration<double>(timeout_s > 0 ? timeout_s : 0.0);
  return cv_.wait_for(lock, limit, [this] { return done(); });
}

double CopyTicket::result() const {
  if (!done()) throw BackendError("CopyTicket.result() called before the copy finished; check done() first");
  if (error_) std::rethrow_exception(error_);
  return seconds_;
}

void CopyTicket::finish(double seconds, std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);  // a waiter checks done() under this lock: no lost wake-up
    seconds_ = seconds;
    error_ = std::move(error);
    finished_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

AsyncCopier::AsyncCopier() : worker_([this] { run(); }) {}

AsyncCopier::~AsyncCopier() { close(); }

std::shared_ptr<CopyTicket> AsyncCopier::submit(const PagedCopySpec& spec, std::vector<uint64_t> plane_bases,
                                                std::vector<int64_t> ids, Direction direction) {
  auto ticket = std::make_shared<CopyTicket>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) throw BackendError("this AsyncCopier is closed: no copy can be queued");
    queue_.push_back(Job{spec, std::move(plane_bases), std::move(ids), direction, ticket});
  }
  cv_.notify_one();
  return ticket;
}

void AsyncCopier::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closing_ = true;
  }
  cv_.notify_one();
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
}

int64_t AsyncCopier::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(queue_.size());
}

void AsyncCopier::run() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return closing_ || !queue_.empty(); });
      if (queue_.empty()) return;  // closing, and everything queued ran
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    const auto start = std::chrono::steady_clock::now();
    std::exception_ptr error;
    try {
      paged_copy_cpu(job.spec, job.plane_bases.data(), static_cast<int64_t>(job.plane_bases.size()),
                     job.ids.data(), static_cast<int64_t>(job.ids.size()), job.direction);
    } catch (...) {
      error = std::current_exception();
    }
    job.ticket->finish(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), error);
  }
}

}  // namespace kvshuttle
