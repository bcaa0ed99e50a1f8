// ddp_step_bench: DDP training throughput of W1/W2/W3 on N local ranks over the shm backend, one
// thread and one core per rank — the Tandem side of bench/run_ddp_bench.sh (PyTorch's side is
// bench/torch_ddp_step.py with gloo DDP). Rank 0 prints one JSON line:
//   {"impl":"tandem","workload":..,"dtype":..,"nproc":N,"samples_per_s":..,"step_ms":..,"cpu_step_ms":..}
// samples_per_s counts the global batch (N x per-rank batch) per step; W3 also reports tokens_per_s.
// --phases prints, per rank to stderr, the step split into forward / backward / optimizer, the
// reducer's timeline (first bucket launch, end of backward, wait for communication after it) and
// main-thread vs other-thread (progress thread) CPU time, and the time inside oneDNN GEMM and
// convolution calls (kernel_timing.h). DDP options other than PyTorch's
// defaults (--bucket-cap-mb, --first-bucket-mb, --gradient-as-bucket-view, --delay-allreduce)
// are for profiling; run_ddp_bench.sh uses the defaults on both sides. --fused-optimizer steps the
// optimizer inside backward, bucket by bucket (DistributedDataParallel::register_fused_optimizer;
// torch's _register_fused_optim): run_ddp_bench.sh's extra "fused" rows.
#include <sched.h>

#include <cstdio>
#include <cstdlib>

#include "bench_common.h"
#include "tandem/amp/autocast.h"
#include "tandem/dist/spawn.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/local_sgd.h"
#include "tandem/parallel/powersgd.h"
#include "tandem/parallel/sync_batch_norm.h"

namespace td = tandem;
using td::Tensor;

namespace {

struct Args : td::bench::CommonArgs {
  std::string workload = "w1";
  int nproc = 1;
  int64_t batch = 0;  // per rank; 0: the workload's default (w1 128, w2 64, w3 8)
  td::parallel::DDPOptions ddp;  // PyTorch's defaults unless a flag changes them (profiling)
  // none | fp16 | bf16 | noop (no communication: the all-reduce's cost by difference) | powersgd (rank --powersgd-rank, from the 3rd iteration, error feedback and
  // warm start on: torch's defaults but start_powerSGD_iter, which the warmup steps pass).
  std::string comm_hook = "none";
  int64_t powersgd_rank = 1;
  bool sync_bn = false;  // W2: every BatchNorm a SyncBatchNorm over the group
  bool fused_optimizer = false;
};

struct Phases {
  double forward = 0, backward = 0, optimizer = 0;      // wall seconds, summed over steps
  double first_launch = 0, backward_nodes = 0, comm_after = 0;  // from the reducer's timeline
};

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

void bind_to_core(int rank) {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return;
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  }
  if (cores.empty()) return;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cores[static_cast<size_t>(rank) % cores.size()], &one);
  sched_setaffinity(0, sizeof(one), &one);
}

void run_rank(const Args& a) {
  // Bind before the group starts its progress thread, so that the thread shares its rank's core
  // (as gloo's threads do on the PyTorch side, which binds before init_process_group); a floating
  // progress thread would take time from the other rank's core. TANDEM_BENCH_FLOAT_PROGRESS=1
  // binds only the main thread, after the group started (for comparison).
  const bool float_progress = std::getenv("TANDEM_BENCH_FLOAT_PROGRESS") != nullptr;
  if (!float_progress) bind_to_core(std::atoi(std::getenv("LOCAL_RANK") ? std::getenv("LOCAL_RANK") : "0"));
  auto group = td::dist::init_process_group({.backend = "shm"});
  if (float_progress) bind_to_core(group->rank());
  td::manual_seed(0);
  std::shared_ptr<td::nn::Module> model;
  std::shared_ptr<td::optim::Optimizer> opt;
  std::vector<Tensor> xs, ys;
  td::Generator gen(100 + group->rank());
  const bool gpt = a.workload == "w3";
  int64_t B = a.batch;
  if (a.workload == "w1") {
    B = B ? B : 128;
    model = td::nn::models::mlp();
  } else if (a.workload == "w2") {
    B = B ? B : 64;
    model = td::nn::models::cnn();
  } else if (gpt) {
    B = B ? B : 8;
    model = td::nn::models::gpt();
  } else {
    throw td::ValueError(fmt::format("--workload must be w1, w2 or w3, got '{}'", a.workload));
  }
  for (int i = 0; i < 8; ++i) {
    if (gpt) {
      Tensor t = td::randint(0, 256, {B, 129}, &gen);
      xs.push_back(t.narrow(1, 0, 128).contiguous());
      ys.push_back(t.narrow(1, 1, 128).contiguous().reshape({-1}));
    } else {
      xs.push_back(td::randn({B, 1, 28, 28}, td::kFloat32, &gen));
      ys.push_back(td::randint(0, 10, {B}, &gen));
    }
  }
  if (a.sync_bn) td::parallel::convert_sync_batchnorm(*model, group);
  td::parallel::DistributedDataParallel ddp(model, group, a.ddp);
  std::unique_ptr<td::parallel::PeriodicModelAverager> averager;
  if (a.comm_hook == "fp16") {
    ddp.register_comm_hook(td::parallel::fp16_compress_hook);
  } else if (a.comm_hook == "bf16") {
    ddp.register_comm_hook(td::parallel::bf16_compress_hook);
  } else if (a.comm_hook == "noop") {
    ddp.register_comm_hook(td::parallel::noop_hook);  // DDP without the all-reduce: what communication costs
  } else if (a.comm_hook == "powersgd") {
    ddp.register_comm_hook(td::parallel::powerSGD_hook(std::make_shared<td::parallel::PowerSGDState>(
        td::parallel::PowerSGDOptions{.matrix_approximation_rank = a.powersgd_rank, .start_powerSGD_iter = 2})));
  } else if (a.comm_hook == "localsgd") {
    // Post-local SGD: two plain DDP steps, then each rank's own gradients, the parameters averaged
    // every 4 optimizer steps (torch's post_localSGD_hook + PeriodicModelAverager).
    ddp.register_comm_hook(td::parallel::post_localSGD_hook(std::make_shared<td::parallel::PostLocalSGDState>(
        td::parallel::PostLocalSGDOptions{.start_localSGD_iter = 2, .post_local_gradient_allreduce = false})));
    averager = std::make_unique<td::parallel::PeriodicModelAverager>(4, 2, group);
  } else if (a.comm_hook != "none") {
    throw td::ValueError(fmt::format("--comm-hook must be none, fp16, bf16, noop, powersgd or localsgd, got '{}'", a.comm_hook));
  }
  if (a.workload == "w1") {
    opt = std::make_shared<td::optim::SGD>(model->parameters(), td::optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  } else {
    opt = std::make_shared<td::optim::AdamW>(model->parameters(), td::optim::AdamOptions{.lr = 1e-3});
  }
  ddp.attach_optimizer(opt.get());  // check_replicas compares the optimizer state too
  if (a.fused_optimizer) ddp.register_fused_optimizer(opt);
  const bool bf16 = a.dtype == "bf16";
  size_t next = 0;
  // --phases: per-rank wall split of the step, the main thread's CPU time and the reducer's
  // timeline (backward end -> last bucket done = the wait for communication after backward).
  Phases ph;
  auto step = [&] {
    const Tensor& x = xs[next % xs.size()];
    const Tensor& y = ys[next % ys.size()];
    ++next;
    const auto t0 = td::bench::Clock::now();
    opt->zero_grad();
    Tensor loss;
    {
      td::amp::autocast cast({.dtype = td::kBFloat16, .enabled = bf16});
      Tensor out = ddp(x);
      loss = td::ops::cross_entropy(gpt ? out.view({-1, out.size(-1)}) : out, y);
    }
    const auto t1 = td::bench::Clock::now();
    loss.backward();
    const auto t2 = td::bench::Clock::now();
    if (!a.fused_optimizer) opt->step();
    if (averager) averager->average_parameters(model->parameters());
    if (a.phases) {
      ph.forward += std::chrono::duration<double>(t1 - t0).count();
      ph.backward += std::chrono::duration<double>(t2 - t1).count();
      ph.optimizer += td::bench::seconds_since(t2);
      const auto& tm = ddp.reducer().last_timings();
      if (!tm.empty()) {
        ph.first_launch += tm.front().launch_s;
        ph.backward_nodes += ddp.reducer().last_backward_end_s();
        ph.comm_after += std::max(0.0, tm.back().done_s - ddp.reducer().last_backward_end_s());
      }
    }
  };
  // Warm up, then agree on a step count (rank 0's estimate) so every rank runs the same steps.
  for (int64_t i = 0; i < std::max<int64_t>(a.warmup, 3); ++i) step();
  const auto w0 = td::bench::Clock::now();
  for (int i = 0; i < 3; ++i) step();
  const double per_step = td::bench::seconds_since(w0) / 3;
  Tensor steps = td::tensor(std::vector<int64_t>{std::max<int64_t>(a.min_steps, static_cast<int64_t>(a.seconds / per_step))}, {1});
  group->broadcast(steps, 0)->wait();
  const int64_t n = steps.data_ptr<int64_t>()[0];
  group->barrier()->wait();
  ph = Phases{};
  td::kernels::reset_kernel_timing();
  td::kernels::set_kernel_timing(a.phases);
  const double c0 = td::bench::process_cpu_seconds(), m0 = thread_cpu_seconds();
  const auto t0 = td::bench::Clock::now();
  for (int64_t i = 0; i < n; ++i) step();
  const double main_cpu = thread_cpu_seconds() - m0;
  td::kernels::set_kernel_timing(false);
  group->barrier()->wait();
  const double wall = td::bench::seconds_since(t0), cpu = td::bench::process_cpu_seconds() - c0;
  if (a.phases) {
    const double k = 1e3 / static_cast<double>(n);
    const auto gemm = td::kernels::kernel_time(td::kernels::KernelKind::gemm);
    const auto conv = td::kernels::kernel_time(td::kernels::KernelKind::conv);
    std::fprintf(stderr,
                 "rank %d: per step (ms) forward %.2f backward %.2f (first bucket launched at %.2f, nodes done at "
                 "%.2f, then waited %.2f for communication) optimizer %.2f | main-thread cpu %.2f, other threads "
                 "cpu %.2f, wall %.2f | in GEMM %.2f (%.0f GFLOP/s), in convolution %.2f (%.0f GFLOP/s) | bf16 products %s\n",
                 group->rank(), ph.forward * k, ph.backward * k, ph.first_launch * k, ph.backward_nodes * k,
                 ph.comm_after * k, ph.optimizer * k, main_cpu * k, (cpu - main_cpu) * k, wall * k, gemm.seconds * k,
                 td::bench::gflops_per_s(gemm), conv.seconds * k, td::bench::gflops_per_s(conv),
                 td::kernels::bf16_products_name(td::kernels::bf16_products()));
  }
  if (group->rank() == 0) {
    const double samples = static_cast<double>(n * B * group->size());
    std::printf(
        "{\"impl\":\"tandem\",\"workload\":\"%s\",\"dtype\":\"%s\",\"nproc\":%d,\"per_rank_batch\":%lld,\"steps\":%lld,"
        "\"samples_per_s\":%.2f,\"tokens_per_s\":%.1f,\"step_ms\":%.3f,\"cpu_step_ms\":%.3f,\"fused_optimizer\":%s}\n",
        a.workload.c_str(), bf16 ? "bf16" : "f32", group->size(), static_cast<long long>(B), static_cast<long long>(n),
        samples / wall, gpt ? samples * 128 / wall : 0.0, 1e3 * wall / n, 1e3 * cpu / n,
        a.fused_optimizer ? "true" : "false");
    std::fflush(stdout);
  }
  td::dist::destroy_process_group();
}

}  // namespace

int main(int argc, char** argv) try {
  Args a;
  a.dtype = "f32";
  a.min_steps = 10;
  td::bench::parse_args(argc, argv, a,
                        "ddp_step_bench [--workload w1|w2|w3] [--dtype f32|bf16] [--nproc N] [--batch B] "
                        "[--seconds S] [--min-steps N] [--warmup W] [--phases] [--bucket-cap-mb MB] [--first-bucket-mb MB] "
                        "[--gradient-as-bucket-view] [--delay-allreduce] [--deterministic] [--check-replicas-every N] [--comm-hook none|fp16|bf16|noop|powersgd|localsgd] "
                        "[--powersgd-rank R] [--sync-bn] [--fused-optimizer]",
                        [&](const std::string& k, auto value) {
                          if (k == "--workload") a.workload = value();
                          else if (k == "--nproc") a.nproc = std::stoi(value());
                          else if (k == "--batch") a.batch = std::stoll(value());
                          else if (k == "--bucket-cap-mb") a.ddp.bucket_cap_mb = std::stod(value());
                          else if (k == "--first-bucket-mb") a.ddp.first_bucket_mb = std::stod(value());
                          else if (k == "--gradient-as-bucket-view") a.ddp.gradient_as_bucket_view = true;
                          else if (k == "--delay-allreduce") a.ddp.delay_allreduce = true;
                          else if (k == "--deterministic") a.ddp.deterministic = true;
                          else if (k == "--check-replicas-every") a.ddp.check_replicas_every = std::stoll(value());
                          else if (k == "--comm-hook") a.comm_hook = value();
                          else if (k == "--powersgd-rank") a.powersgd_rank = std::stoll(value());
                          else if (k == "--sync-bn") a.sync_bn = true;
                          else if (k == "--fused-optimizer") a.fused_optimizer = true;
                          else return false;
                          return true;
                        });
  td::dist::SpawnOptions so;
  so.env["TANDEM_NUM_THREADS"] = "1";
  so.env["OMP_NUM_THREADS"] = "1";
  td::dist::spawn(a.nproc, [&](int) { run_rank(a); }, so);
  return 0;
} catch (const std::exception& e) {
  return td::report(e);
}
