// Samplers: DistributedSampler against PyTorch's partition rule (hard-coded lists and the torch
// oracle), shuffled coverage and padding, epochs, env defaults; randperm's uniformity.
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tandem/data/sampler.h"
#include "parallel/ranks.h"
#include "util/test_util.h"

namespace td = tandem;
using td::data::DistributedSampler;
using Indices = std::vector<int64_t>;

namespace {

std::vector<Indices> all_ranks(int64_t n, int64_t r, bool shuffle, bool drop_last, uint64_t seed = 0, int64_t epoch = 0) {
  std::vector<Indices> out;
  for (int64_t rank = 0; rank < r; ++rank) {
    DistributedSampler s(n, {.num_replicas = r, .rank = rank, .shuffle = shuffle, .seed = seed, .drop_last = drop_last});
    s.set_epoch(epoch);
    out.push_back(s.indices());
    EXPECT_EQ(static_cast<int64_t>(out.back().size()), s.size());
  }
  return out;
}

// The list the ranks were cut from: position p = rank + j * R.
Indices interleave(const std::vector<Indices>& ranks) {
  Indices all;
  for (size_t j = 0; !ranks.empty() && j < ranks[0].size(); ++j)
    for (const Indices& r : ranks) all.push_back(r[j]);
  return all;
}

// Scoped environment variable.
struct EnvVar {
  std::string name;
  std::string old;
  bool had;
  EnvVar(const char* n, const char* value) : name(n) {
    const char* o = std::getenv(n);
    had = o != nullptr;
    if (had) old = o;
    if (value) setenv(n, value, 1); else unsetenv(n);
  }
  ~EnvVar() {
    if (had) setenv(name.c_str(), old.c_str(), 1); else unsetenv(name.c_str());
  }
};

}  // namespace

// ---- PyTorch's rule, hard-coded (from torch/utils/data/distributed.py, shuffle=False) ----

TEST(DistributedSampler, TenOverThreePadsFromTheStart) {
  // num_samples = ceil(10/3) = 4, total 12: [0..9, 0, 1] cut with stride 3.
  EXPECT_EQ(all_ranks(10, 3, false, false), (std::vector<Indices>{{0, 3, 6, 9}, {1, 4, 7, 0}, {2, 5, 8, 1}}));
}

TEST(DistributedSampler, TenOverThreeDropLastTruncates) {
  // num_samples = ceil((10-3)/3) = 3, total 9: [0..8].
  EXPECT_EQ(all_ranks(10, 3, false, true), (std::vector<Indices>{{0, 3, 6}, {1, 4, 7}, {2, 5, 8}}));
}

TEST(DistributedSampler, SevenOverFour) {
  EXPECT_EQ(all_ranks(7, 4, false, false), (std::vector<Indices>{{0, 4}, {1, 5}, {2, 6}, {3, 0}}));
  EXPECT_EQ(all_ranks(7, 4, false, true), (std::vector<Indices>{{0}, {1}, {2}, {3}}));
}

TEST(DistributedSampler, FewerSamplesThanReplicasWrapsSeveralTimes) {
  // padding 3 > len 2: (indices * 2)[:3] = [0, 1, 0] -> [0, 1, 0, 1, 0].
  EXPECT_EQ(all_ranks(2, 5, false, false), (std::vector<Indices>{{0}, {1}, {0}, {1}, {0}}));
  EXPECT_EQ(all_ranks(2, 5, false, true), (std::vector<Indices>{{}, {}, {}, {}, {}}));
  EXPECT_EQ(all_ranks(0, 3, false, false), (std::vector<Indices>{{}, {}, {}}));
}

TEST(DistributedSampler, SizesAndTotalSize) {
  DistributedSampler a(10, {.num_replicas = 3, .rank = 2, .shuffle = false});
  EXPECT_EQ(a.size(), 4);
  EXPECT_EQ(a.total_size(), 12);
  DistributedSampler b(10, {.num_replicas = 3, .rank = 2, .drop_last = true});
  EXPECT_EQ(b.size(), 3);
  EXPECT_EQ(b.total_size(), 9);
  DistributedSampler c(12, {.num_replicas = 3, .rank = 0, .drop_last = true});
  EXPECT_EQ(c.size(), 4);
}

TEST(DistributedSampler, HugeNumReplicasDoesNotOverflow) {
  // ceil(5 / R) = 1 for any R >= 5; rank r takes position r of the padded list, i.e. r % 5.
  // (N + R - 1) / R and p += R overflowed here: size 0, or positions past the end.
  const int64_t big = std::numeric_limits<int64_t>::max();
  DistributedSampler first(5, {.num_replicas = big, .rank = 0, .shuffle = false});
  EXPECT_EQ(first.size(), 1);
  EXPECT_EQ(first.indices(), Indices{0});
  DistributedSampler last(5, {.num_replicas = big, .rank = big - 1, .shuffle = false});
  EXPECT_EQ(last.indices(), Indices{(big - 1) % 5});
  DistributedSampler dropped(5, {.num_replicas = big, .rank = 3, .drop_last = true});
  EXPECT_EQ(dropped.size(), 0);
  EXPECT_TRUE(dropped.indices().empty());
}

// ---- shuffled: coverage and padding ----

TEST(DistributedSampler, ShuffledRanksCoverEveryIndexOnceThenPadFromTheStart) {
  for (auto [n, r] : std::vector<std::pair<int64_t, int64_t>>{{10, 3}, {7, 4}, {2, 5}, {101, 8}, {64, 4}}) {
    const Indices all = interleave(all_ranks(n, r, true, false, /*seed=*/42, /*epoch=*/3));
    ASSERT_EQ(static_cast<int64_t>(all.size()), (n + r - 1) / r * r);
    std::set<int64_t> first(all.begin(), all.begin() + n);
    EXPECT_EQ(static_cast<int64_t>(first.size()), n) << "N=" << n << " R=" << r;
    EXPECT_EQ(*first.begin(), 0);
    EXPECT_EQ(*first.rbegin(), n - 1);
    for (size_t p = static_cast<size_t>(n); p < all.size(); ++p) EXPECT_EQ(all[p], all[p % n]) << "N=" << n << " p=" << p;
  }
}

TEST(DistributedSampler, ShuffledDropLastIsAPrefixOfThePermutation) {
  const Indices all = interleave(all_ranks(10, 3, true, true, 7, 0));
  const Indices perm = td::data::randperm(10, 7);
  EXPECT_EQ(all, Indices(perm.begin(), perm.begin() + 9));
  EXPECT_EQ(std::set<int64_t>(all.begin(), all.end()).size(), 9u);
}

TEST(DistributedSampler, ShuffleUsesSeedPlusEpoch) {
  const Indices all = interleave(all_ranks(10, 2, true, false, 5, 2));
  EXPECT_EQ(all, td::data::randperm(10, 7));
}

TEST(DistributedSampler, SetEpochChangesTheOrderDeterministically) {
  DistributedSampler s(100, {.num_replicas = 2, .rank = 1, .seed = 3});
  const Indices e0 = s.indices();
  s.set_epoch(1);
  const Indices e1 = s.indices();
  EXPECT_NE(e0, e1);
  EXPECT_EQ(s.epoch(), 1);
  s.set_epoch(0);
  EXPECT_EQ(s.indices(), e0);
  DistributedSampler t(100, {.num_replicas = 2, .rank = 1, .seed = 3});
  t.set_epoch(1);
  EXPECT_EQ(t.indices(), e1);
  DistributedSampler other_seed(100, {.num_replicas = 2, .rank = 1, .seed = 4});
  EXPECT_NE(other_seed.indices(), e0);
  // Without shuffle the epoch does not matter.
  DistributedSampler plain(10, {.num_replicas = 3, .rank = 0, .shuffle = false});
  plain.set_epoch(9);
  EXPECT_EQ(plain.indices(), (Indices{0, 3, 6, 9}));
}

TEST(DistributedSampler, Iterates) {
  DistributedSampler s(10, {.num_replicas = 3, .rank = 1, .shuffle = false});
  Indices seen;
  for (int64_t i : s) seen.push_back(i);
  EXPECT_EQ(seen, (Indices{1, 4, 7, 0}));
}

// ---- arguments and environment ----

TEST(DistributedSampler, InvalidRankNamesRankAndReplicas) {
  try {
    DistributedSampler s(10, {.num_replicas = 4, .rank = 4});
    FAIL() << "expected ValueError";
  } catch (const td::ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 4"), std::string::npos) << m;
    EXPECT_NE(m.find("num_replicas=4"), std::string::npos) << m;
  }
  EXPECT_THROW(DistributedSampler(10, {.num_replicas = 2, .rank = -1}), td::ValueError);
  EXPECT_THROW(DistributedSampler(10, {.num_replicas = 0, .rank = 0}), td::ValueError);
  EXPECT_THROW(DistributedSampler(-1, {.num_replicas = 1, .rank = 0}), td::ValueError);
}

TEST(DistributedSampler, DefaultsFromEnvironment) {
  {
    EnvVar w("WORLD_SIZE", nullptr), r("RANK", nullptr);
    DistributedSampler s(10);
    EXPECT_EQ(s.num_replicas(), 1);
    EXPECT_EQ(s.rank(), 0);
  }
  {
    EnvVar w("WORLD_SIZE", "4"), r("RANK", "3");
    DistributedSampler s(10, {.shuffle = false});
    EXPECT_EQ(s.num_replicas(), 4);
    EXPECT_EQ(s.rank(), 3);
    EXPECT_EQ(s.indices(), (Indices{3, 7, 1}));
    DistributedSampler explicit_args(10, {.num_replicas = 2, .rank = 0});
    EXPECT_EQ(explicit_args.num_replicas(), 2);
  }
  {
    EnvVar w("WORLD_SIZE", "two"), r("RANK", "0");
    EXPECT_THROW(DistributedSampler(10), td::ValueError);
  }
  {
    EnvVar w("WORLD_SIZE", "2"), r("RANK", "2");
    EXPECT_THROW(DistributedSampler(10), td::ValueError);
  }
}

// With a process group, num_replicas and rank default from it, as torch's (an mpirun or srun
// launch sets OMPI_*/SLURM_*, which init_process_group reads, and no WORLD_SIZE/RANK: every rank
// took the whole dataset). Without one, a launcher's process count > 1 and no WORLD_SIZE is an
// error saying so.
TEST(DistributedSampler, DefaultsFromTheProcessGroupWhenThereIsOne) {
  td::testing::on_ranks(
      2,
      [](std::shared_ptr<td::dist::ProcessGroup> group) {
        unsetenv("WORLD_SIZE");
        unsetenv("RANK");
        DistributedSampler s(10, {.shuffle = false});
        if (s.num_replicas() != 2 || s.rank() != group->rank()) {
          td::testing::fail("num_replicas " + std::to_string(s.num_replicas()) + " rank " + std::to_string(s.rank()));
        }
      },
      std::chrono::seconds(60), std::chrono::seconds(30));
  EnvVar w("WORLD_SIZE", nullptr), r("RANK", nullptr), o("OMPI_COMM_WORLD_SIZE", "4");
  try {
    DistributedSampler s(10);
    ADD_FAILURE() << "expected ValueError";
  } catch (const td::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD_SIZE=4"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("init_process_group"), std::string::npos) << e.what();
  }
  EXPECT_EQ(DistributedSampler(10, {.num_replicas = 4, .rank = 1}).rank(), 1);
  // An sbatch script runs as one process with SLURM_NTASKS set: no proof of several processes.
  EnvVar no_ompi("OMPI_COMM_WORLD_SIZE", nullptr), ntasks("SLURM_NTASKS", "8");
  EXPECT_EQ(DistributedSampler(10).num_replicas(), 1);
}

// ---- the PyTorch oracle (shuffle=False; torch's randperm differs from ours by design) ----

TEST(DistributedSampler, MatchesTorchWithoutShuffle) {
  struct Case { int64_t n, r; bool drop; };
  std::vector<Case> cases;
  for (int64_t n : {0, 1, 2, 7, 10, 17, 100})
    for (int64_t r : {1, 2, 3, 4, 5, 8})
      for (bool drop : {false, true}) cases.push_back({n, r, drop});
  std::string spec;
  for (const Case& c : cases) spec += fmt::format("({},{},{}),", c.n, c.r, c.drop ? "True" : "False");
  // One interpreter start (importing torch takes seconds): exit 77 means "no torch here".
  const std::string script =
      "import sys\n"
      "try:\n"
      "  from torch.utils.data.distributed import DistributedSampler as D\n"
      "except ImportError:\n"
      "  sys.exit(77)\n"
      "for n, r, drop in [" + spec + "]:\n"
      "  for k in range(r):\n"
      "    print(n, r, int(drop), k, ':', *list(D(range(n), num_replicas=r, rank=k, shuffle=False, drop_last=drop)))\n";
  td::testing::TempDir dir;
  const std::string py = dir.path() + "/oracle.py", out = dir.path() + "/out.txt";
  std::ofstream(py) << script;
  const char* env_python = std::getenv("TANDEM_TORCH_PYTHON");
  const std::string python = env_python && *env_python ? env_python : "/usr/bin/python3";
  const std::string cmd = python + " " + py + " > " + out + " 2>&1";
  const int rc = std::system(cmd.c_str());
  if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) == 77 || WEXITSTATUS(rc) == 127) {
    GTEST_SKIP() << "needs PyTorch as the oracle: " << python
                 << " cannot import torch (install python3-torch with scripts/install-deps.sh)";
  }
  ASSERT_EQ(WEXITSTATUS(rc), 0) << cmd << " failed; output in " << out;
  std::map<std::string, Indices> torch;
  std::ifstream in(out);
  for (std::string line; std::getline(in, line);) {
    const auto colon = line.find(':');
    std::istringstream rest(line.substr(colon + 1));
    Indices v;
    for (int64_t i; rest >> i;) v.push_back(i);
    torch[line.substr(0, colon)] = v;
  }
  size_t compared = 0;
  for (const Case& c : cases) {
    for (int64_t k = 0; k < c.r; ++k) {
      const std::string key = fmt::format("{} {} {} {} ", c.n, c.r, c.drop ? 1 : 0, k);
      ASSERT_TRUE(torch.count(key)) << "no torch output for " << key;
      DistributedSampler s(c.n, {.num_replicas = c.r, .rank = k, .shuffle = false, .drop_last = c.drop});
      EXPECT_EQ(s.indices(), torch[key]) << "N=" << c.n << " R=" << c.r << " drop_last=" << c.drop << " rank=" << k;
      ++compared;
    }
  }
  EXPECT_EQ(compared, torch.size());
}

// ---- randperm and the plain samplers ----

TEST(Randperm, IsAPermutationAndDeterministic) {
  const Indices p = td::data::randperm(1000, 11);
  EXPECT_EQ(std::set<int64_t>(p.begin(), p.end()).size(), 1000u);
  EXPECT_EQ(*std::min_element(p.begin(), p.end()), 0);
  EXPECT_EQ(*std::max_element(p.begin(), p.end()), 999);
  EXPECT_EQ(td::data::randperm(1000, 11), p);
  EXPECT_NE(td::data::randperm(1000, 12), p);
  EXPECT_TRUE(td::data::randperm(0, 1).empty());
  EXPECT_EQ(td::data::randperm(1, 1), Indices{0});
  EXPECT_THROW(td::data::randperm(-1, 0), td::ValueError);
}

TEST(Randperm, AllPermutationsOfFourAreEquallyLikely) {
  // 24000 seeds, 24 permutations: each expected 1000 times (sd ~31). A biased shuffle (e.g.
  // Sattolo's, or j drawn from [0, i)) misses permutations entirely or skews them far more.
  std::map<Indices, int> count;
  for (uint64_t seed = 0; seed < 24000; ++seed) ++count[td::data::randperm(4, seed)];
  EXPECT_EQ(count.size(), 24u);
  for (const auto& [perm, c] : count) {
    EXPECT_GT(c, 850);
    EXPECT_LT(c, 1150);
  }
}

TEST(Samplers, SequentialAndRandom) {
  td::data::SequentialSampler seq(5);
  EXPECT_EQ(seq.indices(), (Indices{0, 1, 2, 3, 4}));
  EXPECT_EQ(seq.size(), 5);
  td::data::RandomSampler rnd(50, 9);
  const Indices e0 = rnd.indices();
  EXPECT_EQ(e0, td::data::randperm(50, 9));
  EXPECT_EQ(rnd.indices(), e0);  // a function of (seed, epoch), not of how often it was asked
  rnd.set_epoch(1);
  EXPECT_EQ(rnd.indices(), td::data::randperm(50, 10));
  EXPECT_THROW(td::data::SequentialSampler(-2), td::ValueError);
  EXPECT_THROW(td::data::RandomSampler(-2), td::ValueError);
}

// ---- block > 0 (Tandem's, for DDP's deterministic mode) ----

TEST(DistributedSampler, BlocksAreDealtRoundRobinAndTheEpochIsCutToWholeRounds) {
  // 11 indices, blocks of 2 over 2 ranks: rounds of 4, two whole rounds (8 indices), 3 dropped.
  std::vector<Indices> got;
  for (int64_t r = 0; r < 2; ++r) {
    DistributedSampler s(11, {.num_replicas = 2, .rank = r, .shuffle = false, .block = 2});
    EXPECT_EQ(s.size(), 4);
    EXPECT_EQ(s.total_size(), 8);
    got.push_back(s.indices());
  }
  EXPECT_EQ(got, (std::vector<Indices>{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  EXPECT_THROW(DistributedSampler(11, {.num_replicas = 2, .rank = 0, .block = -1}), td::ValueError);
}

TEST(DistributedSampler, BlocksGiveEveryWorldSizeTheSameGlobalBatches) {
  // A step's global batch of 8 is 4 micro-batches of 2; on R ranks each takes 4 / R of them as
  // one block of 8 / R. Micro-batch i of rank r is global micro-batch r * (4 / R) + i of the
  // step, whatever R: the same 2 samples in the same order (shuffled, epoch 1).
  const int64_t n = 37, micro = 2, per_step = 8;
  std::vector<Indices> global;  // per R: the micro-batches in global order
  for (int64_t R : {1, 2, 4}) {
    const int64_t k = per_step / micro / R;
    std::vector<Indices> ranks;
    for (int64_t r = 0; r < R; ++r) {
      DistributedSampler s(n, {.num_replicas = R, .rank = r, .shuffle = true, .seed = 5, .block = k * micro});
      s.set_epoch(1);
      ranks.push_back(s.indices());
      EXPECT_EQ(s.size(), 32 / R);  // 4 whole steps of 8
    }
    Indices order;
    for (int64_t step = 0; step < 4; ++step) {
      for (int64_t r = 0; r < R; ++r) {
        const auto& mine = ranks[static_cast<size_t>(r)];
        order.insert(order.end(), mine.begin() + step * k * micro, mine.begin() + (step + 1) * k * micro);
      }
    }
    global.push_back(order);
  }
  EXPECT_EQ(global[0], global[1]);
  EXPECT_EQ(global[0], global[2]);
  Indices sorted = global[0];
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end());  // no sample twice
}
