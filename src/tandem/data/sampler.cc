#include "tandem/data/sampler.h"

#include <array>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>

#include "tandem/core/error.h"
#include "tandem/core/rng.h"
#include "tandem/dist/process_group.h"

namespace tandem::data {

std::vector<int64_t> randperm(int64_t n, uint64_t seed) {
  TANDEM_CHECK(n >= 0, ValueError, "randperm: n must be >= 0, got {}", n);
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), int64_t{0});
  // Fisher-Yates from the back: swap step s (position i = n-1-s) uses the s-th 64-bit draw of
  // the Philox stream (block s/2, words 2(s%2) and 2(s%2)+1). j = floor(r * (i+1) / 2^64) is
  // uniform in [0, i] up to a bias below (i+1)/2^64.
  std::array<uint32_t, 4> block{};
  for (int64_t s = 0; s + 1 < n; ++s) {
    if (s % 2 == 0) block = philox4x32(static_cast<uint64_t>(s / 2), 0, seed);
    const uint64_t r = (uint64_t{block[2 * (s % 2)]} << 32) | block[2 * (s % 2) + 1];
    const int64_t i = n - 1 - s;
    const auto j = static_cast<int64_t>((static_cast<unsigned __int128>(r) * static_cast<uint64_t>(i + 1)) >> 64);
    std::swap(p[static_cast<size_t>(i)], p[static_cast<size_t>(j)]);
  }
  return p;
}

SequentialSampler::SequentialSampler(int64_t size) : size_(size) {
  TANDEM_CHECK(size >= 0, ValueError, "SequentialSampler: size must be >= 0, got {}", size);
}

std::vector<int64_t> SequentialSampler::indices() const {
  std::vector<int64_t> v(static_cast<size_t>(size_));
  std::iota(v.begin(), v.end(), int64_t{0});
  return v;
}

RandomSampler::RandomSampler(int64_t size, uint64_t seed) : size_(size), seed_(seed) {
  TANDEM_CHECK(size >= 0, ValueError, "RandomSampler: size must be >= 0, got {}", size);
}

std::vector<int64_t> RandomSampler::indices() const { return randperm(size_, seed_ + static_cast<uint64_t>(epoch_)); }

namespace {

// The integer in environment variable `name`, or `fallback` when unset or empty.
int64_t env_int(const char* name, int64_t fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  int64_t v = 0;
  const char* end = s + std::strlen(s);
  const auto [ptr, ec] = std::from_chars(s, end, v);
  TANDEM_CHECK(ec == std::errc() && ptr == end, ValueError,
               "DistributedSampler: environment variable {}=\"{}\" is not an integer", name, s);
  return v;
}

}  // namespace

DistributedSampler::DistributedSampler(int64_t dataset_size, const Options& options)
    : dataset_size_(dataset_size), options_(options) {
  TANDEM_CHECK(dataset_size >= 0, ValueError, "DistributedSampler: dataset_size must be >= 0, got {}", dataset_size);
  // As torch's: from the default process group when there is one (launched by mpirun or srun,
  // init_process_group reads OMPI_*/SLURM_* and no RANK/WORLD_SIZE need exist); else from
  // $WORLD_SIZE/$RANK (tandem run / torchrun set them), else 1 and 0.
  const bool group = dist::is_initialized();
  if (!group && !options.num_replicas && std::getenv("WORLD_SIZE") == nullptr) {
    // (SLURM_NTASKS is no proof: an sbatch script runs as one process with it set; srun sets
    // SLURM_STEP_NUM_TASKS for the processes it starts.)
    for (const char* launcher : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"}) {
      const int64_t n = env_int(launcher, 1);
      TANDEM_CHECK(n <= 1, ValueError,
                   "DistributedSampler: {}={} says this is one of {} processes, but there is no process group and no "
                   "WORLD_SIZE: every process would take the whole dataset. Call dist::init_process_group() before "
                   "making the sampler, or pass num_replicas and rank",
                   launcher, n, n);
    }
  }
  num_replicas_ = options.num_replicas ? *options.num_replicas
                  : group            ? dist::get_world_size()
                                     : env_int("WORLD_SIZE", 1);
  rank_ = options.rank ? *options.rank : group ? dist::get_rank() : env_int("RANK", 0);
  TANDEM_CHECK(num_replicas_ >= 1, ValueError, "DistributedSampler: num_replicas must be >= 1, got {}", num_replicas_);
  TANDEM_CHECK(rank_ >= 0 && rank_ < num_replicas_, ValueError,
               "DistributedSampler: invalid rank {}, rank should be in the interval [0, {}] for num_replicas={}", rank_,
               num_replicas_ - 1, num_replicas_);
  // torch: num_samples = ceil((N - R) / R) when drop_last and R does not divide N, which is
  // floor(N / R) for every N >= 0; else ceil(N / R).
  // (N + R - 1) / R would overflow for R near INT64_MAX; this form cannot.
  TANDEM_CHECK(options.block >= 0, ValueError, "DistributedSampler: block must be >= 0, got {}", options.block);
  if (options.block > 0) {
    const int64_t blocks = dataset_size_ / options.block / num_replicas_;  // per rank
    num_samples_ = blocks * options.block;
  } else {
    num_samples_ = dataset_size_ / num_replicas_ + (!options.drop_last && dataset_size_ % num_replicas_ != 0 ? 1 : 0);
  }
  total_size_ = num_samples_ * num_replicas_;
}

std::vector<int64_t> DistributedSampler::indices() const {
  // 1. the epoch's order of the whole dataset
  std::vector<int64_t> all;
  if (options_.shuffle) {
    all = randperm(dataset_size_, options_.seed + static_cast<uint64_t>(epoch_));
  } else {
    all.resize(static_cast<size_t>(dataset_size_));
    std::iota(all.begin(), all.end(), int64_t{0});
  }
  // 2 + 3. position p of the padded (or truncated) list is all[p % N]; rank r takes
  // positions r, r + R, r + 2R, ... below total_size (counted by j: p + R could overflow).
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  if (const int64_t b = options_.block; b > 0) {
    for (int64_t j = 0; j < num_samples_ / b; ++j) {
      const int64_t start = (j * num_replicas_ + rank_) * b;
      mine.insert(mine.end(), all.begin() + start, all.begin() + start + b);
    }
    return mine;
  }
  for (int64_t j = 0; j < num_samples_; ++j) {
    const int64_t p = rank_ + j * num_replicas_;  // < total_size = num_samples * R
    mine.push_back(all[static_cast<size_t>(p % dataset_size_)]);
  }
  return mine;
}

}  // namespace tandem::data
