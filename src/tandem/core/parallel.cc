#include "tandem/core/parallel.h"

#include <omp.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tandem/core/error.h"

namespace tandem {
namespace {

int default_num_threads() {
  if (const char* s = std::getenv("TANDEM_NUM_THREADS"); s != nullptr && *s != '\0') {
    int n = 0;
    const char* end = s + std::strlen(s);
    const auto [ptr, ec] = std::from_chars(s, end, n);
    TANDEM_CHECK(ec == std::errc() && ptr == end && n >= 1, ValueError,
                 "TANDEM_NUM_THREADS={} is not a positive integer; set it to e.g. 1", s);
    return n;
  }
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores <= 0) cores = 1;
  int local_world = 1;
  if (const char* s = std::getenv("LOCAL_WORLD_SIZE"); s != nullptr && std::atoi(s) > 0) local_world = std::atoi(s);
  return std::max(1, cores / local_world);
}

thread_local bool in_parallel_region = false;

// Workers wait for a job generation number; the caller runs chunk 0 itself.
class Pool {
 public:
  explicit Pool(int n) { resize(n); }
  ~Pool() { stop(); }

  int size() const { return size_.load(std::memory_order_relaxed); }

  // Returns "" or why not every worker could start (the pool then has the ones that did). Waits
  // for a job another thread is running (its workers must not stop halfway through it).
  std::string resize(int n) {
    std::lock_guard<std::mutex> no_job(run_mu_);
    stop();
    uint64_t current;
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = false;
      current = generation_;
    }
    // New workers start at the current generation: a job that already finished must not look
    // new to them (they would run it again through a dangling job_ pointer).
    std::string failure;
    for (int i = 1; i < n; ++i) {
      try {
        workers_.emplace_back([this, i, current] { loop(i, current); });
      } catch (const std::exception& e) {
        failure = e.what();  // a process or memory limit: run with the workers that started
        break;
      }
    }
    size_ = 1 + static_cast<int>(workers_.size());
    return failure;
  }

  void run(int nchunks, const std::function<void(int)>& chunk) {
    std::lock_guard<std::mutex> one_job_at_a_time(run_mu_);
    std::unique_lock<std::mutex> lock(mu_);
    job_ = &chunk;
    // Worker i runs chunk i; chunks no worker has (the pool shrank since the caller counted) run
    // here after chunk 0.
    const int by_workers = std::min(nchunks, size_.load(std::memory_order_relaxed));
    nchunks_ = by_workers;
    pending_ = by_workers - 1;
    error_ = nullptr;
    ++generation_;
    lock.unlock();
    cv_.notify_all();
    std::exception_ptr mine;
    try {
      in_parallel_region = true;
      chunk(0);
      for (int i = by_workers; i < nchunks; ++i) chunk(i);
    } catch (...) {
      mine = std::current_exception();
    }
    in_parallel_region = false;
    lock.lock();
    finished_.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
    if (mine) std::rethrow_exception(mine);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void loop(int index, uint64_t seen) {
    in_parallel_region = true;
    for (;;) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return done_ || generation_ != seen; });
      if (done_) return;
      seen = generation_;
      if (index >= nchunks_) continue;
      const std::function<void(int)>* job = job_;
      lock.unlock();
      std::exception_ptr err;
      try {
        (*job)(index);
      } catch (...) {
        err = std::current_exception();
      }
      lock.lock();
      if (err && !error_) error_ = err;
      if (--pending_ == 0) finished_.notify_one();
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::atomic<int> size_{1};  // written by resize (under run_mu_), read by parallel_for without it
  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // callers on different threads take turns
  std::mutex mu_;
  std::condition_variable cv_, finished_;
  const std::function<void(int)>* job_ = nullptr;
  int nchunks_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool done_ = false;
  std::exception_ptr error_;
};

std::mutex pool_mu;                  // creation and resizing
std::atomic<Pool*> pool_ptr{nullptr};  // read without pool_mu: a chunk of a running job may ask
                                       // for the pool while set_num_threads holds pool_mu and
                                       // waits for that job

// fork(): the child has none of the parent's worker threads, and pool_mu may have been held by one
// of them. The child starts with a fresh pool (the parent's is leaked there).
void reset_pool_in_child() {
  new (&pool_mu) std::mutex();
  pool_ptr.store(nullptr);
}
[[maybe_unused]] const int pool_atfork_registered = pthread_atfork(nullptr, nullptr, reset_pool_in_child);

Pool& pool() {
  if (Pool* p = pool_ptr.load(std::memory_order_acquire)) return *p;
  std::lock_guard<std::mutex> lock(pool_mu);
  if (pool_ptr.load() == nullptr) {
    Pool* p = new Pool(default_num_threads());  // leaked: workers must outlive static teardown
    omp_set_num_threads(p->size());
    pool_ptr.store(p, std::memory_order_release);
  }
  return *pool_ptr.load();
}

}  // namespace

void set_num_threads(int n) {
  TANDEM_CHECK(n >= 1, ValueError, "set_num_threads({}): the thread count must be >= 1", n);
  TANDEM_CHECK(!in_parallel_region, ValueError, "set_num_threads({}) called inside parallel_for", n);
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(pool_mu);
  const std::string failure = p.size() != n ? p.resize(n) : std::string();
  omp_set_num_threads(p.size());
  TANDEM_CHECK(failure.empty(), Error,
               "set_num_threads({}): only {} threads could be started ({}); running with {}. Lower the count or raise "
               "the process limit",
               n, p.size(), failure, p.size());
}

int get_num_threads() { return pool().size(); }

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (end <= begin) return;
  const int64_t n = end - begin;
  grain = std::max<int64_t>(grain, 1);
  Pool& p = pool();
  const int64_t max_chunks = std::min<int64_t>(p.size(), (n + grain - 1) / grain);
  if (max_chunks <= 1 || in_parallel_region) {
    fn(begin, end);
    return;
  }
  const int64_t chunk = (n + max_chunks - 1) / max_chunks;
  const int nchunks = static_cast<int>((n + chunk - 1) / chunk);
  p.run(nchunks, [&](int i) {
    const int64_t b = begin + i * chunk;
    fn(b, std::min(end, b + chunk));
  });
}

}  // namespace tandem
