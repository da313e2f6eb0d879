#include "kvshuttle/thread_pool.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvshuttle {
namespace {

int usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

class ThreadPool {
 public:
  explicit ThreadPool(int threads) : size_(std::max(1, threads)) {
    for (int w = 1; w < size_; ++w) workers_.emplace_back([this, w] { worker_loop(w); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return size_; }

  void run(int64_t n, int max_threads, const std::function<void(int64_t, int64_t)>& fn) {
    if (n <= 0) return;
    const int chunks = static_cast<int>(std::min<int64_t>({size_, n, std::max(1, max_threads)}));
    if (chunks == 1) {
      fn(0, n);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &fn;
      job_n_ = n;
      job_chunks_ = chunks;
      pending_ = chunks - 1;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    run_chunk(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void run_chunk(int chunk) {
    const int64_t begin = job_n_ * chunk / job_chunks_;
    const int64_t end = job_n_ * (chunk + 1) / job_chunks_;
    try {
      (*job_)(begin, end);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
  }

  void worker_loop(int w) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (w >= job_chunks_) continue;  // fewer chunks than workers this time
      }
      run_chunk(w);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  const int size_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int job_chunks_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

std::mutex g_pool_mu;
int g_requested_threads = 0;  // 0: usable cores
std::shared_ptr<ThreadPool> g_pool;
pid_t g_pool_pid = 0;

// Callers hold a reference for the duration of a job, so set_num_threads never frees a busy pool.
std::shared_ptr<ThreadPool> pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  const int want = g_requested_threads > 0 ? g_requested_threads : usable_cores();
  if (g_pool_pid != getpid()) {
    // After fork() the workers do not exist in the child: abandon the parent's pool without joining.
    if (g_pool) new std::shared_ptr<ThreadPool>(std::move(g_pool));  // leaked on purpose
  }
  if (!g_pool || g_pool->size() != want) {
    g_pool = std::make_shared<ThreadPool>(want);
    g_pool_pid = getpid();
  }
  return g_pool;
}

}  // namespace

int num_threads() { return pool()->size(); }

void set_num_threads(int n) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  g_requested_threads = std::max(0, n);
}

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int max_threads) {
  pool()->run(n, max_threads, fn);
}

}  // namespace kvshuttle
