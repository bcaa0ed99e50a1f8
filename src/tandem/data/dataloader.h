// DataLoader (torch.utils.data.DataLoader): batches of a Dataset in a Sampler's order, optionally
// produced ahead of time by background worker threads. Invariant: batch k of an epoch is the
// same tensors whatever num_workers is — workers change when a batch is made, never which.
#pragma once

#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>

#include "tandem/data/dataset.h"
#include "tandem/data/sampler.h"

namespace tandem::data {

struct DataLoaderOptions {
  int64_t batch_size = 1;
  // Reshuffle every epoch (a RandomSampler owned by the loader, seeded with `seed`); exclusive
  // with `sampler`.
  bool shuffle = false;
  // The order to visit; not owned, must outlive the loader. Null: SequentialSampler, or
  // RandomSampler when shuffle.
  Sampler* sampler = nullptr;
  // Drop the last batch when it would be smaller than batch_size.
  bool drop_last = false;
  // Background threads producing batches; 0 produces each batch on the consumer's thread when
  // it is asked for.
  int64_t num_workers = 0;
  // Batches each worker may have prepared ahead: at most num_workers * prefetch_factor batches
  // are in flight or waiting at once.
  int64_t prefetch_factor = 2;
  uint64_t seed = 0;  // seed of the owned RandomSampler (shuffle=true)
};

// What a run must save to resume the loader mid-epoch: the epoch and how many of its batches
// the consumer has already received.
struct DataLoaderState {
  int64_t epoch = 0;
  int64_t batches_consumed = 0;
  bool operator==(const DataLoaderState&) const = default;
};

// Iterating the loader (`for (auto& [x, y] : loader)` or `for (Batch& b : loader)`) is one
// pass over the current epoch. Works as follows:
//   - begin() asks the sampler for the epoch's indices (once), cuts them into size() batches of
//     batch_size consecutive indices, and starts num_workers threads. Batch k holds indices
//     [k * batch_size, (k + 1) * batch_size) and is made by dataset.get_batch().
//   - Workers take batch numbers in increasing order from a shared counter, never more than
//     num_workers * prefetch_factor ahead of the consumer, and park each result (or the
//     exception it threw) in a slot for batch k. The consumer takes slot k, then k + 1, ...,
//     so the order is deterministic whatever the thread timing.
//   - An exception from dataset.get_batch() (on a worker or not) reaches the consumer when it
//     asks for that batch, rethrown as the same tandem::Error type (other exceptions as
//     tandem::Error) with "DataLoader: batch k of epoch e: " before the message. The pass stops.
//
// Epochs: with a sampler of its own (sampler == nullptr), each new pass after a pass starts the
// next epoch by itself, so shuffle=true reshuffles every pass, like PyTorch. With a sampler from
// the caller, the epoch changes only through set_epoch() (as with torch's DistributedSampler;
// forgetting it repeats the same order every epoch).
//
// Resuming: state() is {epoch, batches_consumed}; after load_state(s) the next pass is epoch
// s.epoch without its first s.batches_consumed batches, so a resumed run sees the same
// remaining batches as an uninterrupted one. A batch counts as consumed once the consumer has
// it (dereferenced the iterator), so a state saved inside the loop body resumes after that batch.
//
// Lifetime and threads: the dataset (and a caller's sampler) must outlive the loader. The loader
// is used from one thread at a time (the consumer); workers only call dataset.get_batch(), which
// must be thread-safe (see Dataset). Starting a new pass (begin()) or destroying the loader
// stops and joins the current pass's workers, even mid-epoch: it waits at most for the batches
// being made at that moment. An iterator from an earlier pass throws ValueError when used.
class DataLoader {
 public:
  using Options = DataLoaderOptions;
  using State = DataLoaderState;

  // Move-only input iterator over one pass. operator* blocks until batch k is ready (or throws
  // its error); it never waits on a worker that has exited.
  class Iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    Iterator(Iterator&&) noexcept = default;
    Iterator& operator=(Iterator&&) noexcept = default;
    Iterator(const Iterator&) = delete;
    Iterator& operator=(const Iterator&) = delete;

    Batch& operator*();
    Batch* operator->() { return &**this; }
    Iterator& operator++();
    bool operator==(std::default_sentinel_t) const { return pos_ >= end_; }
    // Index of the batch this iterator is at, within the epoch.
    int64_t index() const { return pos_; }

   private:
    friend class DataLoader;
    Iterator(DataLoader* loader, uint64_t generation, int64_t pos, int64_t end)
        : loader_(loader), generation_(generation), pos_(pos), end_(end) {}
    DataLoader* loader_;
    uint64_t generation_;
    int64_t pos_;
    int64_t end_;
    bool taken_ = false;    // take() was called for pos_ (it may have thrown)
    bool fetched_ = false;  // batch_ holds batch pos_
    Batch batch_;
  };

  // Throws ValueError when batch_size < 1, num_workers < 0, prefetch_factor < 1, or shuffle is
  // combined with a sampler. Starts no thread.
  explicit DataLoader(const Dataset& dataset, const Options& options = {});
  // Stops and joins the workers (noexcept).
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Number of batches per epoch (len(loader)): ceil(len(sampler) / batch_size), or floor with drop_last.
  int64_t size() const;
  // Starts a pass over the current epoch (see above); blocks only to join a previous pass's
  // workers. Throws what the sampler throws, or std::system_error if a thread cannot start.
  Iterator begin();
  std::default_sentinel_t end() const { return {}; }

  // Sets the sampler's epoch for the next pass (propagates to the sampler). Keeps a pending
  // load_state() skip only when `epoch` is the saved epoch.
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return sampler_->epoch(); }
  // {epoch, batches the consumer has received in it}.
  State state() const;
  // Makes the next pass resume `state`. Throws ValueError when epoch < 0 or batches_consumed
  // is outside [0, size()].
  void load_state(const State& state);

  Sampler& sampler() { return *sampler_; }
  const Dataset& dataset() const { return dataset_; }
  const Options& options() const { return options_; }

 private:
  struct Pass;
  Batch take(uint64_t generation, int64_t k);

  const Dataset& dataset_;  // owned by the caller
  Options options_;
  std::unique_ptr<Sampler> owned_sampler_;  // when options_.sampler is null
  Sampler* sampler_;                        // owned_sampler_ or the caller's
  std::unique_ptr<Pass> pass_;
  uint64_t generation_ = 0;     // passes started; iterators carry theirs
  bool auto_advance_ = false;   // the next pass starts the next epoch (owned sampler only)
  uint64_t pass_epoch_sets_ = 0;  // the sampler's epoch_sets() when the last pass began
  std::optional<State> resume_;
  bool started_ = false;        // a pass has started since construction / load_state
  int64_t pass_epoch_ = 0;      // epoch of the current pass
  int64_t consumed_ = 0;        // batches of pass_epoch_ the consumer has received
};

}  // namespace tandem::data
