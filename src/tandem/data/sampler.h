// Samplers (torch.utils.data.Sampler): the order in which a DataLoader visits dataset indices,
// one list per epoch. Invariant: indices() is a pure function of the constructor arguments and
// the epoch, so a resumed run (same epoch) sees exactly the same order.
#pragma once

#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <vector>

namespace tandem::data {

// A uniformly random permutation of [0, n) from a Philox generator seeded with `seed`
// (Fisher-Yates, one 64-bit draw per swap). Deterministic in (n, seed) on every platform and
// thread count. It is NOT torch.randperm's sequence (PyTorch's CPU generator is an MT19937);
// the distribution is the same, the values for a given seed are not. Throws ValueError when n < 0.
std::vector<int64_t> randperm(int64_t n, uint64_t seed);

// Base of all samplers. Not thread-safe: set_epoch() must not race with indices() (the
// DataLoader calls indices() once, on the consumer's thread, when an iteration starts).
class Sampler {
 public:
  // Iterates a snapshot of indices() taken when begin() was called.
  class Iterator {
   public:
    using value_type = int64_t;
    using difference_type = std::ptrdiff_t;
    Iterator() = default;
    explicit Iterator(std::shared_ptr<const std::vector<int64_t>> v) : v_(std::move(v)) {}
    int64_t operator*() const { return (*v_)[pos_]; }
    Iterator& operator++() { ++pos_; return *this; }
    void operator++(int) { ++pos_; }
    bool operator==(std::default_sentinel_t) const { return v_ == nullptr || pos_ >= v_->size(); }

   private:
    std::shared_ptr<const std::vector<int64_t>> v_;
    size_t pos_ = 0;
  };

  virtual ~Sampler() = default;
  // Number of indices per epoch (len(sampler)).
  virtual int64_t size() const = 0;
  // The current epoch's indices, in order; size() of them. Does not block.
  virtual std::vector<int64_t> indices() const = 0;
  // Selects the epoch whose order indices() returns (torch's DistributedSampler.set_epoch).
  // Samplers whose order does not depend on the epoch only record it.
  void set_epoch(int64_t epoch) {
    epoch_ = epoch;
    ++epoch_sets_;
  }
  int64_t epoch() const { return epoch_; }
  // How many times set_epoch() was called (a DataLoader that owns the sampler advances the epoch
  // itself only while nobody else set it).
  uint64_t epoch_sets() const { return epoch_sets_; }

  // `for (int64_t i : sampler)`.
  Iterator begin() const { return Iterator(std::make_shared<const std::vector<int64_t>>(indices())); }
  std::default_sentinel_t end() const { return {}; }

 protected:
  int64_t epoch_ = 0;
  uint64_t epoch_sets_ = 0;
};

// 0, 1, ..., size - 1 (torch.utils.data.SequentialSampler). Throws ValueError when size < 0.
class SequentialSampler : public Sampler {
 public:
  explicit SequentialSampler(int64_t size);
  int64_t size() const override { return size_; }
  std::vector<int64_t> indices() const override;

 private:
  int64_t size_;
};

// A permutation of [0, size) per epoch: randperm(size, seed + epoch), without replacement.
// Unlike torch's RandomSampler, whose generator advances at every iteration, the order is a
// function of (seed, epoch), so a run resumed at an epoch sees the same order; the DataLoader
// advances the epoch by itself when it owns the sampler (shuffle=true). Throws ValueError when size < 0.
class RandomSampler : public Sampler {
 public:
  explicit RandomSampler(int64_t size, uint64_t seed = 0);
  int64_t size() const override { return size_; }
  std::vector<int64_t> indices() const override;
  uint64_t seed() const { return seed_; }

 private:
  int64_t size_;
  uint64_t seed_;
};

struct DistributedSamplerOptions {
  // Number of processes sharing the data; default: $WORLD_SIZE, else 1.
  std::optional<int64_t> num_replicas;
  // This process's rank in [0, num_replicas); default: $RANK, else 0.
  std::optional<int64_t> rank;
  bool shuffle = true;
  uint64_t seed = 0;  // must be the same on every rank
  bool drop_last = false;
  // Beyond torch: 0 deals single indices round-robin (torch's rule, below); B > 0 deals
  // contiguous blocks of B: rank r takes positions [(jR + r)B, (jR + r + 1)B) for j = 0, 1, ...,
  // and the epoch is cut to a multiple of R * B (drop_last is implied: padding would repeat
  // samples). With B = micro-batch x micro-batches per step, each rank's micro-batches of a step
  // are consecutive pieces of the step's global batch, the same pieces for every R (DDP's
  // deterministic mode).
  int64_t block = 0;
};

// torch.utils.data.distributed.DistributedSampler: each of num_replicas processes takes a
// disjoint, equal-sized share of the dataset's indices. Works as follows, per epoch:
//   1. indices = shuffle ? randperm(N, seed + epoch) : [0, N)   (randperm: see above; the
//      permutation differs from torch.randperm's for the same seed, the rule does not)
//   2. drop_last=false: pad by wrap-around (repeat the list from its start as often as needed)
//      to total_size = ceil(N / R) * R, so some indices appear twice;
//      drop_last=true: truncate to total_size = floor(N / R) * R.
//   3. rank r takes indices[r : total_size : R], num_samples = total_size / R of them.
//   (block B > 0: 2. truncate to a multiple of R * B; 3. rank r takes blocks r, r + R, ... of B.)
// Every rank must use the same seed and epoch, or the shares overlap. num_replicas and rank are
// explicit until the process group exists (they then default from it, like torch's).
class DistributedSampler : public Sampler {
 public:
  using Options = DistributedSamplerOptions;
  // Throws ValueError when dataset_size < 0, num_replicas < 1, rank is outside
  // [0, num_replicas) (naming both), or $WORLD_SIZE / $RANK are needed but not integers.
  explicit DistributedSampler(int64_t dataset_size, const Options& options = {});

  int64_t size() const override { return num_samples_; }  // num_samples
  std::vector<int64_t> indices() const override;

  int64_t dataset_size() const { return dataset_size_; }
  int64_t num_replicas() const { return num_replicas_; }
  int64_t rank() const { return rank_; }
  int64_t total_size() const { return total_size_; }
  const Options& options() const { return options_; }

 private:
  int64_t dataset_size_;
  int64_t num_replicas_;
  int64_t rank_;
  int64_t num_samples_;
  int64_t total_size_;
  Options options_;
};

}  // namespace tandem::data
