// In-process tests of the mpi, gloo and nccl backends: the collective sweep on what one process
// can run (mpi as a 1-process MPI job, gloo with ranks as threads over a HashStore, nccl on one
// GPU when there is one), argument errors, and the built-out factories' messages. The multi-
// process sweeps run under mpirun (ctest dist.mpi_sweep_np*, dist.gloo_sweep_np2).
#include <functional>
#include <thread>

#include <gtest/gtest.h>

#include "collective_sweep.h"
#include "tandem/dist/backends.h"

#ifdef TANDEM_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace tandem::dist {
namespace {

using testing::SweepOptions;

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// ---- mpi ----

TEST(MpiBackend, SweepAsOneProcessJob) {
#ifndef TANDEM_WITH_MPI
  const std::string e = error_of([] { make_mpi_group(nullptr, 0, 1, {}); });
  EXPECT_NE(e.find("built without MPI"), std::string::npos) << e;
  GTEST_SKIP() << "built without MPI (install libopenmpi-dev and rebuild); the factory's error was checked";
#else
  auto pg = make_mpi_group(nullptr, 0, 1, {});
  EXPECT_EQ(pg->backend_name(), "mpi");
  const auto report = testing::run_collective_sweep(*pg, SweepOptions{});
  EXPECT_GT(report.elements_checked, 0);
  EXPECT_GT(pg->next_sequence_number(), 100);
#endif
}

#ifdef TANDEM_WITH_MPI
TEST(MpiBackend, BadArgumentsNameTheValueAndTheFix) {
  auto pg = make_mpi_group(nullptr, 0, 1, {});
  float x[4] = {};
  Buffer cuda{x, 4, DType::f32, Device{DeviceType::cuda, 0}};
  EXPECT_NE(error_of([&] { pg->all_reduce(cuda); }).find("use the nccl backend"), std::string::npos);
  EXPECT_NE(error_of([&] { pg->broadcast(Buffer{x, 4, DType::f32, kCPU}, 3); }).find("root 3 is outside the group of size 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pg->all_gather(Buffer{x, 3, DType::f32, kCPU}, Buffer{x, 1, DType::f32, kCPU}); })
                .find("needs world size 1 x input count 1 = 1 elements, got 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pg->all_reduce(Buffer{x, 4, DType::b8, kCPU}); }).find("bool"), std::string::npos);
  // Without a store the group must be MPI_COMM_WORLD (here one process).
  const std::string e = error_of([] { make_mpi_group(nullptr, 1, 2, {}); });
  EXPECT_NE(e.find("mpirun -np 2"), std::string::npos) << e;
}

TEST(MpiBackend, WorkCompletesInIssueOrder) {
  auto pg = make_mpi_group(nullptr, 0, 1, {});
  std::vector<float> a(1 << 16, 1.0f), b(1, 2.0f);
  auto w1 = pg->all_reduce(Buffer{a.data(), static_cast<int64_t>(a.size()), DType::f32, kCPU});
  auto w2 = pg->all_reduce(Buffer{b.data(), 1, DType::f32, kCPU});
  w2->wait(std::chrono::seconds(30));
  EXPECT_TRUE(w1->is_completed());  // the later one finished, so the earlier one had
  EXPECT_TRUE(w1->is_success());
  EXPECT_NE(w1->description().find("all_reduce #0 (float32, 65536, SUM)"), std::string::npos) << w1->description();
}
#endif

// ---- gloo ----

#ifdef TANDEM_WITH_GLOO
TEST(GlooBackend, SweepWithThreeRanksAsThreads) {
  auto store = std::make_shared<HashStore>(std::chrono::seconds(30));
  constexpr int kRanks = 3;
  std::vector<std::string> errors(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      try {
        ProcessGroupOptions o;
        o.timeout = std::chrono::seconds(30);
        auto pg = make_gloo_group(store, r, kRanks, o);
        SweepOptions opt;
        opt.ops = {"all_reduce", "broadcast", "all_gather", "barrier"};
        opt.counts = {0, 1, 149};
        testing::run_collective_sweep(*pg, opt);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Ranks that disagree on a collective: counts that differ used to abort the process from gloo's
// network thread (std::terminate, nothing named), and a dtype that differs at the same byte count
// reduced garbage silently. Every rank now stops with an error naming the call of the first rank
// that differs from rank 0's; and a rank that skips a collective is a Timeout, not a CommError.
TEST(GlooBackend, MismatchedCollectivesAreAnErrorNamingBothCallsAndASkippedOneATimeout) {
  struct Case {
    const char* what;
    std::function<std::shared_ptr<Work>(ProcessGroup&, std::vector<float>&, std::vector<int32_t>&)> call;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"count", [](ProcessGroup& pg, std::vector<float>& f, std::vector<int32_t>&) {
         return pg.all_reduce(Buffer{f.data(), pg.rank() == 0 ? 10 : 20, DType::f32, kCPU}, ReduceOp::SUM);
       }, "collective mismatch at #0: rank 1 called all_reduce (float32, 20, SUM) while rank 0 called all_reduce (float32, 10, SUM)"},
      {"dtype", [](ProcessGroup& pg, std::vector<float>& f, std::vector<int32_t>& i) {
         return pg.rank() == 0 ? pg.all_reduce(Buffer{f.data(), 4, DType::f32, kCPU}, ReduceOp::SUM)
                               : pg.all_reduce(Buffer{i.data(), 4, DType::i32, kCPU}, ReduceOp::SUM);
       }, "rank 1 called all_reduce (int32, 4, SUM) while rank 0 called all_reduce (float32, 4, SUM)"},
      {"root", [](ProcessGroup& pg, std::vector<float>& f, std::vector<int32_t>&) {
         return pg.broadcast(Buffer{f.data(), 8, DType::f32, kCPU}, pg.rank());
       }, "rank 1 called broadcast (float32, 8, root 1) while rank 0 called broadcast (float32, 8, root 0)"},
  };
  for (const Case& c : cases) {
    auto store = std::make_shared<HashStore>(std::chrono::seconds(30));
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        std::vector<float> f(32, 1.0f);
        std::vector<int32_t> i(32, 1);
        ProcessGroupOptions o;
        o.timeout = std::chrono::seconds(20);
        auto pg = make_gloo_group(store, r, 2, o);
        errors[r] = error_of([&] { c.call(*pg, f, i)->wait(); });
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < 2; ++r) EXPECT_NE(errors[r].find(c.expect), std::string::npos) << c.what << ", rank " << r << ": " << errors[r];
  }
  {
    auto store = std::make_shared<HashStore>(std::chrono::seconds(30));
    std::string kind;
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        ProcessGroupOptions o;
        o.timeout = std::chrono::milliseconds(1000);
        auto pg = make_gloo_group(store, r, 2, o);
        if (r == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2500));
          return;
        }
        try {
          pg->barrier()->wait();
          kind = "none";
        } catch (const Timeout&) {
          kind = "Timeout";
        } catch (const std::exception& e) {
          kind = std::string("other: ") + e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(kind, "Timeout");
  }
}

TEST(GlooBackend, UnsupportedCollectivesSaySo) {
  auto pg = make_gloo_group(std::make_shared<HashStore>(std::chrono::seconds(10)), 0, 1, {});
  float x[2] = {};
  EXPECT_EQ(error_of([&] { pg->reduce_scatter(Buffer{x, 1, DType::f32, kCPU}, Buffer{x + 1, 1, DType::f32, kCPU}); }),
            "backend 'gloo' does not support reduce_scatter");
}

TEST(GlooBackend, MissingPeerTimesOutAtRendezvous) {
  ProcessGroupOptions o;
  o.timeout = std::chrono::milliseconds(500);
  // Rank 1 never comes: the rendezvous store wait runs out, within a few timeouts.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(make_gloo_group(std::make_shared<HashStore>(std::chrono::milliseconds(500)), 0, 2, o), Timeout);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}
#else
TEST(GlooBackend, BuiltWithoutGlooSaysHowToBuildIt) {
  const std::string e = error_of([] { make_gloo_group(std::make_shared<HashStore>(), 0, 1, {}); });
  EXPECT_NE(e.find("built without gloo"), std::string::npos) << e;
}
#endif

// ---- nccl ----

#ifdef TANDEM_WITH_CUDA
// Host-buffer facade over an NCCL group for the sweep: each collective stages its buffers
// through device memory and completes before returning.
class DeviceStaged final : public ProcessGroup {
 public:
  explicit DeviceStaged(std::shared_ptr<ProcessGroup> inner) : ProcessGroup(inner->rank(), inner->size()), inner_(std::move(inner)) {}
  std::string backend_name() const override { return "nccl (staged)"; }

  std::shared_ptr<Work> all_reduce(Buffer b, ReduceOp op) override { return run({b}, [&](auto& d) { return inner_->all_reduce(d[0], op); }); }
  std::shared_ptr<Work> broadcast(Buffer b, int root) override { return run({b}, [&](auto& d) { return inner_->broadcast(d[0], root); }); }
  std::shared_ptr<Work> reduce(Buffer b, int root, ReduceOp op) override { return run({b}, [&](auto& d) { return inner_->reduce(d[0], root, op); }); }
  std::shared_ptr<Work> all_gather(Buffer out, Buffer in) override { return run({out, in}, [&](auto& d) { return inner_->all_gather(d[0], d[1]); }); }
  std::shared_ptr<Work> all_gather(std::vector<Buffer> outs, Buffer in) override {
    outs.push_back(in);
    return run(outs, [&](auto& d) {
      std::vector<Buffer> o(d.begin(), d.end() - 1);
      return inner_->all_gather(o, d.back());
    });
  }
  std::shared_ptr<Work> reduce_scatter(Buffer out, Buffer in, ReduceOp op) override { return run({out, in}, [&](auto& d) { return inner_->reduce_scatter(d[0], d[1], op); }); }
  std::shared_ptr<Work> gather(Buffer out, Buffer in, int root) override { return run({out, in}, [&](auto& d) { return inner_->gather(d[0], d[1], root); }); }
  std::shared_ptr<Work> scatter(Buffer out, Buffer in, int root) override { return run({out, in}, [&](auto& d) { return inner_->scatter(d[0], d[1], root); }); }
  std::shared_ptr<Work> all_to_all(Buffer out, Buffer in) override { return run({out, in}, [&](auto& d) { return inner_->all_to_all(d[0], d[1]); }); }
  std::shared_ptr<Work> barrier() override { return run({}, [&](auto&) { return inner_->barrier(); }); }

 private:
  template <class F>
  std::shared_ptr<Work> run(std::vector<Buffer> host, F&& call) {
    std::vector<Buffer> dev = host;
    std::vector<void*> mem;
    for (auto& d : dev) {
      void* p = nullptr;
      if (cudaMalloc(&p, d.nbytes() + 1) != cudaSuccess) throw CommError("cudaMalloc failed");
      if (d.nbytes() > 0) cudaMemcpy(p, d.data, d.nbytes(), cudaMemcpyHostToDevice);
      d.data = p;
      d.device = Device{DeviceType::cuda, 0};
      mem.push_back(p);
    }
    std::exception_ptr error;
    try {
      call(dev)->wait(std::chrono::seconds(60));
    } catch (...) {
      error = std::current_exception();
    }
    for (size_t i = 0; i < dev.size(); ++i) {
      if (host[i].nbytes() > 0) cudaMemcpy(host[i].data, dev[i].data, host[i].nbytes(), cudaMemcpyDeviceToHost);
      cudaFree(mem[i]);
    }
    return error ? Work::failed(error) : Work::completed();
  }
  std::shared_ptr<ProcessGroup> inner_;
};
#endif

// The NCCL group of one rank on this machine's GPU, or null when there is none (the reason in
// `why`). Throws for any other failure.
std::shared_ptr<ProcessGroup> nccl_or_skip(std::string& why) {
  try {
    return make_nccl_group(std::make_shared<HashStore>(std::chrono::seconds(30)), 0, 1, {});
  } catch (const ValueError& e) {
    why = e.what();  // built without CUDA
  } catch (const CommError& e) {
    why = e.what();  // no device
  }
  return nullptr;
}

TEST(NcclBackend, WithoutAGpuTheFactoryNamesTheFix) {
  std::string why;
  auto pg = nccl_or_skip(why);
  if (pg) GTEST_SKIP() << "a CUDA device is present: NcclBackend.Sweep* run instead";
#ifdef TANDEM_WITH_CUDA
  EXPECT_NE(why.find("no CUDA device"), std::string::npos) << why;
#else
  EXPECT_NE(why.find("built without CUDA"), std::string::npos) << why;
#endif
}

TEST(NcclBackend, SweepOnOneGpu) {
  std::string why;
  auto pg = nccl_or_skip(why);
  if (!pg) GTEST_SKIP() << "no GPU to run NCCL on: " << why;
#ifdef TANDEM_WITH_CUDA
  DeviceStaged staged(pg);
  SweepOptions opt;
  opt.ops = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_list", "reduce_scatter", "gather", "scatter",
             "all_to_all", "barrier"};
  // NCCL reduces 16-bit floats in 16-bit steps (no one-rounding promise); one rank has no steps.
  opt.reduced_float_one_rounding = false;
  const auto report = testing::run_collective_sweep(staged, opt);
  EXPECT_GT(report.elements_checked, 0);
  float x[2] = {};
  EXPECT_NE(error_of([&] { pg->all_reduce(Buffer{x, 2, DType::f32, kCPU}); }).find("needs CUDA buffers"), std::string::npos);
#endif
}

}  // namespace
}  // namespace tandem::dist
