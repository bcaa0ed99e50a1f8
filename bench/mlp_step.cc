// mlp_step_bench: the W1 training step (zero_grad, forward, cross_entropy, backward, SGD with
// momentum 0.9 and lr 0.05) of the 784-1024-1024-10 MLP at batch 128, in f32 and in "bf16"
// (the autocast equivalent: f32 master weights, every linear in bf16 with f32 accumulation),
// plus the 1024x1024x1024 linear GEMM in f32 and bf16. One JSON object per line on stdout;
// bench/torch_mlp_step.py prints the same lines for PyTorch and bench/run_mlp_bench.sh puts
// them side by side.
//
//   mlp_step_bench [--threads T] [--batch B] [--seconds S] [--min-steps N] [--warmup W]
//                  [--only mlp|gemm] [--dtype f32|bf16|autocast] [--phases]
// "autocast": the plain mlp() under amp::autocast(bf16) (issue #5) instead of the hand-built copy.
//
// --phases (or TANDEM_BENCH_PHASES=1) adds one line per dtype splitting the step into
// zero_grad / forward / loss / backward / optimizer process CPU time, plus allocator calls per step, and
// one line per GEMM of the step timed on its own.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.h"
#include "tandem/kernels/cpu/gemm.h"
#include "tandem/tandem.h"

namespace td = tandem;

namespace {

using td::bench::Timing;
using td::bench::time_loop;

struct Args : td::bench::CommonArgs {
  int64_t batch = 128;
  std::string only;         // "", "mlp" or "gemm"
  Args() {
    min_steps = 50;
    warmup = 10;
  }
};

Args parse(int argc, char** argv) {
  Args a;
  td::bench::parse_args(argc, argv, a,
                        "mlp_step_bench [--threads T] [--batch B] [--seconds S] [--min-steps N] [--warmup W] "
                        "[--only mlp|gemm] [--dtype f32|bf16|autocast] [--phases]",
                        [&](const std::string& k, auto& value) {
                          if (k == "--batch") a.batch = std::stoll(value());
                          else if (k == "--only") a.only = value();
                          else return false;
                          return true;
                        });
  TANDEM_CHECK(a.only.empty() || a.only == "mlp" || a.only == "gemm", td::ValueError, "--only must be mlp or gemm");
  TANDEM_CHECK(a.dtype.empty() || a.dtype == "f32" || a.dtype == "bf16" || a.dtype == "autocast", td::ValueError,
               "--dtype must be f32, bf16 or autocast");
  TANDEM_CHECK(a.threads >= 1 && a.batch >= 1 && a.min_steps >= 1 && a.warmup >= 0, td::ValueError,
               "--threads, --batch, --min-steps must be >= 1 and --warmup >= 0");
  return a;
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
  const bool is_bf16 = dtype == "bf16", is_autocast = dtype == "autocast";
  auto forward = [&](const td::Tensor& in) {
    td::amp::autocast ac({.dtype = td::kBFloat16, .enabled = is_autocast});
    return is_bf16 ? bf16(in) : (*model)(in);
  };

  auto step = [&] { return td::bench::train_step(xs, ys, next, opt, forward); };
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
  td::bench::print_phases("mlp_step_phases", dtype, td::bench::time_phases(a, xs, ys, next, opt, forward));
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
  // "bf16" and "autocast" (two names for the same autocast step) run their GEMMs in bf16.
  const td::DType dt = dtype == "bf16" || dtype == "autocast" ? td::kBFloat16 : td::kFloat32;
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
  td::bench::init_and_print_env(a.threads);
  const std::vector<std::string> dtypes = td::bench::dtypes_to_run(a);
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
