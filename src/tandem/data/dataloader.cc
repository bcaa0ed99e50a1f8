#include "tandem/data/dataloader.h"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "tandem/core/error.h"

namespace tandem::data {
namespace {

// Rethrows `e` as the same tandem::Error type with `prefix` before its message; other
// exceptions become tandem::Error.
[[noreturn]] void rethrow_with_context(const std::exception_ptr& e, const std::string& prefix) {
  try {
    std::rethrow_exception(e);
  } catch (const IOError& x) {
    throw IOError(prefix + x.what());
  } catch (const ValueError& x) {
    throw ValueError(prefix + x.what());
  } catch (const ShapeError& x) {
    throw ShapeError(prefix + x.what());
  } catch (const DTypeError& x) {
    throw DTypeError(prefix + x.what());
  } catch (const AutogradError& x) {
    throw AutogradError(prefix + x.what());
  } catch (const std::exception& x) {
    throw Error(prefix + x.what());
  } catch (...) {
    throw Error(prefix + "unknown exception (not derived from std::exception)");
  }
}

// ceil or floor of n / batch_size; (n + batch_size - 1) / batch_size would overflow for a
// batch_size near INT64_MAX (torch: one batch of everything).
int64_t batches_for(int64_t n, int64_t batch_size, bool drop_last) {
  return n / batch_size + (!drop_last && n % batch_size != 0 ? 1 : 0);
}

// Batches in flight or waiting at once: num_workers * prefetch_factor, saturated instead of
// overflowing, and never more than the pass has batches (the slots beyond could not be used).
int64_t prefetch_capacity(int64_t num_workers, int64_t prefetch_factor, int64_t num_batches) {
  int64_t capacity = 0;
  if (__builtin_mul_overflow(num_workers, prefetch_factor, &capacity)) capacity = INT64_MAX;
  return std::min(capacity, num_batches);
}

}  // namespace

// One pass over an epoch: the indices, the workers, and the slots where finished batches wait.
// Slot k % capacity holds batch k: a worker may start batch k only while
// k < next_consume + capacity, so two batches in flight never share a slot.
struct DataLoader::Pass {
  struct Slot {
    bool ready = false;
    Batch batch;
    std::exception_ptr error;  // what get_batch threw for this batch
  };

  Pass(const Dataset& dataset, std::vector<int64_t> indices, int64_t batch_size, bool drop_last, int64_t epoch,
       int64_t capacity)
      : dataset(dataset),
        indices(std::move(indices)),
        batch_size(batch_size),
        num_batches(batches_for(static_cast<int64_t>(this->indices.size()), batch_size, drop_last)),
        epoch(epoch),
        capacity(capacity),
        slots(static_cast<size_t>(std::max<int64_t>(capacity, 1))) {}

  ~Pass() { shutdown(); }

  std::string context(int64_t k) const { return fmt::format("DataLoader: batch {} of epoch {}: ", k, epoch); }

  // Batch k: indices [k * batch_size, min((k + 1) * batch_size, n)).
  Batch produce(int64_t k) const {
    const int64_t lo = k * batch_size;
    const int64_t hi = std::min<int64_t>(lo + batch_size, static_cast<int64_t>(indices.size()));
    return dataset.get_batch(std::span<const int64_t>(indices).subspan(static_cast<size_t>(lo), static_cast<size_t>(hi - lo)));
  }

  void start_workers(int64_t n) {
    live_workers = n;
    threads.reserve(static_cast<size_t>(n));
    for (int64_t w = 0; w < n; ++w) threads.emplace_back([this] { worker_loop(); });
  }

  void worker_loop() noexcept {
    try {
      for (;;) {
        // Claim the next batch number once there is room for it.
        int64_t k;
        {
          std::unique_lock<std::mutex> lock(mu);
          space_cv.wait(lock, [&] { return stop || next_produce >= num_batches || next_produce < next_consume + capacity; });
          if (stop || next_produce >= num_batches) break;
          k = next_produce++;
        }
        // Make it outside the lock; an exception is the batch's result.
        Slot out;
        try {
          out.batch = produce(k);
        } catch (...) {
          out.error = std::current_exception();
        }
        out.ready = true;
        {
          std::lock_guard<std::mutex> lock(mu);
          slots[static_cast<size_t>(k % capacity)] = std::move(out);
        }
        ready_cv.notify_all();
      }
    } catch (...) {
      // Only the bookkeeping above could get here (e.g. bad_alloc); the consumer must not wait
      // for a batch this worker will never deliver.
      std::lock_guard<std::mutex> lock(mu);
      if (!fatal) fatal = std::current_exception();
      stop = true;
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      --live_workers;
    }
    ready_cv.notify_all();
    space_cv.notify_all();
  }

  // The consumer's next batch, k == next_consume. Blocks until a worker delivers it; never
  // waits once no worker is left to deliver it.
  Batch take(int64_t k) {
    TANDEM_CHECK(failed_at < 0, ValueError,
                 "DataLoader: epoch {} ended at the error in batch {}; start a new pass to read batch {}", epoch,
                 failed_at, k);
    if (threads.empty()) {
      try {
        Batch b = produce(k);
        next_consume = k + 1;
        return b;
      } catch (...) {
        failed_at = k;
        rethrow_with_context(std::current_exception(), context(k));
      }
    }
    Slot got;
    {
      std::unique_lock<std::mutex> lock(mu);
      Slot& slot = slots[static_cast<size_t>(k % capacity)];
      ready_cv.wait(lock, [&] { return slot.ready || fatal || live_workers == 0; });
      if (!slot.ready) {
        stop = true;
        failed_at = k;
        lock.unlock();
        space_cv.notify_all();
        if (fatal) rethrow_with_context(fatal, context(k) + "a worker failed: ");
        throw Error(context(k) + "every worker exited before making it");
      }
      got = std::move(slot);
      slot = Slot{};
      next_consume = k + 1;
      if (got.error) {  // the pass ends at its first error
        stop = true;
        failed_at = k;
      }
    }
    space_cv.notify_all();
    if (got.error) rethrow_with_context(got.error, context(k));
    return std::move(got.batch);
  }

  void shutdown() noexcept {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    space_cv.notify_all();
    for (std::thread& t : threads) {
      try {
        if (t.joinable()) t.join();
      } catch (...) {
        // join only throws for a thread that is not joinable; nothing to do.
      }
    }
    threads.clear();
  }

  const Dataset& dataset;
  const std::vector<int64_t> indices;
  const int64_t batch_size;
  const int64_t num_batches;
  const int64_t epoch;
  const int64_t capacity;  // batches in flight or waiting, at most
  int64_t failed_at = -1;  // the batch whose error ended the pass (consumer's thread only)

  std::mutex mu;                    // guards everything below
  std::condition_variable space_cv;  // workers: room for another batch, or stop
  std::condition_variable ready_cv;  // consumer: a slot filled, or a worker exited
  int64_t next_produce = 0;          // next batch number a worker will claim
  int64_t next_consume = 0;          // next batch number the consumer will take
  std::vector<Slot> slots;
  bool stop = false;
  int64_t live_workers = 0;
  std::exception_ptr fatal;  // a worker died outside get_batch
  std::vector<std::thread> threads;
};

// ---- Iterator ----

Batch& DataLoader::Iterator::operator*() {
  if (!fetched_) {
    TANDEM_CHECK(pos_ < end_, ValueError, "DataLoader: iterator dereferenced past the last batch ({})", end_);
    TANDEM_CHECK(!taken_, ValueError, "DataLoader: batch {} already failed; advance the iterator or start a new pass",
                 pos_);
    taken_ = true;  // even if take() throws: the pass has moved past this batch
    batch_ = loader_->take(generation_, pos_);
    fetched_ = true;
  }
  return batch_;
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  if (!taken_ && pos_ < end_) **this;  // stepping over a batch consumes it, in order
  ++pos_;
  fetched_ = false;
  taken_ = false;
  batch_ = Batch();
  return *this;
}

// ---- DataLoader ----

DataLoader::DataLoader(const Dataset& dataset, const Options& options) : dataset_(dataset), options_(options) {
  TANDEM_CHECK(options.batch_size >= 1, ValueError, "DataLoader: batch_size must be >= 1, got {}", options.batch_size);
  TANDEM_CHECK(options.num_workers >= 0, ValueError, "DataLoader: num_workers must be >= 0, got {}", options.num_workers);
  TANDEM_CHECK(options.prefetch_factor >= 1, ValueError, "DataLoader: prefetch_factor must be >= 1, got {}",
               options.prefetch_factor);
  TANDEM_CHECK(!(options.shuffle && options.sampler != nullptr), ValueError,
               "DataLoader: sampler option is mutually exclusive with shuffle=true (shuffle inside the sampler)");
  if (options.sampler != nullptr) {
    sampler_ = options.sampler;
  } else {
    if (options.shuffle) {
      owned_sampler_ = std::make_unique<RandomSampler>(dataset.size(), options.seed);
    } else {
      owned_sampler_ = std::make_unique<SequentialSampler>(dataset.size());
    }
    sampler_ = owned_sampler_.get();
  }
}

DataLoader::~DataLoader() { pass_.reset(); }

int64_t DataLoader::size() const { return batches_for(sampler_->size(), options_.batch_size, options_.drop_last); }

DataLoader::Iterator DataLoader::begin() {
  pass_.reset();  // stops and joins the previous pass's workers
  ++generation_;
  // The owned sampler advances to the next epoch, unless the caller set one since the last pass
  // (through loader.sampler().set_epoch: an epoch set explicitly wins, as in torch).
  if (auto_advance_ && sampler_->epoch_sets() == pass_epoch_sets_) sampler_->set_epoch(sampler_->epoch() + 1);
  auto_advance_ = false;
  const int64_t epoch = sampler_->epoch();
  int64_t skip = 0;
  if (resume_) {
    if (resume_->epoch == epoch) skip = resume_->batches_consumed;
    resume_.reset();
  }
  std::vector<int64_t> indices = sampler_->indices();
  const int64_t capacity = prefetch_capacity(options_.num_workers, options_.prefetch_factor,
                                             batches_for(static_cast<int64_t>(indices.size()), options_.batch_size,
                                                         options_.drop_last));
  auto pass = std::make_unique<Pass>(dataset_, std::move(indices), options_.batch_size, options_.drop_last, epoch,
                                     capacity);
  skip = std::min(skip, pass->num_batches);
  pass->next_produce = pass->next_consume = skip;
  if (options_.num_workers > 0 && skip < pass->num_batches) pass->start_workers(options_.num_workers);
  const int64_t num_batches = pass->num_batches;
  pass_ = std::move(pass);
  auto_advance_ = owned_sampler_ != nullptr;
  pass_epoch_sets_ = sampler_->epoch_sets();
  started_ = true;
  pass_epoch_ = epoch;
  consumed_ = skip;
  return Iterator(this, generation_, skip, num_batches);
}

Batch DataLoader::take(uint64_t generation, int64_t k) {
  TANDEM_CHECK(pass_ != nullptr && generation == generation_, ValueError,
               "DataLoader: this iterator belongs to an earlier pass; a later begin() replaced it");
  Batch b = pass_->take(k);
  consumed_ = k + 1;
  return b;
}

void DataLoader::set_epoch(int64_t epoch) {
  sampler_->set_epoch(epoch);
  auto_advance_ = false;
  if (resume_ && resume_->epoch != epoch) resume_.reset();
}

DataLoader::State DataLoader::state() const {
  const int64_t epoch = sampler_->epoch();
  // A pending resume holds only while the sampler is still at its epoch (the caller may have
  // called sampler.set_epoch() since, which makes the next pass a fresh epoch).
  if (resume_ && resume_->epoch == epoch) return *resume_;
  if (!started_ || epoch != pass_epoch_) return {epoch, 0};
  return {pass_epoch_, consumed_};
}

void DataLoader::load_state(const State& state) {
  TANDEM_CHECK(state.epoch >= 0, ValueError, "DataLoader::load_state: epoch must be >= 0, got {}", state.epoch);
  TANDEM_CHECK(state.batches_consumed >= 0 && state.batches_consumed <= size(), ValueError,
               "DataLoader::load_state: batches_consumed={} is outside [0, {}] (batches per epoch)",
               state.batches_consumed, size());
  sampler_->set_epoch(state.epoch);
  resume_ = state;
  auto_advance_ = false;
  started_ = false;  // what the last pass consumed no longer describes the next one
}

}  // namespace tandem::data
