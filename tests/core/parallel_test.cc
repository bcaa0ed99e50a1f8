// The intra-op pool: parallel_for covers its range exactly once in chunks of at least `grain`,
// rethrows exceptions, runs nested calls inline, and follows set_num_threads.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "util/test_util.h"

namespace td = tandem;

namespace {

// Restores the thread count a test changed.
class ThreadCountGuard {
 public:
  ThreadCountGuard() : saved_(td::get_num_threads()) {}
  ~ThreadCountGuard() { td::set_num_threads(saved_); }

 private:
  int saved_;
};

struct Chunk {
  int64_t begin, end;
  std::thread::id thread;
};

std::vector<Chunk> run_and_check(int64_t begin, int64_t end, int64_t grain) {
  std::vector<std::atomic<int>> hits(static_cast<size_t>(std::max<int64_t>(end - begin, 0)));
  std::mutex mu;
  std::vector<Chunk> chunks;
  td::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    {
      std::lock_guard<std::mutex> lock(mu);
      chunks.push_back({b, e, std::this_thread::get_id()});
    }
    for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i - begin)]++;
  });
  for (size_t i = 0; i < hits.size(); ++i) EXPECT_EQ(hits[i].load(), 1) << "index " << begin + static_cast<int64_t>(i);
  std::sort(chunks.begin(), chunks.end(), [](const Chunk& a, const Chunk& b) { return a.begin < b.begin; });
  for (size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_LT(chunks[i].begin, chunks[i].end);
    if (i + 1 < chunks.size()) EXPECT_GE(chunks[i].end - chunks[i].begin, grain) << "chunk " << i;
  }
  return chunks;
}

}  // namespace

TEST(Parallel, CoversRangeExactlyOnce) {
  ThreadCountGuard guard;
  for (int threads : {1, 2, 3, 4, 7}) {
    td::set_num_threads(threads);
    EXPECT_EQ(td::get_num_threads(), threads);
    for (int64_t grain : {1, 7, 1000, 100000}) {
      for (auto [b, e] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {3, 10003}, {-50, 50}, {0, 7}, {5, 5}, {9, 2}}) {
        const auto chunks = run_and_check(b, e, grain);
        if (e <= b) EXPECT_TRUE(chunks.empty());
        const int64_t max_chunks = std::min<int64_t>(threads, (e - b + grain - 1) / std::max<int64_t>(grain, 1));
        if (e > b) EXPECT_LE(static_cast<int64_t>(chunks.size()), std::max<int64_t>(max_chunks, 1));
      }
    }
  }
}

TEST(Parallel, UsesThePoolThreads) {
  ThreadCountGuard guard;
  td::set_num_threads(4);
  // Four chunks of one iteration: each goes to its own pool thread (the caller runs chunk 0).
  const auto chunks = run_and_check(0, 4, 1);
  ASSERT_EQ(chunks.size(), 4u);
  std::set<std::thread::id> ids;
  for (const Chunk& c : chunks) ids.insert(c.thread);
  EXPECT_EQ(ids.size(), 4u);
  EXPECT_TRUE(ids.count(std::this_thread::get_id()));
}

TEST(Parallel, ResizingBetweenJobs) {
  ThreadCountGuard guard;
  // Run jobs, change the thread count, run again: new workers must not replay an old job.
  for (int round = 0; round < 20; ++round) {
    td::set_num_threads(2 + round % 3);
    run_and_check(0, 1000, 10);
    run_and_check(0, 3, 1);
  }
}

TEST(Parallel, PropagatesExceptions) {
  ThreadCountGuard guard;
  for (int threads : {1, 4}) {
    td::set_num_threads(threads);
    for (int64_t bad : {0, 500, 999}) {  // in the caller's chunk, a middle chunk, the last chunk
      EXPECT_THROW(td::parallel_for(0, 1000, 1,
                                    [&](int64_t b, int64_t e) {
                                      if (bad >= b && bad < e) throw std::out_of_range("bad index");
                                    }),
                   std::out_of_range)
          << threads << " threads, bad " << bad;
    }
    // The pool still works afterwards.
    run_and_check(0, 1000, 1);
  }
}

TEST(Parallel, NestedCallsRunInline) {
  ThreadCountGuard guard;
  td::set_num_threads(3);
  std::atomic<int64_t> total{0};
  std::atomic<int> inner_calls{0};
  td::parallel_for(0, 3, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const std::thread::id me = std::this_thread::get_id();
      td::parallel_for(0, 100, 1, [&](int64_t ib, int64_t ie) {
        EXPECT_EQ(std::this_thread::get_id(), me);
        EXPECT_EQ(ib, 0);  // one inline call covering everything
        EXPECT_EQ(ie, 100);
        inner_calls++;
        total += ie - ib;
      });
    }
  });
  EXPECT_EQ(total.load(), 300);
  EXPECT_EQ(inner_calls.load(), 3);
}

TEST(Parallel, SetNumThreadsValidates) {
  ThreadCountGuard guard;
  EXPECT_THROW(td::set_num_threads(0), td::ValueError);
  EXPECT_THROW(td::set_num_threads(-2), td::ValueError);
  td::set_num_threads(2);
  std::atomic<int> refused{0};
  td::parallel_for(0, 2, 1, [&](int64_t, int64_t) {
    try {
      td::set_num_threads(5);
    } catch (const td::ValueError&) {
      refused++;
    }
  });
  EXPECT_EQ(refused.load(), 2);
  EXPECT_EQ(td::get_num_threads(), 2);
}

// set_num_threads while another thread is inside parallel_for: the resize waits for the running
// job (it used to stop workers halfway through it, and the job waited forever). Every job still
// covers its whole range exactly once.
TEST(Parallel, ResizingWhileAnotherThreadRunsJobsNeitherHangsNorLosesChunks) {
  const int before = td::get_num_threads();
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0}, jobs{0};
  std::thread runner([&] {
    while (!stop.load()) {
      std::vector<int> hits(64, 0);
      td::parallel_for(0, 64, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) ++hits[static_cast<size_t>(i)];
      });
      if (std::any_of(hits.begin(), hits.end(), [](int h) { return h != 1; })) ++bad;
      ++jobs;
    }
  });
  // A job whose chunks call parallel_for (and so ask for the pool) again, as norms and oneDNN do.
  std::thread nested([&] {
    while (!stop.load()) {
      td::parallel_for(0, 4, 1, [&](int64_t, int64_t) {
        td::parallel_for(0, 4, 1, [](int64_t, int64_t) {});
        (void)td::get_num_threads();
      });
    }
  });
  for (int i = 0; i < 100; ++i) td::set_num_threads(i % 2 == 0 ? 3 : 2);
  stop = true;
  nested.join();
  runner.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(jobs.load(), 0);
  td::set_num_threads(before);
}
