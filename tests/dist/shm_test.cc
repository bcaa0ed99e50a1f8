// Tests of the shm backend. Ranks are threads of this process (each with its own group and its own
// mappings of the segments, exactly as separate processes would have) for the collective sweep;
// processes (dist::spawn) for what needs them: kill -9, a rank that never starts, init_method.
//
// Reference values: rank r's element i is a closed-form value (small multiples of 1/64 for floats,
// small integers otherwise), so sums and averages are computed exactly in f64 here; results must
// match exactly (f32/f64/integers) or within the one final 16-bit rounding (f16/bf16).
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tandem/dist/backends.h"
#include "tandem/dist/process_group.h"
#include "tandem/dist/shm_kernels.h"
#include "tandem/dist/spawn.h"

namespace tandem::dist {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---- values of any dtype through double ----

double get(const void* p, DType d, int64_t i) {
  switch (d) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::f16: return static_cast<float>(static_cast<const half*>(p)[i]);
    case DType::bf16: return static_cast<float>(static_cast<const bfloat16*>(p)[i]);
    case DType::i32: return static_cast<const int32_t*>(p)[i];
    case DType::i64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::u8: return static_cast<const uint8_t*>(p)[i];
    case DType::b8: return static_cast<const bool*>(p)[i] ? 1 : 0;
  }
  return 0;
}

void put(void* p, DType d, int64_t i, double v) {
  switch (d) {
    case DType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    case DType::f16: static_cast<half*>(p)[i] = half(static_cast<float>(v)); break;
    case DType::bf16: static_cast<bfloat16*>(p)[i] = bfloat16(static_cast<float>(v)); break;
    case DType::i32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::i64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    case DType::u8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
    case DType::b8: static_cast<bool*>(p)[i] = v != 0; break;
  }
}

// Rank r's element i: exactly representable in every dtype (bf16 keeps 8 significant bits:
// multiples of 1/16 below 16 need at most 8).
double value(DType d, int r, int64_t i) {
  if (d == DType::b8) return ((r + i) % 3) == 0;
  if (is_floating(d)) return static_cast<double>((r * 37 + i * 11) % 200) / 16.0 - 6.0;
  return static_cast<double>((r * 7 + i * 3) % 11 + 1);
}

double reduce_ref(DType d, ReduceOp op, int n, int64_t i, std::function<double(int)> v) {
  double acc = v(0);
  for (int r = 1; r < n; ++r) {
    const double x = v(r);
    switch (op) {
      case ReduceOp::SUM: case ReduceOp::AVG: acc += x; break;
      case ReduceOp::PRODUCT: acc *= x; break;
      case ReduceOp::MAX: acc = std::max(acc, x); break;
      case ReduceOp::MIN: acc = std::min(acc, x); break;
    }
  }
  if (op == ReduceOp::AVG) acc = is_floating(d) ? acc / n : std::trunc(acc / n);
  if (d == DType::u8) acc = static_cast<double>(static_cast<uint8_t>(static_cast<uint64_t>(acc)));  // wraps
  return acc;
}

// The tolerance of a reduced value: exact for integers and f32/f64 sums of these values
// (multiples of 1/16, far below 2^24); products round (n-1) times in f32/f64; f16/bf16 round
// once at the end (plus once more for AVG: sum/n in f32, then to 16 bits).
double tolerance(DType d, ReduceOp op, double ref) {
  if (!is_floating(d)) return 0;
  const double eps = d == DType::f32 ? 0x1p-24 : d == DType::f64 ? 0x1p-53 : d == DType::f16 ? 0x1p-11 : 0x1p-8;
  const double mag = std::max(std::fabs(ref), 1e-30);
  if (op == ReduceOp::PRODUCT) return 8 * eps * mag;
  if (d == DType::f16 || d == DType::bf16) return (op == ReduceOp::AVG ? 2.01 : 1.01) * eps * mag;
  if (op == ReduceOp::AVG) return 1.01 * eps * mag;
  return 0;
}

std::string where(const char* op, DType d, int n, int64_t count, int rank, int64_t i) {
  return fmt::format("{} {} world {} count {} rank {} element {}", op, shm::short_dtype_name(d), n, count, rank, i);
}

// ---- ranks as threads ----

std::atomic<int> g_run{0};

// Runs f(group) on n threads, each rank with its own shm group on a shared HashStore.
void run_ranks(int n, const std::function<void(ProcessGroup&)>& f, std::chrono::milliseconds timeout = 20s) {
  auto store = std::make_shared<HashStore>(timeout);
  const std::string prefix = fmt::format("run{}", g_run++);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto pg = make_shm_group(std::make_shared<PrefixStore>(prefix, store), r, n, ProcessGroupOptions{timeout});
        f(*pg);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

struct Buf {
  std::vector<uint8_t> bytes;
  Buffer b;
  Buf(DType d, int64_t count) : bytes(static_cast<size_t>(std::max<int64_t>(count, 1)) * element_size(d) + 64) {
    b = Buffer{bytes.data(), count, d, kCPU};
  }
};

const DType kAll[] = {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::u8};
const DType kMove[] = {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::u8, DType::b8};
// 0, 1, a prime, a count not divisible by 2, 3 or 4 that takes the large (chunked) path.
const int64_t kCounts[] = {0, 1, 997, 20003};

// One sweep of every collective for one world size; every rank checks its own outputs.
void sweep(ProcessGroup& pg) {
  const int n = pg.size(), me = pg.rank();
  auto expect_near = [&](double got, double want, double tol, const std::string& what) {
    if (!(std::fabs(got - want) <= tol)) throw std::runtime_error(fmt::format("{}: got {} want {}", what, got, want));
  };
  for (DType d : kAll) {
    for (int64_t count : kCounts) {
      // all_reduce, every op (in place), half of them on allocate()d (zero-copy) buffers
      for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::MAX, ReduceOp::MIN, ReduceOp::PRODUCT}) {
        std::shared_ptr<void> mem;
        Buf local(d, count);
        Buffer b = local.b;
        if (op == ReduceOp::SUM || op == ReduceOp::MAX) {
          mem = pg.allocate(b.nbytes());
          b.data = mem.get();
        }
        // PRODUCT on integers: keep within range (values 1..3 so 3^4 fits u8... wrapping is also checked)
        auto v = [&](int r, int64_t i) {
          double x = value(d, r, i);
          if (op == ReduceOp::PRODUCT) x = is_floating(d) ? std::fmod(x, 3.0) : std::fmod(x, 3.0) + 1;
          return x;
        };
        for (int64_t i = 0; i < count; ++i) put(b.data, d, i, v(me, i));
        pg.all_reduce(b, op)->wait();
        for (int64_t i = 0; i < count; ++i) {
          const double want = reduce_ref(d, op, n, i, [&](int r) { return v(r, i); });
          expect_near(get(b.data, d, i), want, tolerance(d, op, want),
                      where(fmt::format("all_reduce {}", reduce_op_name(op)).c_str(), d, n, count, me, i));
        }
      }
      // reduce to the last rank, SUM and MAX
      for (ReduceOp op : {ReduceOp::SUM, ReduceOp::MAX}) {
        Buf x(d, count);
        for (int64_t i = 0; i < count; ++i) put(x.b.data, d, i, value(d, me, i));
        const int root = n - 1;
        pg.reduce(x.b, root, op)->wait();
        if (me == root) {
          for (int64_t i = 0; i < count; ++i) {
            const double want = reduce_ref(d, op, n, i, [&](int r) { return value(d, r, i); });
            expect_near(get(x.b.data, d, i), want, tolerance(d, op, want), where("reduce", d, n, count, me, i));
          }
        }
      }
      // reduce_scatter: in has n * count elements
      for (ReduceOp op : {ReduceOp::SUM, ReduceOp::MIN}) {
        Buf in(d, count * n), out(d, count);
        for (int64_t i = 0; i < count * n; ++i) put(in.b.data, d, i, value(d, me, i));
        pg.reduce_scatter(out.b, in.b, op)->wait();
        for (int64_t i = 0; i < count; ++i) {
          const int64_t gi = me * count + i;
          const double want = reduce_ref(d, op, n, gi, [&](int r) { return value(d, r, gi); });
          expect_near(get(out.b.data, d, i), want, tolerance(d, op, want), where("reduce_scatter", d, n, count, me, i));
        }
      }
    }
  }
  for (DType d : kMove) {
    for (int64_t count : kCounts) {
      const int root = n > 1 ? 1 : 0;
      {  // broadcast from rank 1
        Buf x(d, count);
        for (int64_t i = 0; i < count; ++i) put(x.b.data, d, i, value(d, me, i));
        pg.broadcast(x.b, root)->wait();
        for (int64_t i = 0; i < count; ++i) expect_near(get(x.b.data, d, i), value(d, root, i), 0, where("broadcast", d, n, count, me, i));
      }
      {  // all_gather flat and list
        Buf in(d, count), out(d, count * n);
        for (int64_t i = 0; i < count; ++i) put(in.b.data, d, i, value(d, me, i));
        pg.all_gather(out.b, in.b)->wait();
        for (int r = 0; r < n; ++r)
          for (int64_t i = 0; i < count; ++i)
            expect_near(get(out.b.data, d, r * count + i), value(d, r, i), 0, where("all_gather", d, n, count, me, i));
        std::vector<Buf> outs;
        std::vector<Buffer> ob;
        for (int r = 0; r < n; ++r) outs.emplace_back(d, count);
        for (auto& o : outs) ob.push_back(o.b);
        pg.all_gather(ob, in.b)->wait();
        for (int r = 0; r < n; ++r)
          for (int64_t i = 0; i < count; ++i)
            expect_near(get(outs[r].b.data, d, i), value(d, r, i), 0, where("all_gather(list)", d, n, count, me, i));
      }
      {  // gather to rank 1
        Buf in(d, count), out(d, count * n);
        for (int64_t i = 0; i < count; ++i) put(in.b.data, d, i, value(d, me, i));
        pg.gather(out.b, in.b, root)->wait();
        if (me == root) {
          for (int r = 0; r < n; ++r)
            for (int64_t i = 0; i < count; ++i)
              expect_near(get(out.b.data, d, r * count + i), value(d, r, i), 0, where("gather", d, n, count, me, i));
        }
      }
      {  // scatter from rank 1
        Buf in(d, count * n), out(d, count);
        for (int64_t i = 0; i < count * n; ++i) put(in.b.data, d, i, value(d, me, i));
        pg.scatter(out.b, in.b, root)->wait();
        for (int64_t i = 0; i < count; ++i)
          expect_near(get(out.b.data, d, i), value(d, root, me * count + i), 0, where("scatter", d, n, count, me, i));
      }
      {  // all_to_all: block j of rank i's input lands in block i of rank j's output
        Buf in(d, count * n), out(d, count * n);
        for (int64_t i = 0; i < count * n; ++i) put(in.b.data, d, i, value(d, me, i));
        pg.all_to_all(out.b, in.b)->wait();
        for (int r = 0; r < n; ++r)
          for (int64_t i = 0; i < count; ++i)
            expect_near(get(out.b.data, d, r * count + i), value(d, r, me * count + i), 0, where("all_to_all", d, n, count, me, i));
      }
      if (n > 1) {  // send/recv around the ring, two messages with different tags
        Buf s(d, count), s2(d, count), rv(d, count), rv2(d, count);
        for (int64_t i = 0; i < count; ++i) {
          put(s.b.data, d, i, value(d, me, i));
          put(s2.b.data, d, i, value(d, me + 5, i));
        }
        auto w1 = pg.send(s.b, (me + 1) % n, 7);
        auto w2 = pg.send(s2.b, (me + 1) % n, 8);
        auto w3 = pg.recv(rv.b, (me + n - 1) % n, 7);
        auto w4 = pg.recv(rv2.b, (me + n - 1) % n, 8);
        for (auto& w : {w1, w2, w3, w4}) w->wait();
        const int from = (me + n - 1) % n;
        for (int64_t i = 0; i < count; ++i) {
          expect_near(get(rv.b.data, d, i), value(d, from, i), 0, where("recv", d, n, count, me, i));
          expect_near(get(rv2.b.data, d, i), value(d, from + 5, i), 0, where("recv", d, n, count, me, i));
        }
      }
    }
  }
  pg.barrier()->wait();
}

class ShmSweep : public ::testing::TestWithParam<int> {};

TEST_P(ShmSweep, EveryCollectiveEveryDtypeMatchesSerialReference) {
  run_ranks(GetParam(), [](ProcessGroup& pg) { sweep(pg); });
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmSweep, ::testing::Values(1, 2, 3, 4));

// Sets an environment variable for one test (rank 0 reads it when the group is made).
class ScopedEnv {
 public:
  ScopedEnv(const char* k, const char* v) : k_(k) {
    if (const char* old = std::getenv(k)) old_ = old;
    setenv(k, v, 1);
  }
  ~ScopedEnv() {
    if (old_) setenv(k_, old_->c_str(), 1);
    else unsetenv(k_);
  }

 private:
  const char* k_;
  std::optional<std::string> old_;
};

// Small all_reduce has two algorithms; rank 0 picks one for the group (push when there are no
// more ranks than CPUs, slots otherwise), so ShmSweep runs each world size on one of them. Here
// each runs where it is not the default on this machine's two CPUs (2 ranks on slots; 3 and 4 on
// push), on heap and non-heap buffers alike.
class ShmSmallAllReduce : public ::testing::TestWithParam<std::tuple<int, const char*>> {};

TEST_P(ShmSmallAllReduce, SweepMatchesSerialReference) {
  ScopedEnv env("TANDEM_SHM_SMALL_ALLREDUCE", std::get<1>(GetParam()));
  run_ranks(std::get<0>(GetParam()), [](ProcessGroup& pg) { sweep(pg); });
}
INSTANTIATE_TEST_SUITE_P(Algorithms, ShmSmallAllReduce,
                         ::testing::Values(std::make_tuple(2, "slot"), std::make_tuple(3, "push"),
                                           std::make_tuple(4, "push")));

TEST(Shm, UnknownSmallAllReduceAlgorithmIsNamed) {
  ScopedEnv env("TANDEM_SHM_SMALL_ALLREDUCE", "ring");
  try {
    run_ranks(1, [](ProcessGroup&) {});
    ADD_FAILURE() << "a group was made with TANDEM_SHM_SMALL_ALLREDUCE=ring";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("TANDEM_SHM_SMALL_ALLREDUCE='ring'"), std::string::npos) << e.what();
  }
}

// The Work's description is built on demand (not per call) but still names the op, its
// sequence number and its fingerprint; point-to-point ops name the peer and tag.
TEST(Shm, WorkDescriptionsNameTheOpSequenceAndFingerprint) {
  run_ranks(2, [](ProcessGroup& pg) {
    std::vector<float> x(16, 1.0f);
    Buffer b{x.data(), 16, DType::f32, kCPU};
    auto w0 = pg.all_reduce(b, ReduceOp::MAX);
    auto w1 = pg.broadcast(b, 1);
    w0->wait();
    w1->wait();
    auto w2 = pg.rank() == 0 ? pg.send(b, 1, 5) : pg.recv(b, 0, 5);
    w2->wait();
    const std::string p2p = pg.rank() == 0 ? "shm send to rank 1 (tag 5, f32, 16)" : "shm recv from rank 0 (tag 5, f32, 16)";
    if (w0->description() != "shm all_reduce #0 (f32, 16, MAX)" || w1->description() != "shm broadcast #1 (f32, 16, root 1)" ||
        w2->description() != p2p) {
      throw std::runtime_error(fmt::format("descriptions: '{}', '{}', '{}'", w0->description(), w1->description(),
                                           w2->description()));
    }
  });
}

// 64 MiB all_reduce, f32 and bf16, on 2 and 4 ranks: many chunks per slice, exact sums.
class ShmLarge : public ::testing::TestWithParam<std::tuple<int, DType>> {};
TEST_P(ShmLarge, AllReduce64MiB) {
  const auto [n, d] = GetParam();
  const int64_t count = (int64_t{64} << 20) / static_cast<int64_t>(element_size(d)) + 3;
  run_ranks(n, [&, n = n, d = d](ProcessGroup& pg) {
    auto mem = pg.allocate(static_cast<size_t>(count) * element_size(d));
    // rank 0 uses the zero-copy buffer, the others ordinary memory (through scratch)
    std::vector<uint8_t> own;
    void* data = mem.get();
    if (pg.rank() != 0) {
      own.resize(static_cast<size_t>(count) * element_size(d));
      data = own.data();
    }
    auto v = [&](int r, int64_t i) { return static_cast<double>((r * 5 + i) % 64) / 4.0; };
    for (int64_t i = 0; i < count; ++i) put(data, d, i, v(pg.rank(), i));
    pg.all_reduce(Buffer{data, count, d, kCPU})->wait();
    for (int64_t i = 0; i < count; ++i) {
      double want = 0;
      for (int r = 0; r < n; ++r) want += v(r, i);
      const double got = get(data, d, i);
      if (got != want) throw std::runtime_error(fmt::format("64 MiB all_reduce element {}: got {} want {}", i, got, want));
    }
  });
}
INSTANTIATE_TEST_SUITE_P(Sizes, ShmLarge,
                         ::testing::Values(std::tuple{2, DType::f32}, std::tuple{2, DType::bf16},
                                           std::tuple{4, DType::f32}, std::tuple{4, DType::bf16}));

// f32 data with cancellation: within summation-order tolerance of the f64 sum, and every rank
// gets bit-identical results.
TEST(Shm, F32RandomDataWithinSummationToleranceAndIdenticalOnAllRanks) {
  const int n = 3;
  const int64_t count = 100003;
  std::vector<std::vector<float>> data(n, std::vector<float>(count));
  std::mt19937 gen(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : data)
    for (auto& x : v) x = nd(gen);
  std::vector<std::vector<float>> out = data;
  run_ranks(n, [&](ProcessGroup& pg) { pg.all_reduce(Buffer{out[pg.rank()].data(), count, DType::f32, kCPU})->wait(); });
  for (int64_t i = 0; i < count; ++i) {
    double want = 0, mag = 0;
    for (int r = 0; r < n; ++r) {
      want += data[r][i];
      mag += std::fabs(data[r][i]);
    }
    // n-1 additions in f32: |error| <= (n-1) * 2^-24 * sum |x|
    ASSERT_LE(std::fabs(out[0][i] - want), (n - 1) * 0x1p-24 * mag) << i;
    ASSERT_EQ(std::memcmp(&out[0][i], &out[1][i], 4), 0);
    ASSERT_EQ(std::memcmp(&out[0][i], &out[2][i], 4), 0);
  }
}

// ---- 16-bit kernels: the vector paths (AVX-512 BF16, AVX-512F/F16C) against the generic
// loops and a scalar model, bit for bit: widen, combine in f32 in input order, divide (AVG),
// round once to nearest even; bf16 flushes f32 subnormal results to a signed zero (as
// vcvtne2ps2bf16 does) on every path. NaN results only need to be NaN (payload propagation
// depends on operand order, which the compiler may swap for a commutative add).

uint16_t model_round(DType d, float v) {
  if (d == DType::f16) return tandem::detail::float_to_half_bits(v);
  uint32_t x;
  std::memcpy(&x, &v, 4);
  if ((x & 0x7f800000u) == 0) x &= 0x80000000u;
  std::memcpy(&v, &x, 4);
  return tandem::detail::float_to_bf16_bits(v);
}
float model_widen(DType d, uint16_t b) {
  return d == DType::f16 ? tandem::detail::half_bits_to_float(b) : tandem::detail::bf16_bits_to_float(b);
}
bool is_nan16(DType d, uint16_t b) {
  return d == DType::f16 ? (b & 0x7c00u) == 0x7c00u && (b & 0x3ffu) != 0 : (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0;
}

TEST(Shm, SixteenBitKernelsMatchGenericLoopsAndScalarModelBitForBit) {
  std::mt19937 gen(7);
  const ReduceOp ops[] = {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::PRODUCT, ReduceOp::MAX, ReduceOp::MIN};
  for (DType d : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(std::string(tandem::dist::shm::short_dtype_name(d)) + " via " + tandem::dist::shm::kernel_name(d));
    for (int nin : {1, 2, 3, 5}) {
      for (int64_t count : {int64_t{1}, int64_t{7}, int64_t{31}, int64_t{32}, int64_t{33}, int64_t{100}, int64_t{20000}}) {
        // Half the elements: random bits (NaN, inf, subnormals, huge and tiny values); half:
        // moderate values whose sums round (ties and near-ties included).
        std::vector<std::vector<uint16_t>> in(nin, std::vector<uint16_t>(static_cast<size_t>(count)));
        std::uniform_int_distribution<int> bits(0, 0xffff);
        std::uniform_real_distribution<float> mod(-4.0f, 4.0f);
        for (auto& v : in) {
          for (size_t i = 0; i < v.size(); ++i) {
            v[i] = (i % 2 == 0) ? static_cast<uint16_t>(bits(gen)) : model_round(d, mod(gen));
          }
        }
        std::vector<const void*> ptrs;
        for (auto& v : in) ptrs.push_back(v.data());
        for (ReduceOp op : ops) {
          std::vector<uint16_t> fast(static_cast<size_t>(count)), generic(static_cast<size_t>(count));
          tandem::dist::shm::reduce_arrays(fast.data(), ptrs.data(), nin, count, d, op, nin);
          tandem::dist::shm::reduce_arrays_generic(generic.data(), ptrs.data(), nin, count, d, op, nin);
          std::vector<uint16_t> avx2 = generic;  // the AVX2 + F16C f16 path, where this CPU can run it
          if (d == DType::f16) {
            tandem::dist::shm::reduce_f16_avx2_for_tests(avx2.data(), ptrs.data(), nin, count, op, nin);
          }
          for (int64_t i = 0; i < count; ++i) {
            float acc = model_widen(d, in[0][static_cast<size_t>(i)]);
            for (int k = 1; k < nin; ++k) {
              const float b = model_widen(d, in[k][static_cast<size_t>(i)]);
              if (op == ReduceOp::SUM || op == ReduceOp::AVG) acc = acc + b;
              else if (op == ReduceOp::PRODUCT) acc = acc * b;
              else if (op == ReduceOp::MAX) acc = b > acc ? b : acc;
              else acc = b < acc ? b : acc;
            }
            if (op == ReduceOp::AVG) acc = acc / static_cast<float>(nin);
            const uint16_t want = model_round(d, acc);
            const size_t u = static_cast<size_t>(i);
            if (is_nan16(d, want)) {
              ASSERT_TRUE(is_nan16(d, fast[u]) && is_nan16(d, generic[u]) && is_nan16(d, avx2[u]))
                  << reduce_op_name(op) << " nin " << nin << " count " << count << " i " << i;
            } else {
              ASSERT_EQ(fast[u], want) << reduce_op_name(op) << " nin " << nin << " count " << count << " i " << i;
              ASSERT_EQ(generic[u], want) << reduce_op_name(op) << " nin " << nin << " count " << count << " i " << i;
              ASSERT_EQ(avx2[u], want) << "avx2+f16c " << reduce_op_name(op) << " nin " << nin << " count " << count
                                       << " i " << i;
            }
          }
        }
        // In place (out is input 0), as the backend calls it.
        std::vector<uint16_t> want(static_cast<size_t>(count));
        tandem::dist::shm::reduce_arrays_generic(want.data(), ptrs.data(), nin, count, d, ReduceOp::SUM, nin);
        tandem::dist::shm::reduce_arrays(in[0].data(), ptrs.data(), nin, count, d, ReduceOp::SUM, nin);
        for (size_t i = 0; i < want.size(); ++i) {
          if (!is_nan16(d, want[i])) ASSERT_EQ(in[0][i], want[i]) << "in place, i " << i;
        }
      }
    }
  }
}

// reduce_arrays_to (what the push all_reduce calls: its own buffer plus every peer's) stores the
// same bits as reduce_arrays into every output, for every dtype, through the one-pass AVX-512
// kernels (f32, bf16, f16) and the piecewise fallback (the others, 16 KiB pieces: 20000 f32 or
// i32 elements are five), also when the outputs are inputs, as in the backend.
bool same_element(DType d, const uint8_t* a, const uint8_t* b) {
  const size_t es = element_size(d);
  if (std::memcmp(a, b, es) == 0) return true;
  if (d == DType::f32 || d == DType::f64 || d == DType::bf16 || d == DType::f16) {
    return std::isnan(get(a, d, 0)) && std::isnan(get(b, d, 0));
  }
  return false;
}

TEST(Shm, ReduceArraysToStoresTheSameBitsIntoEveryOutput) {
  std::mt19937 gen(11);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<double> mod(-4.0, 4.0);
  const ReduceOp ops[] = {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::PRODUCT, ReduceOp::MAX, ReduceOp::MIN};
  for (DType d : {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32, DType::i64, DType::u8}) {
    SCOPED_TRACE(tandem::dist::shm::short_dtype_name(d));
    const size_t es = element_size(d);
    for (int nin : {1, 2, 3}) {
      for (int64_t count : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{33}, int64_t{20000}}) {
        const size_t nb = static_cast<size_t>(count) * es;
        // Half the elements random bits (NaN, inf, subnormals), half moderate values.
        std::vector<std::vector<uint8_t>> in(static_cast<size_t>(nin), std::vector<uint8_t>(nb));
        for (auto& v : in) {
          for (auto& x : v) x = static_cast<uint8_t>(byte(gen));
          for (int64_t i = 1; i < count; i += 2) {
            put(v.data(), d, i, is_floating(d) ? std::round(mod(gen) * 64) / 64 : std::floor((mod(gen) + 4) * 10));
          }
        }
        std::vector<const void*> ptrs;
        for (auto& v : in) ptrs.push_back(v.data());
        for (ReduceOp op : ops) {
          std::vector<uint8_t> want(nb);
          tandem::dist::shm::reduce_arrays(want.data(), ptrs.data(), nin, count, d, op, nin);
          if (op == ReduceOp::AVG && (d == DType::f32 || d == DType::f64)) {
            // A power-of-two divisor is a multiplication by its reciprocal: still the bits of a
            // left-to-right sum divided once.
            for (int64_t i = 0; i < count; ++i) {
              std::vector<uint8_t> model(es);
              auto sum_then_divide = [&](auto zero) {
                using F = decltype(zero);
                F acc = static_cast<const F*>(ptrs[0])[i];
                for (int k = 1; k < nin; ++k) acc = acc + static_cast<const F*>(ptrs[static_cast<size_t>(k)])[i];
                acc = acc / static_cast<F>(nin);
                std::memcpy(model.data(), &acc, es);
              };
              if (d == DType::f32) sum_then_divide(0.0f);
              else sum_then_divide(0.0);
              ASSERT_TRUE(same_element(d, want.data() + i * es, model.data()))
                  << "AVG nin " << nin << " element " << i << ": " << get(want.data(), d, i) << " vs " << get(model.data(), d, 0);
            }
          }
          for (int nout : {1, 2, 3}) {
            std::vector<std::vector<uint8_t>> out(static_cast<size_t>(nout), std::vector<uint8_t>(nb, 0xa5));
            std::vector<void*> outs;
            for (auto& v : out) outs.push_back(v.data());
            tandem::dist::shm::reduce_arrays_to(outs.data(), nout, ptrs.data(), nin, count, d, op, nin);
            for (int j = 0; j < nout; ++j) {
              for (int64_t i = 0; i < count; ++i) {
                ASSERT_TRUE(same_element(d, out[static_cast<size_t>(j)].data() + i * es, want.data() + i * es))
                    << reduce_op_name(op) << " nin " << nin << " nout " << nout << " count " << count << " output " << j
                    << " element " << i << ": " << get(out[static_cast<size_t>(j)].data(), d, i) << " vs "
                    << get(want.data(), d, i);
              }
            }
          }
        }
        // In place, as the push all_reduce on rank 0 of nin ranks: its own input is output 0,
        // every other input an output too.
        std::vector<uint8_t> want(nb);
        tandem::dist::shm::reduce_arrays(want.data(), ptrs.data(), nin, count, d, ReduceOp::AVG, nin);
        std::vector<void*> outs;
        for (auto& v : in) outs.push_back(v.data());
        tandem::dist::shm::reduce_arrays_to(outs.data(), nin, ptrs.data(), nin, count, d, ReduceOp::AVG, nin);
        for (int j = 0; j < nin; ++j) {
          for (int64_t i = 0; i < count; ++i) {
            ASSERT_TRUE(same_element(d, in[static_cast<size_t>(j)].data() + i * es, want.data() + i * es))
                << "in place, nin " << nin << " count " << count << " output " << j << " element " << i;
          }
        }
      }
    }
  }
}

// ---- bf16: one rounding ----

double bf16_ulp(double x) {
  const double a = std::max(std::fabs(x), 0x1p-126);
  return std::ldexp(1.0, std::ilogb(a) - 7);
}

TEST(Shm, Bf16FourRankSumWithinOneUlpOfF64AndABf16ChainIsNot) {
  const int n = 4;
  const int64_t count = 65537;
  std::vector<std::vector<bfloat16>> data(n, std::vector<bfloat16>(count));
  std::mt19937 gen(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : data)
    for (auto& x : v) x = bfloat16(nd(gen));
  auto out = data;
  run_ranks(n, [&](ProcessGroup& pg) { pg.all_reduce(Buffer{out[pg.rank()].data(), count, DType::bf16, kCPU})->wait(); });
  double worst_ours = 0, worst_chain = 0;
  int64_t chain_violations = 0;
  for (int64_t i = 0; i < count; ++i) {
    double ref = 0;
    for (int r = 0; r < n; ++r) ref += static_cast<float>(data[r][i]);
    const double ulp = bf16_ulp(ref);
    worst_ours = std::max(worst_ours, std::fabs(static_cast<float>(out[0][i]) - ref) / ulp);
    // the same sum as a chain of bf16 additions (what a 16-bit ring without f32 partials does)
    bfloat16 chain = data[0][i];
    for (int r = 1; r < n; ++r) chain = bfloat16(static_cast<float>(chain) + static_cast<float>(data[r][i]));
    const double ce = std::fabs(static_cast<float>(chain) - ref) / ulp;
    worst_chain = std::max(worst_chain, ce);
    chain_violations += ce > 1.0;
  }
  EXPECT_LE(worst_ours, 1.0) << "shm bf16 all_reduce must round once";
  EXPECT_GT(worst_chain, 1.0) << "the bf16 chain should break the 1-ulp bound on this data";
  EXPECT_GT(chain_violations, 100);
  std::printf("bf16 4-rank sum: worst error %.3f ulp (shm, f32 partials) vs %.3f ulp (bf16 chain, %lld elements over 1 ulp)\n",
              worst_ours, worst_chain, static_cast<long long>(chain_violations));
}

// ---- errors: mismatch, desync, validation ----

TEST(Shm, SkippedCollectiveIsAMismatchNamingBothSides) {
  std::vector<std::string> msgs(2);
  run_ranks(2, [&](ProcessGroup& pg) {
    std::vector<float> x(16, 1.0f);
    Buffer b{x.data(), 16, DType::f32, kCPU};
    pg.all_reduce(b)->wait();
    try {
      if (pg.rank() == 0) pg.broadcast(b, 0)->wait();  // rank 1 skips it
      pg.all_reduce(b)->wait();
      msgs[pg.rank()] = "no error";
    } catch (const CommError& e) {
      msgs[pg.rank()] = e.what();
    }
  }, 5s);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(msgs[r]);
    EXPECT_NE(msgs[r].find("mismatch at #1"), std::string::npos);
    EXPECT_NE(msgs[r].find("broadcast #1 (f32, 16, root 0)"), std::string::npos);
    EXPECT_NE(msgs[r].find("all_reduce #1 (f32, 16, SUM)"), std::string::npos);
  }
}

TEST(Shm, TimeoutNamesTheRankThatDidNotArriveAndWhereItIs) {
  std::string msg;
  std::atomic<bool> done{false};
  const auto start = Clock::now();
  run_ranks(2, [&](ProcessGroup& pg) {
    std::vector<float> x(1024, 1.0f);
    Buffer b{x.data(), 1024, DType::f32, kCPU};
    pg.all_reduce(b)->wait();
    pg.all_reduce(b)->wait();
    if (pg.rank() == 0) {
      try {
        pg.all_reduce(b)->wait();  // rank 1 never issues #2
        msg = "no error";
      } catch (const Timeout& e) {
        msg = e.what();
      }
      done = true;
    } else {
      while (!done) std::this_thread::sleep_for(5ms);  // alive, group open, not in a collective
    }
  }, 600ms);
  SCOPED_TRACE(msg);
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_NE(msg.find("all_reduce #2 (f32, 1024, SUM) timed out after 600 ms"), std::string::npos);
  EXPECT_NE(msg.find("rank 1 finished all_reduce #1 (f32, 1024, SUM) and has not issued #2"), std::string::npos);
  EXPECT_NE(msg.find("while rank 0 waits in all_reduce #2"), std::string::npos);
}

TEST(Shm, FailedGroupFailsLaterCollectivesFast) {
  run_ranks(2, [&](ProcessGroup& pg) {
    std::vector<float> x(8, 1.0f);
    Buffer b{x.data(), 8, DType::f32, kCPU};
    Buffer b4{x.data(), 4, DType::f32, kCPU};
    EXPECT_THROW(pg.all_reduce(pg.rank() == 0 ? b : b4)->wait(), CommError);  // count mismatch
    const auto t0 = Clock::now();
    try {
      pg.all_reduce(b)->wait();
      ADD_FAILURE() << "a broken group ran a collective";
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find("failed earlier"), std::string::npos) << e.what();
    }
    EXPECT_LT(Clock::now() - t0, 100ms);
  }, 3s);
}

TEST(Shm, BadArgumentsAreValueErrors) {
  run_ranks(1, [&](ProcessGroup& pg) {
    std::vector<float> x(8);
    std::vector<uint8_t> bools(8);
    EXPECT_THROW(pg.broadcast(Buffer{x.data(), 8, DType::f32, kCPU}, 1), ValueError);
    EXPECT_THROW(pg.all_reduce(Buffer{bools.data(), 8, DType::b8, kCPU}), ValueError);
    EXPECT_THROW(pg.all_gather(Buffer{x.data(), 3, DType::f32, kCPU}, Buffer{x.data(), 2, DType::f32, kCPU}), ValueError);
    EXPECT_THROW(pg.all_reduce(Buffer{x.data(), 8, DType::f32, Device{DeviceType::cuda, 0}}), ValueError);
  });
}

TEST(Shm, AllocateIsInsideTheSegmentAndFreedMemoryIsReused) {
  run_ranks(2, [&](ProcessGroup& pg) {
    auto a = pg.allocate(1 << 20);
    const void* first = a.get();
    a.reset();
    auto b = pg.allocate(1 << 20);
    EXPECT_EQ(b.get(), first);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.get()) % 64, 0u);
    pg.barrier()->wait();
  });
}

// Many small ops in flight at once complete in issue order with the right values.
TEST(Shm, ManyAsyncOpsCompleteInOrder) {
  run_ranks(3, [&](ProcessGroup& pg) {
    const int k = 200;
    std::vector<std::vector<int32_t>> xs(k, std::vector<int32_t>(33));
    std::vector<std::shared_ptr<Work>> ws;
    for (int j = 0; j < k; ++j) {
      for (auto& v : xs[j]) v = pg.rank() + j;
      ws.push_back(j % 2 ? pg.all_reduce(Buffer{xs[j].data(), 33, DType::i32, kCPU})
                         : pg.broadcast(Buffer{xs[j].data(), 33, DType::i32, kCPU}, j % 3));
    }
    for (int j = 0; j < k; ++j) {
      ws[j]->wait();
      const int32_t want = j % 2 ? 3 * j + 3 : (j % 3) + j;
      if (xs[j][32] != want) throw std::runtime_error(fmt::format("op {}: {} != {}", j, xs[j][32], want));
    }
  });
}

}  // namespace
}  // namespace tandem::dist
