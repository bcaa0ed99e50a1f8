// mlp_step_bench: the W1 training step (zero_grad, forward, cross_entropy, backward, SGD with
// momentum 0.9 and lr 0.05) of the 784-1024-1024-10 MLP at batch 128, in f32 and in "bf16"
// (the autocast equivalent: f32 master weights, every linear in bf16 with f32 accumulation),
// plus the 1024x1024x1024 linear GEMM in f32 and bf16. One JSON object per line on stdout;
// bench/torch_mlp_step.py prints the same lines for PyTorch and bench/run_mlp_bench.sh puts
// them side by side.
//
//   mlp_step_bench [--threads T] [--batch B] [--seconds S] [--min-steps N] [--warmup W]
//                  [--only mlp|gemm] [--dtype f32|bf16] [--phases]
//
// --phases (or TANDEM_BENCH_PHASES=1) adds one line per dtype splitting the step into
// zero_grad / forward / loss / backward / optimizer process CPU time, plus allocator calls per step, and
// one line per GEMM of the step timed on its own.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "tandem/kernels/cpu/gemm.h"
#include "tandem/tandem.h"

namespace td = tandem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// CPU time of the whole process: on one thread it is the work done, without the time other
// processes on a shared machine took the core away.
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Args {
  int threads = 1;
  int64_t batch = 128;
  double seconds = 3.0;     // timed wall time per workload (at least min_steps iterations)
  int64_t min_steps = 50;
  int64_t warmup = 10;
  std::string only;         // "", "mlp" or "gemm"
  std::string dtype;        // "", "f32" or "bf16"
  bool phases = false;
};

Args parse(int argc, char** argv) {
  Args a;
  if (const char* e = std::getenv("TANDEM_BENCH_PHASES"); e != nullptr && std::string(e) != "0" && *e) a.phases = true;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw td::ValueError(fmt::format("{} needs a value", k));
      return argv[++i];
    };
    if (k == "--threads") a.threads = std::stoi(value());
    else if (k == "--batch") a.batch = std::stoll(value());
    else if (k == "--seconds") a.seconds = std::stod(value());
    else if (k == "--min-steps") a.min_steps = std::stoll(value());
    else if (k == "--warmup") a.warmup = std::stoll(value());
    else if (k == "--only") a.only = value();
    else if (k == "--dtype") a.dtype = value();
    else if (k == "--phases") a.phases = true;
    else if (k == "--help" || k == "-h") {
      std::printf("usage: mlp_step_bench [--threads T] [--batch B] [--seconds S] [--min-steps N] [--warmup W] "
                  "[--only mlp|gemm] [--dtype f32|bf16] [--phases]\n");
      std::exit(0);
    } else {
      throw td::ValueError(fmt::format("unknown argument \"{}\" (try --help)", k));
    }
  }
  TANDEM_CHECK(a.only.empty() || a.only == "mlp" || a.only == "gemm", td::ValueError, "--only must be mlp or gemm");
  TANDEM_CHECK(a.dtype.empty() || a.dtype == "f32" || a.dtype == "bf16", td::ValueError, "--dtype must be f32 or bf16");
  TANDEM_CHECK(a.threads >= 1 && a.batch >= 1 && a.min_steps >= 1 && a.warmup >= 0, td::ValueError,
               "--threads, --batch, --min-steps must be >= 1 and --warmup >= 0");
  return a;
}

double median_of(std::vector<double> s) {
  std::sort(s.begin(), s.end());
  const size_t n = s.size();
  return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

// Per-iteration wall and process-CPU times; reports medians (robust on a shared machine), the
// mean and the best.
struct Timing {
  std::vector<double> t, cpu;
  double median() const { return median_of(t); }
  double cpu_median() const { return median_of(cpu); }
  double mean() const {
    double sum = 0;
    for (double x : t) sum += x;
    return sum / static_cast<double>(t.size());
  }
  double min() const { return *std::min_element(t.begin(), t.end()); }
};

template <class F>
Timing time_loop(const Args& a, F&& fn) {
  for (int64_t i = 0; i < a.warmup; ++i) fn();
  Timing tm;
  const auto start = Clock::now();
  while (static_cast<int64_t>(tm.t.size()) < a.min_steps || seconds_since(start) < a.seconds) {
    const double c0 = process_cpu_seconds();
    const auto t0 = Clock::now();
    fn();
    tm.t.push_back(seconds_since(t0));
    tm.cpu.push_back(process_cpu_seconds() - c0);
  }
  return tm;
}

// ---- the two models ----

// The autocast-equivalent of mlp(): the same f32 Linear modules (same init), but each linear
// runs on bf16 copies of input, weight and bias (Tensor::to is differentiable, so the gradients
// land on the f32 master weights); ReLU in bf16; logits back to f32 for cross_entropy.
struct Bf16Mlp {
  std::vector<std::shared_ptr<td::nn::Linear>> linears;
  td::Tensor operator()(const td::Tensor& x) const {
    td::Tensor h = x.flatten(1).to(td::kBFloat16);
    for (size_t i = 0; i < linears.size(); ++i) {
      const auto& l = *linears[i];
      h = td::ops::linear(h, l.weight.to(td::kBFloat16), l.bias.to(td::kBFloat16));
      if (i + 1 < linears.size()) h = td::ops::relu(h);
    }
    return h.to(td::kFloat32);
  }
};

Bf16Mlp bf16_view(const td::nn::Sequential& seq) {
  Bf16Mlp m;
  for (size_t i = 0; i < seq.size(); ++i) {
    if (auto l = std::dynamic_pointer_cast<td::nn::Linear>(seq[i])) m.linears.push_back(l);
  }
  return m;
}

constexpr int64_t kPoolBatches = 64;

struct Phases {
  double zero_grad = 0, forward = 0, loss = 0, backward = 0, step = 0;
  int64_t allocs = 0, system_allocs = 0, steps = 0;
};

void bench_mlp(const Args& a, const std::string& dtype) {
  td::manual_seed(0);
  auto model = td::nn::models::mlp();
  const Bf16Mlp bf16 = bf16_view(*model);
  td::optim::SGD opt(model->parameters(), {.lr = 0.05, .momentum = 0.9});
  // A pool of random batches (cycled), so the loss does not collapse to 0 on one memorised batch.
  std::vector<td::Tensor> xs, ys;
  for (int64_t i = 0; i < kPoolBatches; ++i) {
    xs.push_back(td::randn({a.batch, 784}));
    ys.push_back(td::randint(0, 10, {a.batch}));
  }
  size_t next = 0;
  const bool is_bf16 = dtype == "bf16";
  auto forward = [&](const td::Tensor& in) { return is_bf16 ? bf16(in) : (*model)(in); };

  auto step = [&] {
    const td::Tensor& x = xs[next % xs.size()];
    const td::Tensor& y = ys[next % ys.size()];
    ++next;
    opt.zero_grad();
    td::Tensor loss = td::ops::cross_entropy(forward(x), y);
    loss.backward();
    opt.step();
    return loss;
  };
  const Timing tm = time_loop(a, [&] { step(); });
  const double last_loss = step().item();
  const double med = tm.median();
  std::printf(
      "{\"name\":\"mlp_step\",\"impl\":\"tandem\",\"dtype\":\"%s\",\"batch\":%lld,\"threads\":%d,\"steps\":%zu,"
      "\"samples_per_s\":%.1f,\"samples_per_s_cpu\":%.1f,\"samples_per_s_mean\":%.1f,\"step_ms_median\":%.3f,"
      "\"step_ms_min\":%.3f,\"step_ms_cpu_median\":%.3f,\"loss\":%.4f}\n",
      dtype.c_str(), static_cast<long long>(a.batch), a.threads, tm.t.size(), static_cast<double>(a.batch) / med,
      static_cast<double>(a.batch) / tm.cpu_median(), static_cast<double>(a.batch) / tm.mean(), 1e3 * med,
      1e3 * tm.min(), 1e3 * tm.cpu_median(), last_loss);
  std::fflush(stdout);

  if (!a.phases) return;
  // The same step with a process-CPU clock between phases (everything is synchronous on CPU).
  Phases ph;
  auto& alloc = td::cpu_allocator();
  const auto t_end = Clock::now() + std::chrono::duration<double>(a.seconds);
  while (ph.steps < a.min_steps || Clock::now() < t_end) {
    const td::Tensor& x = xs[next % xs.size()];
    const td::Tensor& y = ys[next % ys.size()];
    ++next;
    const auto s0 = alloc.stats();
    double t0 = process_cpu_seconds(), t1;
    opt.zero_grad();
    ph.zero_grad += (t1 = process_cpu_seconds()) - t0;
    const td::Tensor logits = forward(x);
    ph.forward += (t0 = process_cpu_seconds()) - t1;
    td::Tensor loss = td::ops::cross_entropy(logits, y);
    ph.loss += (t1 = process_cpu_seconds()) - t0;
    loss.backward();
    ph.backward += (t0 = process_cpu_seconds()) - t1;
    opt.step();
    ph.step += process_cpu_seconds() - t0;
    const auto s1 = alloc.stats();
    ph.allocs += s1.num_allocs - s0.num_allocs;
    ph.system_allocs += s1.num_system_allocs - s0.num_system_allocs;
    ++ph.steps;
  }
  const double n = static_cast<double>(ph.steps);
  std::printf(
      "{\"name\":\"mlp_step_phases\",\"impl\":\"tandem\",\"dtype\":\"%s\",\"steps\":%lld,\"zero_grad_ms\":%.3f,"
      "\"forward_ms\":%.3f,\"loss_ms\":%.3f,\"backward_ms\":%.3f,\"optimizer_ms\":%.3f,\"allocs_per_step\":%.1f,"
      "\"system_allocs_per_step\":%.2f}\n",
      dtype.c_str(), static_cast<long long>(ph.steps), 1e3 * ph.zero_grad / n, 1e3 * ph.forward / n,
      1e3 * ph.loss / n, 1e3 * ph.backward / n, 1e3 * ph.step / n, static_cast<double>(ph.allocs) / n,
      static_cast<double>(ph.system_allocs) / n);
  std::fflush(stdout);
}

// ---- GEMM: y = x W^T at M = N = K = 1024, the linear op's shape ----
void bench_gemm(const Args& a, const std::string& dtype) {
  constexpr int64_t M = 1024, N = 1024, K = 1024;
  const td::DType dt = dtype == "bf16" ? td::kBFloat16 : td::kFloat32;
  td::manual_seed(0);
  const td::Tensor x = td::randn({M, K}).to(dt);
  const td::Tensor w = td::randn({N, K}).to(dt);
  const double flop = 2.0 * M * N * K;
  td::NoGradGuard no_grad;

  // The op users call (allocates its output each time).
  const Timing op = time_loop(a, [&] { (void)td::ops::linear(x, w); });
  // The kernel alone, into a preallocated output (oneDNN, W^T as a strided view).
  td::Tensor c = td::empty({1, M, N}, dt);
  const td::Tensor a3 = x.unsqueeze(0), b3 = w.t().unsqueeze(0);
  const Timing kern = time_loop(a, [&] { td::kernels::gemm_into(a3, b3, td::Tensor(), c); });

  for (const auto& [variant, tm] : {std::pair<const char*, const Timing&>{"linear", op}, {"gemm_into", kern}}) {
    std::printf(
        "{\"name\":\"gemm_1024\",\"variant\":\"%s\",\"impl\":\"tandem\",\"dtype\":\"%s\",\"threads\":%d,\"iters\":%zu,"
        "\"gflops\":%.2f,\"gflops_cpu\":%.2f,\"gflops_best\":%.2f,\"ms_median\":%.3f}\n",
        variant, dtype.c_str(), a.threads, tm.t.size(), flop / tm.median() * 1e-9, flop / tm.cpu_median() * 1e-9,
        flop / tm.min() * 1e-9, 1e3 * tm.median());
  }
  std::fflush(stdout);
}

// ---- the eight GEMMs of one MLP step, one at a time (--phases) ----
// Forward y = x W^T (+ b) through ops::linear; backward as LinearBackward issues them:
// dX = g @ W and dW = g^T @ x, with W^T and g^T as strided views.
void bench_step_gemms(const Args& a, const std::string& dtype) {
  const td::DType dt = dtype == "bf16" ? td::kBFloat16 : td::kFloat32;
  const int64_t B = a.batch;
  td::manual_seed(0);
  td::NoGradGuard no_grad;
  auto r = [&](td::Shape s) { return td::randn(s).to(dt); };
  const td::Tensor x1 = r({B, 784}), h = r({B, 1024}), g1024 = r({B, 1024}), g10 = r({B, 10});
  const td::Tensor w1 = r({1024, 784}), w2 = r({1024, 1024}), w3 = r({10, 1024});
  const td::Tensor b1024 = r({1024}), b10 = r({10});
  auto mm = [](const td::Tensor& p, const td::Tensor& q) {
    return td::kernels::gemm(p.unsqueeze(0), q.unsqueeze(0), td::Tensor(), p.dtype());
  };
  struct Case {
    const char* name;
    int64_t m, n, k;
    std::function<void()> fn;
  };
  const std::vector<Case> cases = {
      {"fwd1 x@W1^T", B, 1024, 784, [&] { (void)td::ops::linear(x1, w1, b1024); }},
      {"fwd2 h@W2^T", B, 1024, 1024, [&] { (void)td::ops::linear(h, w2, b1024); }},
      {"fwd3 h@W3^T", B, 10, 1024, [&] { (void)td::ops::linear(h, w3, b10); }},
      {"dX3 g@W3", B, 1024, 10, [&] { (void)mm(g10, w3); }},
      {"dX2 g@W2", B, 1024, 1024, [&] { (void)mm(g1024, w2); }},
      {"dW3 g^T@h", 10, 1024, B, [&] { (void)mm(g10.t(), h); }},
      {"dW2 g^T@h", 1024, 1024, B, [&] { (void)mm(g1024.t(), h); }},
      {"dW1 g^T@x", 1024, 784, B, [&] { (void)mm(g1024.t(), x1); }},
  };
  Args quick = a;
  quick.seconds = std::min(a.seconds, 0.5);
  for (const auto& c : cases) {
    const Timing tm = time_loop(quick, c.fn);
    const double flop = 2.0 * static_cast<double>(c.m * c.n * c.k);
    std::printf(
        "{\"name\":\"step_gemm\",\"impl\":\"tandem\",\"dtype\":\"%s\",\"gemm\":\"%s\",\"m\":%lld,\"n\":%lld,"
        "\"k\":%lld,\"us_median\":%.1f,\"us_cpu_median\":%.1f,\"gflops_cpu\":%.1f}\n",
        dtype.c_str(), c.name, static_cast<long long>(c.m), static_cast<long long>(c.n), static_cast<long long>(c.k),
        1e6 * tm.median(), 1e6 * tm.cpu_median(), flop / tm.cpu_median() * 1e-9);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  td::set_num_threads(a.threads);
  std::printf("{\"name\":\"env\",\"impl\":\"tandem\",\"threads\":%d,\"cpu\":\"%s\"}\n", td::get_num_threads(),
              td::cpu_features().summary().c_str());
  std::vector<std::string> dtypes = a.dtype.empty() ? std::vector<std::string>{"f32", "bf16"}
                                                    : std::vector<std::string>{a.dtype};
  if (a.only.empty() || a.only == "mlp") {
    for (const auto& d : dtypes) bench_mlp(a, d);
  }
  if (a.only.empty() || a.only == "gemm") {
    for (const auto& d : dtypes) bench_gemm(a, d);
  }
  if (a.phases) {
    for (const auto& d : dtypes) bench_step_gemms(a, d);
  }
  return 0;
} catch (const std::exception& e) {
  return td::report(e);
}
