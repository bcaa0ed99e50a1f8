// models_step_bench: the W2 CNN and W3 GPT training steps (zero_grad, forward, cross_entropy,
// backward, AdamW) in f32 and in "bf16" (the autocast equivalent, built here by hand because
// Tandem has no autocast yet: f32 master weights; convolutions, linears and attention on bf16
// copies of activations and weights; normalisation statistics in f32; logits back to f32 for the
// loss). One JSON object per line on stdout; bench/torch_models_step.py prints the same lines for
// PyTorch and bench/run_models_bench.sh puts them side by side.
//
// "autocast" runs the plain model under amp::autocast(bf16) (issue #5): the policy table decides
// at op entry, parameters cast once per step through the weight cast cache.
//
//   models_step_bench [--workload cnn|gpt] [--dtype f32|bf16|autocast] [--threads T] [--batch B]
//                     [--context T] [--seconds S] [--min-steps N] [--warmup W] [--phases]
//
//   cnn: nn::models::cnn() (3x [Conv3x3, BatchNorm2d, ReLU], mean over H, W, Linear(128, 10)),
//        input (64, 1, 28, 28) randn, 10 classes, AdamW(lr 1e-3). Reports samples/s.
//   gpt: nn::models::gpt() (vocab 256, d 256, 4 layers, 4 heads), batch 8 x context 128 random
//        tokens, cross_entropy over (B*T, 256), AdamW(lr 3e-4). Reports tokens/s.
//
// Memory: "peak_tensor_mb" is the allocator's peak_allocated_bytes() over the timed steps
// (reset_peak() after the warm-up) less the pool of input batches both sides hold: parameters,
// gradients, optimizer state, activations and temporaries at the step's high-water mark.
// "maxrss_delta_mb" is the growth of the process's peak resident set (getrusage ru_maxrss) from
// the end of setup (model, optimizer, input pool built) to the end of the run: the tensors'
// first-step footprint plus allocator caches, oneDNN scratchpads and JIT code. Run one
// (workload, dtype) per process for that figure to mean that pair alone.
//
// --phases (or TANDEM_BENCH_PHASES=1) adds one line splitting the step into zero_grad / forward /
// loss / backward / optimizer process CPU time, plus allocator calls per step.
#include <sys/resource.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.h"
#include "tandem/tandem.h"

namespace td = tandem;

namespace {

using td::bench::Timing;

// Peak resident set of this process so far, MiB (Linux reports ru_maxrss in KiB).
double maxrss_mb() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

constexpr double kMiB = 1024.0 * 1024.0;

struct Args : td::bench::CommonArgs {
  int64_t batch = 0;        // 0: the workload's default (cnn 64, gpt 8)
  int64_t context = 128;    // gpt sequence length
  std::string workload;     // "", "cnn" or "gpt"
  Args() {
    min_steps = 10;
    warmup = 3;
  }
};

Args parse(int argc, char** argv) {
  Args a;
  td::bench::parse_args(argc, argv, a,
                        "models_step_bench [--workload cnn|gpt] [--dtype f32|bf16|autocast] [--threads T] [--batch B] "
                        "[--context T] [--seconds S] [--min-steps N] [--warmup W] [--phases]",
                        [&](const std::string& k, auto& value) {
                          if (k == "--batch") a.batch = std::stoll(value());
                          else if (k == "--context") a.context = std::stoll(value());
                          else if (k == "--workload") a.workload = value();
                          else return false;
                          return true;
                        });
  TANDEM_CHECK(a.workload.empty() || a.workload == "cnn" || a.workload == "gpt", td::ValueError,
               "--workload must be cnn or gpt");
  TANDEM_CHECK(a.dtype.empty() || a.dtype == "f32" || a.dtype == "bf16" || a.dtype == "autocast", td::ValueError,
               "--dtype must be f32, bf16 or autocast");
  TANDEM_CHECK(a.threads >= 1 && a.batch >= 0 && a.context >= 1 && a.min_steps >= 1 && a.warmup >= 0, td::ValueError,
               "--threads, --context, --min-steps must be >= 1, --batch and --warmup >= 0");
  return a;
}

// Warm-up, then reset the allocator's peak, then the timed iterations.
template <class F>
Timing time_loop(const Args& a, F&& fn) {
  return td::bench::time_loop(a, std::forward<F>(fn), [] { td::reset_peak_allocated_bytes(); });
}

// ---- bf16 forwards: what torch.autocast("cpu", dtype=torch.bfloat16) runs ----
// Tensor::to is differentiable, so the gradients of the bf16 weight copies land on the f32
// master parameters, which AdamW updates in f32.

td::Tensor bf16(const td::Tensor& t) { return t.defined() ? t.to(td::kBFloat16) : t; }

td::Tensor linear_bf16(const td::nn::Linear& l, const td::Tensor& x) {
  return td::ops::linear(bf16(x), bf16(l.weight), bf16(l.bias));
}

// CNN: conv2d in bf16 (bf16 input and weight copy); BatchNorm2d takes the bf16 activations with
// its f32 affine parameters and running stats, computes the statistics in f32 and returns bf16
// (autocast leaves batch_norm alone, so it also runs on bf16 there); ReLU and the spatial mean in
// bf16; fc in bf16; logits to f32 for cross_entropy (autocast's fp32 op). As in Cnn::forward,
// each [BatchNorm2d, ReLU] pair is the fused BatchNorm::forward_relu and the mean over H, W the
// global average pool.
td::Tensor cnn_forward_bf16(td::nn::models::Cnn& m, const td::Tensor& x) {
  td::Tensor h = bf16(x);
  const td::nn::Sequential& f = *m.features;
  for (size_t i = 0; i < f.size(); ++i) {
    if (auto conv = std::dynamic_pointer_cast<td::nn::Conv2d>(f[i])) {
      h = td::ops::conv2d(h, bf16(conv->weight), bf16(conv->bias), conv->conv);
    } else if (auto bn = std::dynamic_pointer_cast<td::nn::BatchNorm>(f[i]);
               bn && i + 1 < f.size() && std::dynamic_pointer_cast<td::nn::ReLU>(f[i + 1])) {
      h = bn->forward_relu(h);  // training: batch stats in f32, running stats updated; then ReLU
      ++i;
    } else {
      h = (*f[i])(h);
    }
  }
  return linear_bf16(*m.fc, td::ops::adaptive_avg_pool2d(h, {1, 1}).view({h.size(0), h.size(1)})).to(td::kFloat32);
}

// GPT, in autocast's dtype flow: embeddings (not an autocast op) and so the residual stream stay
// f32 (x + bf16 branch promotes to f32); LayerNorm runs on that f32 stream (stats in f32); every
// linear casts its input and weight to bf16; attention (SDPA) and GELU run on bf16; the tied head
// is a bf16 linear; logits go to f32 for the loss.
td::Tensor gpt_forward_bf16(td::nn::models::Gpt& m, const td::Tensor& idx) {
  const int64_t B = idx.size(0), T = idx.size(1);
  td::Tensor x = td::ops::add((*m.tok_emb)(idx), (*m.pos_emb)(td::arange(static_cast<double>(T))));
  for (size_t i = 0; i < m.blocks->size(); ++i) {
    const auto blk = m.blocks->at<td::nn::models::GptBlock>(i);
    const auto& attn = *blk->attn;
    const int64_t d = x.size(2), H = attn.n_head, hd = d / H;
    const std::vector<td::Tensor> qkv = td::ops::split(linear_bf16(*attn.qkv, (*blk->ln1)(x)), d, 2);
    auto heads = [&](const td::Tensor& t) { return t.view({B, T, H, hd}).transpose(1, 2); };  // (B, H, T, hd)
    const td::Tensor y = td::ops::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]),
                                                               /*causal=*/true);
    x = td::ops::add(x, linear_bf16(*attn.proj, y.transpose(1, 2).contiguous().view({B, T, d})));
    const auto& mlp = *blk->mlp;
    x = td::ops::add(x, linear_bf16(*mlp.fc2, td::ops::gelu(linear_bf16(*mlp.fc1, (*blk->ln2)(x)), "tanh")));
  }
  return td::ops::linear(bf16((*m.ln_f)(x)), bf16(m.tok_emb->weight)).to(td::kFloat32);
}

constexpr int64_t kPoolBatches = 16;  // random batches, cycled (as in torch_models_step.py)

// One workload: forward(x) -> logits (N, C); loss = cross_entropy(logits, y). `items` is what
// one step processes (samples or tokens), named by `unit`.
struct Workload {
  std::string name, unit;  // "cnn_step"/"samples", "gpt_step"/"tokens"
  int64_t batch = 0, context = 0, items = 0;
  std::vector<td::Tensor> xs, ys;
  std::function<td::Tensor(const td::Tensor&)> forward;  // logits, already (N, C) f32
  std::unique_ptr<td::optim::Optimizer> opt;
  double pool_bytes = 0;  // allocator bytes held by xs and ys
};

void run(const Args& a, Workload& w, const std::string& dtype) {
  size_t next = 0;
  auto step = [&] { return td::bench::train_step(w.xs, w.ys, next, *w.opt, w.forward); };
  const double rss0 = maxrss_mb();
  const Timing tm = time_loop(a, [&] { step(); });
  const double peak = static_cast<double>(td::peak_allocated_bytes());
  const double last_loss = step().item();
  const double rss1 = maxrss_mb();
  const double med = tm.median(), n = static_cast<double>(w.items);
  std::printf(
      "{\"name\":\"%s\",\"impl\":\"tandem\",\"dtype\":\"%s\",\"batch\":%lld,\"context\":%lld,\"threads\":%d,"
      "\"steps\":%zu,\"unit\":\"%s/s\",\"per_s\":%.1f,\"per_s_cpu\":%.1f,\"per_s_mean\":%.1f,"
      "\"step_ms_median\":%.3f,\"step_ms_min\":%.3f,\"step_ms_cpu_median\":%.3f,\"loss\":%.4f,"
      "\"peak_tensor_mb\":%.2f,\"pool_mb\":%.2f,\"maxrss_delta_mb\":%.1f,\"maxrss_mb\":%.1f}\n",
      w.name.c_str(), dtype.c_str(), static_cast<long long>(w.batch), static_cast<long long>(w.context), a.threads,
      tm.t.size(), w.unit.c_str(), n / med, n / tm.cpu_median(), n / tm.mean(), 1e3 * med, 1e3 * tm.min(),
      1e3 * tm.cpu_median(), last_loss, (peak - w.pool_bytes) / kMiB, w.pool_bytes / kMiB, rss1 - rss0, rss1);
  std::fflush(stdout);

  if (!a.phases) return;
  td::bench::print_phases(w.name + "_phases", dtype,
                          td::bench::time_phases(a, w.xs, w.ys, next, *w.opt, w.forward));
}

void bench_cnn(const Args& a, const std::string& dtype) {
  td::manual_seed(0);
  auto model = td::nn::models::cnn();
  Workload w;
  w.name = "cnn_step";
  w.unit = "samples";
  w.batch = a.batch > 0 ? a.batch : 64;
  w.items = w.batch;
  td::optim::AdamOptions o = td::optim::AdamW::defaults();
  o.lr = 1e-3;
  w.opt = std::make_unique<td::optim::AdamW>(model->parameters(), o);
  const int64_t before = td::current_allocated_bytes();
  for (int64_t i = 0; i < kPoolBatches; ++i) {
    w.xs.push_back(td::randn({w.batch, 1, 28, 28}));
    w.ys.push_back(td::randint(0, 10, {w.batch}));
  }
  w.pool_bytes = static_cast<double>(td::current_allocated_bytes() - before);
  if (dtype == "bf16") w.forward = [m = model](const td::Tensor& x) { return cnn_forward_bf16(*m, x); };
  else if (dtype == "autocast") w.forward = [m = model](const td::Tensor& x) {
    td::amp::autocast ac(td::kBFloat16);
    return (*m)(x);
  };
  else w.forward = [m = model](const td::Tensor& x) { return (*m)(x); };
  run(a, w, dtype);
}

void bench_gpt(const Args& a, const std::string& dtype) {
  td::manual_seed(0);
  td::nn::models::GptOptions go;
  go.context = a.context;
  auto model = td::nn::models::gpt(go);
  Workload w;
  w.name = "gpt_step";
  w.unit = "tokens";
  w.batch = a.batch > 0 ? a.batch : 8;
  w.context = a.context;
  w.items = w.batch * w.context;
  td::optim::AdamOptions o = td::optim::AdamW::defaults();
  o.lr = 3e-4;
  w.opt = std::make_unique<td::optim::AdamW>(model->parameters(), o);
  const int64_t before = td::current_allocated_bytes();
  for (int64_t i = 0; i < kPoolBatches; ++i) {
    w.xs.push_back(td::randint(0, go.vocab_size, {w.batch, w.context}));
    w.ys.push_back(td::randint(0, go.vocab_size, {w.batch * w.context}));
  }
  w.pool_bytes = static_cast<double>(td::current_allocated_bytes() - before);
  const int64_t V = go.vocab_size;
  if (dtype == "bf16") {
    w.forward = [m = model, V](const td::Tensor& x) { return gpt_forward_bf16(*m, x).view({-1, V}); };
  } else if (dtype == "autocast") {
    w.forward = [m = model, V](const td::Tensor& x) {
      td::amp::autocast ac(td::kBFloat16);
      return (*m)(x).view({-1, V});
    };
  } else {
    w.forward = [m = model, V](const td::Tensor& x) { return (*m)(x).view({-1, V}); };
  }
  run(a, w, dtype);
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  td::bench::init_and_print_env(a.threads);
  const std::vector<std::string> dtypes = td::bench::dtypes_to_run(a);
  if (a.workload.empty() || a.workload == "cnn") {
    for (const auto& d : dtypes) bench_cnn(a, d);
  }
  if (a.workload.empty() || a.workload == "gpt") {
    for (const auto& d : dtypes) bench_gpt(a, d);
  }
  return 0;
} catch (const std::exception& e) {
  return td::report(e);
}
