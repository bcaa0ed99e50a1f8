// DataLoader: batch contents, identical batches with and without workers, worker errors,
// mid-epoch shutdown, the prefetch bound, epochs, and resuming from a saved state; collate and
// TensorDataset.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tandem/data/dataloader.h"
#include "tandem/data/synthetic.h"
#include "util/test_util.h"

namespace td = tandem;
using td::Tensor;
using td::data::Batch;
using td::data::DataLoader;
using td::data::Example;

namespace {

// Example i = {x: float [2] = {i, -i}, y: int64 scalar i}; get() sleeps a little, differently
// per index, so that workers finish out of order; index `fail_at` throws `Err`.
class Probe : public td::data::Dataset {
 public:
  explicit Probe(int64_t n, int64_t fail_at = -1, bool std_error = false)
      : n_(n), fail_at_(fail_at), std_error_(std_error) {}
  int64_t size() const override { return n_; }
  Example get(int64_t i) const override {
    check_index(i, "Probe");
    for (int64_t m = max_index_.load(); m < i && !max_index_.compare_exchange_weak(m, i);) {
    }
    calls_++;
    std::this_thread::sleep_for(std::chrono::microseconds((i * 7919) % 5 * 50));
    if (i == fail_at_) {
      if (std_error_) throw std::runtime_error("probe: plain failure at " + std::to_string(i));
      throw td::IOError("probe: cannot read example " + std::to_string(i));
    }
    return {td::tensor(std::vector<float>{static_cast<float>(i), static_cast<float>(-i)}, {2}),
            td::scalar_tensor(static_cast<double>(i), td::kInt64)};
  }
  mutable std::atomic<int64_t> max_index_{-1};
  mutable std::atomic<int64_t> calls_{0};

 private:
  int64_t n_, fail_at_;
  bool std_error_;
};

using Values = std::vector<std::vector<double>>;  // per batch: field 0 then field 1, flattened

Values drain(DataLoader& loader, int64_t limit = -1) {
  Values out;
  for (Batch& b : loader) {
    std::vector<double> v = b[0].to_vector();
    const std::vector<double> y = b[1].to_vector();
    v.insert(v.end(), y.begin(), y.end());
    out.push_back(v);
    if (limit >= 0 && static_cast<int64_t>(out.size()) == limit) break;
  }
  return out;
}

std::vector<double> labels(const Values& batches) {
  std::vector<double> out;
  for (const auto& b : batches) {
    const size_t n = b.size() / 3;  // 2 x-values + 1 label per example
    out.insert(out.end(), b.end() - static_cast<std::ptrdiff_t>(n), b.end());
  }
  return out;
}

}  // namespace

TEST(DataLoader, SequentialBatchesAndShapes) {
  Probe ds(10);
  DataLoader loader(ds, {.batch_size = 4});
  EXPECT_EQ(loader.size(), 3);
  std::vector<int64_t> sizes;
  int64_t k = 0;
  for (auto& [x, y] : loader) {
    EXPECT_EQ(x.dtype(), td::kFloat32);
    EXPECT_EQ(y.dtype(), td::kInt64);
    EXPECT_EQ(x.dim(), 2);
    EXPECT_EQ(x.size(1), 2);
    sizes.push_back(y.size(0));
    for (int64_t j = 0; j < y.size(0); ++j) {
      EXPECT_EQ(y.to_vector()[j], 4 * k + j);
      EXPECT_EQ(x.to_vector()[2 * j + 1], -(4 * k + j));
    }
    ++k;
  }
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 4, 2}));
  DataLoader dropping(ds, {.batch_size = 4, .drop_last = true});
  EXPECT_EQ(dropping.size(), 2);
  EXPECT_EQ(drain(dropping).size(), 2u);
}

TEST(DataLoader, WorkersGiveIdenticalBatches) {
  Probe ds(203);
  for (bool shuffle : {false, true}) {
    DataLoader serial(ds, {.batch_size = 8, .shuffle = shuffle, .seed = 5});
    DataLoader threaded(ds, {.batch_size = 8, .shuffle = shuffle, .num_workers = 2, .seed = 5});
    DataLoader many(ds, {.batch_size = 8, .shuffle = shuffle, .num_workers = 5, .prefetch_factor = 1, .seed = 5});
    const Values a = drain(serial);
    EXPECT_EQ(a.size(), 26u);
    EXPECT_EQ(drain(threaded), a) << "shuffle=" << shuffle;
    EXPECT_EQ(drain(many), a) << "shuffle=" << shuffle;
    std::vector<double> seen = labels(a);
    std::sort(seen.begin(), seen.end());
    for (int64_t i = 0; i < 203; ++i) ASSERT_EQ(seen[i], i);  // each example exactly once
  }
}

TEST(DataLoader, WorkersWithDistributedSampler) {
  Probe ds(50);
  td::data::DistributedSampler s0(50, {.num_replicas = 3, .rank = 2, .seed = 1});
  td::data::DistributedSampler s1(50, {.num_replicas = 3, .rank = 2, .seed = 1});
  DataLoader a(ds, {.batch_size = 4, .sampler = &s0});
  DataLoader b(ds, {.batch_size = 4, .sampler = &s1, .num_workers = 2});
  EXPECT_EQ(a.size(), 5);  // 17 samples
  a.set_epoch(3);
  b.set_epoch(3);
  EXPECT_EQ(s1.epoch(), 3);
  const Values va = drain(a);
  EXPECT_EQ(drain(b), va);
  std::vector<double> expect;
  for (int64_t i : s0.indices()) expect.push_back(static_cast<double>(i));
  EXPECT_EQ(labels(va), expect);
}

TEST(DataLoader, OwnedShufflerReshufflesEachPassUnlessTheEpochIsSet) {
  Probe ds(40);
  DataLoader loader(ds, {.batch_size = 40, .shuffle = true, .seed = 2});
  const Values e0 = drain(loader);
  EXPECT_EQ(loader.epoch(), 0);
  const Values e1 = drain(loader);
  EXPECT_EQ(loader.epoch(), 1);
  EXPECT_NE(e0, e1);
  loader.set_epoch(0);
  EXPECT_EQ(drain(loader), e0);
  loader.set_epoch(1);
  EXPECT_EQ(drain(loader), e1);
  // A caller's sampler keeps its epoch: the same order until set_epoch.
  td::data::RandomSampler rs(40, 2);
  DataLoader fixed(ds, {.batch_size = 40, .sampler = &rs});
  EXPECT_EQ(drain(fixed), e0);
  EXPECT_EQ(drain(fixed), e0);
}

// The usual loop calls set_epoch on the loader's own sampler (loader.sampler().set_epoch(e)): the
// epoch set wins over the loader's auto-advance (it used to run e + 1, and state() named e while
// the pass ran e + 1, so a resume skipped into another order).
TEST(DataLoader, AnEpochSetOnTheOwnedSamplerWinsOverTheAutoAdvance) {
  Probe ds(40);
  DataLoader ref(ds, {.batch_size = 40, .shuffle = true, .seed = 2});
  const Values e0 = drain(ref), e1 = drain(ref), e2 = drain(ref);
  DataLoader loader(ds, {.batch_size = 40, .shuffle = true, .seed = 2});
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    loader.sampler().set_epoch(epoch);
    EXPECT_EQ(loader.state().epoch, epoch);
    EXPECT_EQ(drain(loader), (std::vector<Values>{e0, e1, e2})[static_cast<size_t>(epoch)]) << epoch;
  }
  EXPECT_EQ(drain(loader), drain(ref));  // without a set_epoch it advances again
}

TEST(DataLoader, WorkerErrorReachesTheConsumerWithTheBatchIndex) {
  for (int64_t workers : {0, 2}) {
    Probe ds(40, /*fail_at=*/13);
    DataLoader loader(ds, {.batch_size = 4, .num_workers = workers});
    int64_t received = 0;
    try {
      for (Batch& b : loader) {
        (void)b;
        ++received;
      }
      FAIL() << "expected an IOError";
    } catch (const td::IOError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("batch 3 of epoch 0"), std::string::npos) << m;
      EXPECT_NE(m.find("cannot read example 13"), std::string::npos) << m;
    }
    EXPECT_EQ(received, 3) << "workers=" << workers;
    EXPECT_EQ(loader.state().batches_consumed, 3);
  }
  // Not a tandem::Error: carried as tandem::Error with the same context.
  Probe plain(40, 5, /*std_error=*/true);
  DataLoader loader(plain, {.batch_size = 4, .num_workers = 3});
  try {
    drain(loader);
    FAIL() << "expected an Error";
  } catch (const td::Error& e) {
    EXPECT_NE(std::string(e.what()).find("batch 1 of epoch 0: probe: plain failure at 5"), std::string::npos) << e.what();
  }
}

TEST(DataLoader, AfterAnErrorThePassStaysEnded) {
  Probe ds(40, 5);
  DataLoader loader(ds, {.batch_size = 4, .num_workers = 2});
  auto it = loader.begin();
  EXPECT_NO_THROW(*it);
  ++it;
  EXPECT_THROW(*it, td::IOError);
  ++it;
  EXPECT_THROW(*it, td::ValueError);  // "ended at the error in batch 1"
  // A new pass starts over and fails at the same batch again.
  EXPECT_THROW(drain(loader), td::IOError);
}

TEST(DataLoader, DestructionMidEpochJoinsPromptly) {
  Probe ds(10000);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t workers : {1, 4}) {
    DataLoader loader(ds, {.batch_size = 16, .num_workers = workers, .prefetch_factor = 2});
    EXPECT_EQ(drain(loader, 2).size(), 2u);
    // A second pass replaces the first mid-epoch, and is abandoned in turn.
    EXPECT_EQ(drain(loader, 1).size(), 1u);
    // a never-started loader and one whose iterator is still alive also go cleanly
    DataLoader idle(ds, {.batch_size = 16, .num_workers = workers});
    auto it = idle.begin();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 5.0) << "workers must stop at the prefetch bound, not run through the epoch";
  EXPECT_LT(ds.calls_.load(), 2000);
}

TEST(DataLoader, PrefetchIsBounded) {
  Probe ds(1000);
  DataLoader loader(ds, {.batch_size = 10, .num_workers = 2, .prefetch_factor = 1});  // capacity 2 batches
  auto it = loader.begin();
  *it;  // batch 0 taken: workers may make batches 1 and 2, no further
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_LT(ds.max_index_.load(), 30);
  EXPECT_GE(ds.max_index_.load(), 19) << "workers should have run ahead by the prefetch bound";
}

TEST(DataLoader, ResumesTheRemainingBatchesOfAnEpoch) {
  Probe ds(77);
  for (int64_t workers : {0, 2}) {
    // Uninterrupted: epochs 0 and 1.
    DataLoader full(ds, {.batch_size = 5, .shuffle = true, .num_workers = workers, .seed = 9});
    const Values e0 = drain(full);
    const Values e1 = drain(full);
    ASSERT_EQ(e1.size(), 16u);
    // Interrupted in epoch 1 after 6 batches; the state saved in the loop body counts the batch in hand.
    DataLoader first(ds, {.batch_size = 5, .shuffle = true, .num_workers = workers, .seed = 9});
    drain(first);
    DataLoader::State saved;
    int64_t k = 0;
    for (Batch& b : first) {
      (void)b;
      if (++k == 6) {
        saved = first.state();
        break;
      }
    }
    EXPECT_EQ(saved, (DataLoader::State{1, 6}));
    // A fresh process: load the state, the next pass is the rest of epoch 1, then epoch 2.
    DataLoader resumed(ds, {.batch_size = 5, .shuffle = true, .num_workers = workers, .seed = 9});
    resumed.load_state(saved);
    EXPECT_EQ(resumed.state(), saved);
    const Values rest = drain(resumed);
    EXPECT_EQ(rest, Values(e1.begin() + 6, e1.end())) << "workers=" << workers;
    EXPECT_EQ(resumed.state(), (DataLoader::State{1, 16}));
    EXPECT_EQ(drain(resumed), drain(full)) << "epoch 2";
  }
}

TEST(DataLoader, ResumeWithExplicitSetEpochLoop) {
  // The usual loop calls set_epoch(epoch) at the top; doing so for the saved epoch keeps the skip.
  Probe ds(30);
  td::data::DistributedSampler s(30, {.num_replicas = 2, .rank = 0, .seed = 4});
  DataLoader loader(ds, {.batch_size = 3, .sampler = &s, .num_workers = 2});
  loader.set_epoch(2);
  const Values e2 = drain(loader);
  loader.load_state({2, 4});
  loader.set_epoch(2);
  EXPECT_EQ(drain(loader), Values(e2.begin() + 4, e2.end()));
  loader.load_state({2, 4});
  loader.set_epoch(3);  // another epoch: the skip is dropped
  EXPECT_EQ(drain(loader).size(), 5u);
  loader.load_state({2, 5});
  EXPECT_TRUE(drain(loader).empty());
  EXPECT_THROW(loader.load_state({2, 6}), td::ValueError);
  EXPECT_THROW(loader.load_state({-1, 0}), td::ValueError);
}

TEST(DataLoader, StateAfterLoadFollowsTheSamplersEpoch) {
  // PyTorch code sets the epoch on the sampler, not the loader. After load_state({2, 4}),
  // sampler.set_epoch(3) makes the next pass a fresh epoch 3, and state() must say so: it said
  // {2, 4}, and a checkpoint taken then would resume 4 batches into the wrong epoch.
  Probe ds(30);
  td::data::DistributedSampler s(30, {.num_replicas = 2, .rank = 0, .seed = 4});
  DataLoader loader(ds, {.batch_size = 3, .sampler = &s});
  loader.set_epoch(3);
  drain(loader, 2);  // a pass of epoch 3 stopped after 2 batches
  loader.load_state({2, 4});
  EXPECT_EQ(loader.state(), (DataLoader::State{2, 4}));
  s.set_epoch(3);
  EXPECT_EQ(loader.state(), (DataLoader::State{3, 0})) << "not the earlier pass's {3, 2}, nor the dropped {2, 4}";
  auto it = loader.begin();
  EXPECT_EQ(it.index(), 0);
  *it;
  EXPECT_EQ(loader.state(), (DataLoader::State{3, 1}));
}

TEST(DataLoader, BatchSizeNearInt64MaxIsOneBatch) {
  // torch: len(DataLoader(range(10), batch_size=2**63-1)) == 1. ceil as (n + b - 1) / b
  // overflowed to no batch at all.
  td::data::TensorDataset ds({td::arange(10)});
  const int64_t big = std::numeric_limits<int64_t>::max();
  for (int64_t workers : {0, 2}) {
    DataLoader loader(ds, {.batch_size = big, .num_workers = workers});
    EXPECT_EQ(loader.size(), 1);
    std::vector<std::vector<double>> got;
    for (Batch& b : loader) got.push_back(b[0].to_vector());
    ASSERT_EQ(got.size(), 1u) << "workers=" << workers;
    EXPECT_EQ(got[0].size(), 10u);
    DataLoader dropping(ds, {.batch_size = big, .drop_last = true, .num_workers = workers});
    EXPECT_EQ(dropping.size(), 0);
    EXPECT_TRUE(drain(dropping).empty());
  }
}

TEST(DataLoader, PrefetchFactorHasNoUpperLimit) {
  // Only min(num_workers * prefetch_factor, batches) slots can ever hold a batch. A slot per
  // unit of the product threw std::bad_alloc for 2 x 2^40, and a product that overflowed to a
  // negative capacity left the workers waiting for room forever (the consumer with them).
  td::data::TensorDataset ds({td::arange(100), td::arange(100)});
  DataLoader large(ds, {.batch_size = 10, .num_workers = 2, .prefetch_factor = int64_t{1} << 40});
  Values a;
  ASSERT_NO_THROW(a = drain(large));
  EXPECT_EQ(a.size(), 10u);
  // A hang must fail the test, not stall the suite: the pass runs on a thread with a deadline.
  std::promise<size_t> done;
  std::future<size_t> result = done.get_future();
  std::thread([&ds, p = std::move(done)]() mutable {
    size_t n = 0;
    {
      DataLoader overflowing(ds, {.batch_size = 10, .num_workers = 4,
                                  .prefetch_factor = std::numeric_limits<int64_t>::max() / 2});
      for (Batch& b : overflowing) n += static_cast<size_t>(b[0].numel());
    }  // joined before the test may return and destroy ds
    p.set_value(n);
  }).detach();
  if (result.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    std::fprintf(stderr, "DataLoader.PrefetchFactorHasNoUpperLimit: the pass hung (overflowing prefetch capacity)\n");
    std::_Exit(1);  // the hung workers cannot be joined
  }
  EXPECT_EQ(result.get(), 100u);
}

TEST(DataLoader, StaleIteratorAndBadOptions) {
  Probe ds(10);
  DataLoader loader(ds, {.batch_size = 2});
  auto old = loader.begin();
  auto fresh = loader.begin();
  EXPECT_THROW(*old, td::ValueError);
  EXPECT_NO_THROW(*fresh);
  td::data::SequentialSampler seq(10);
  EXPECT_THROW(DataLoader(ds, {.batch_size = 0}), td::ValueError);
  EXPECT_THROW(DataLoader(ds, {.num_workers = -1}), td::ValueError);
  EXPECT_THROW(DataLoader(ds, {.prefetch_factor = 0}), td::ValueError);
  EXPECT_THROW(DataLoader(ds, {.shuffle = true, .sampler = &seq}), td::ValueError);
}

TEST(DataLoader, ThreeFieldBatchesIndexButDoNotBindAsPairs) {
  Tensor a = td::arange(6).reshape({6, 1}), b = td::arange(6), c = td::arange(12).to(td::kFloat32).reshape({6, 2});
  td::data::TensorDataset ds({a, b, c});
  DataLoader loader(ds, {.batch_size = 4});
  auto it = loader.begin();
  Batch& batch = *it;
  EXPECT_EQ(batch.size(), 3u);
  EXPECT_EQ(batch[2].shape(), (td::Shape{4, 2}));
  EXPECT_EQ(batch[2].to_vector()[7], 7.0);
  EXPECT_THROW(batch[3], td::ValueError);
  auto bind_pair = [&] {
    auto& [x, y] = batch;
    (void)x;
    (void)y;
  };
  EXPECT_THROW(bind_pair(), td::ValueError);
}

// ---- TensorDataset and collate ----

TEST(TensorDataset, RowsBatchesAndSizeMismatch) {
  Tensor x = td::arange(12).to(td::kFloat32).reshape({4, 3});
  Tensor y = td::tensor(std::vector<int64_t>{10, 11, 12, 13}, {4});
  td::data::TensorDataset ds({x, y});
  EXPECT_EQ(ds.size(), 4);
  Example e = ds.get(2);
  EXPECT_EQ(e[0].to_vector(), (std::vector<double>{6, 7, 8}));
  EXPECT_EQ(e[1].item<int64_t>(), 12);
  const std::vector<int64_t> idx = {3, 0};
  Batch b = ds.get_batch(idx);
  EXPECT_EQ(b[0].to_vector(), (std::vector<double>{9, 10, 11, 0, 1, 2}));
  EXPECT_EQ(b[1].to_vector(), (std::vector<double>{13, 10}));
  // Non-contiguous rows (a transposed tensor) gather through copy_.
  Tensor xt = td::arange(12).to(td::kFloat32).reshape({3, 4}).t();  // [4, 3], column-major
  td::data::TensorDataset tds({xt});
  EXPECT_EQ(tds.get_batch(idx)[0].to_vector(), (std::vector<double>{3, 7, 11, 0, 4, 8}));
  EXPECT_THROW(ds.get(4), td::ValueError);
  try {
    td::data::TensorDataset bad({x, td::arange(5)});
    FAIL();
  } catch (const td::ValueError& err) {
    EXPECT_NE(std::string(err.what()).find("tensor 0: 4, tensor 1: 5"), std::string::npos) << err.what();
  }
  EXPECT_THROW(td::data::TensorDataset(std::vector<Tensor>{}), td::ValueError);
  EXPECT_THROW(td::data::TensorDataset(std::vector<Tensor>{td::scalar_tensor(1.0)}), td::ValueError);
}

TEST(Collate, StacksFieldsAndChecksThem) {
  std::vector<Example> ex = {{td::tensor(std::vector<float>{1, 2}, {2}), td::scalar_tensor(3, td::kInt64)},
                             {td::tensor(std::vector<float>{4, 5}, {2}), td::scalar_tensor(6, td::kInt64)}};
  Batch b = td::data::collate(ex);
  EXPECT_EQ(b[0].shape(), (td::Shape{2, 2}));
  EXPECT_EQ(b[0].to_vector(), (std::vector<double>{1, 2, 4, 5}));
  EXPECT_EQ(b[1].dtype(), td::kInt64);
  EXPECT_EQ(b[1].to_vector(), (std::vector<double>{3, 6}));
  // A non-contiguous field.
  Tensor m = td::arange(4).reshape({2, 2});
  Batch bt = td::data::collate({{m.t()}, {m}});
  EXPECT_EQ(bt[0].to_vector(), (std::vector<double>{0, 2, 1, 3, 0, 1, 2, 3}));
  EXPECT_THROW(td::data::collate({}), td::ValueError);
  EXPECT_THROW(td::data::collate({{m}, {m, m}}), td::ValueError);
  EXPECT_THROW(td::data::collate({{m}, {td::arange(4)}}), td::ShapeError);
  EXPECT_THROW(td::data::collate({{m}, {m.to(td::kFloat32)}}), td::DTypeError);
}

TEST(DataLoader, OverSyntheticData) {
  td::data::Synthetic ds({.size = 64, .input_shape = {3, 8, 8}, .num_classes = 10, .seed = 1});
  DataLoader a(ds, {.batch_size = 16, .shuffle = true});
  DataLoader b(ds, {.batch_size = 16, .shuffle = true, .num_workers = 2});
  auto ia = a.begin();
  auto ib = b.begin();
  for (int64_t k = 0; k < a.size(); ++k, ++ia, ++ib) {
    EXPECT_EQ((*ia)[0].shape(), (td::Shape{16, 3, 8, 8}));
    EXPECT_EQ((*ia)[0].to_vector(), (*ib)[0].to_vector());
    EXPECT_EQ((*ia)[1].to_vector(), (*ib)[1].to_vector());
  }
  EXPECT_TRUE(ia == a.end());
}
