// tandem bench allreduce: nccl-tests style all_reduce timing. Without RANK/WORLD_SIZE in the
// environment it spawns --nproc local ranks itself (dist::spawn); under a launcher (tandem run,
// torchrun, mpirun) it is one rank of the launched job. Buffers come from
// ProcessGroup::allocate (zero-copy for shm). Rank 0 prints one row per size:
// bytes, count, dtype, time_us (slowest rank's mean), algbw = bytes / time, busbw = algbw * 2(n-1)/n,
// and, for machines shared with other work, p50_us (slowest rank's median iteration: robust to a
// rank being preempted now and then), busbw_p50 (busbw from p50_us) and cpu_us (the most CPU
// time one rank's process spent per iteration, all its threads).
#include <time.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tandem/dist/process_group.h"
#include "tandem/dist/spawn.h"
#include "tools/commands.h"

namespace tandem::tools {
namespace {

struct Args {
  int nproc = 2;
  std::string backend = "shm";
  std::string dtype = "f32";
  size_t min_bytes = 4 << 10;
  size_t max_bytes = 128 << 20;
  int iters = 20;
  int warmup = 5;
  bool json = false;
};

size_t parse_bytes(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  TANDEM_CHECK(end != s.c_str() && v >= 0, ValueError, "'{}' is not a byte size (e.g. 4096, 4K, 32M, 1G)", s);
  std::string unit(end);
  double mult = 1;
  if (unit == "K" || unit == "k" || unit == "KiB" || unit == "KB") mult = 1024;
  else if (unit == "M" || unit == "MiB" || unit == "MB") mult = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB" || unit == "GB") mult = 1024.0 * 1024 * 1024;
  else TANDEM_CHECK(unit.empty() || unit == "B", ValueError, "'{}': unknown size unit '{}' (use K, M or G)", s, unit);
  return static_cast<size_t>(v * mult);
}

void usage(std::FILE* f) {
  std::fprintf(f,
               "usage: tandem bench allreduce [--nproc N] [--backend shm|mpi|gloo] [--dtype f32|bf16|f16]\n"
               "                              [--min-bytes 4K] [--max-bytes 128M] [--iters K] [--warmup W] [--json]\n"
               "Spawns N local ranks (unless RANK/WORLD_SIZE are set: then it is one rank of a launched job)\n"
               "and prints, per size (doubling), bytes count dtype time_us algbw busbw (GB/s).\n");
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {  // argv[0] is the subcommand's name
    std::string k = argv[i];
    auto val = [&]() -> std::string {
      const size_t eq = k.find('=');
      if (eq != std::string::npos) return k.substr(eq + 1);
      TANDEM_CHECK(i + 1 < argc, ValueError, "{} needs a value", k);
      return argv[++i];
    };
    const std::string name = k.substr(0, k.find('='));
    // A whole decimal integer in [lo, hi], else an error naming the flag and the text (stoi said
    // only "stoi", and took "2x" as 2).
    auto integer = [&](int lo, int hi) {
      const std::string text = val();
      int v = 0;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      TANDEM_CHECK(ec == std::errc() && end == text.data() + text.size() && v >= lo && v <= hi, ValueError,
                   "tandem bench allreduce: {} expects an integer in [{}, {}], got \"{}\"", name, lo, hi, text);
      return v;
    };
    if (name == "--nproc" || name == "--nproc-per-node" || name == "--nproc_per_node") a.nproc = integer(1, 4096);
    else if (name == "--backend") a.backend = val();
    else if (name == "--dtype") a.dtype = val();
    else if (name == "--min-bytes" || name == "--min_bytes") a.min_bytes = parse_bytes(val());
    else if (name == "--max-bytes" || name == "--max_bytes") a.max_bytes = parse_bytes(val());
    else if (name == "--iters") a.iters = integer(1, 1 << 30);
    else if (name == "--warmup") a.warmup = integer(0, 1 << 30);
    else if (name == "--json") a.json = true;
    else throw ValueError(fmt::format("tandem bench allreduce: unknown option '{}' (see --help)", k));
  }
  TANDEM_CHECK(a.nproc >= 1, ValueError, "--nproc must be >= 1, got {}", a.nproc);
  TANDEM_CHECK(a.iters >= 1 && a.warmup >= 0, ValueError, "--iters must be >= 1 and --warmup >= 0");
  TANDEM_CHECK(a.min_bytes >= 1 && a.min_bytes <= a.max_bytes, ValueError,
               "--min-bytes ({}) must be >= 1 and <= --max-bytes ({})", a.min_bytes, a.max_bytes);
  TANDEM_CHECK(a.dtype == "f32" || a.dtype == "bf16" || a.dtype == "f16", ValueError,
               "--dtype must be f32, bf16 or f16, got '{}'", a.dtype);
  return a;
}

double process_cpu_us() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) * 1e-3;
}

DType dtype_of_name(const std::string& s) { return s == "f32" ? DType::f32 : s == "bf16" ? DType::bf16 : DType::f16; }

void run_rank(const Args& a) {
  dist::InitOptions o;
  o.backend = a.backend;
  o.timeout = std::chrono::minutes(5);
  auto pg = dist::init_process_group(o);
  const int n = pg->size();
  const DType d = dtype_of_name(a.dtype);
  const size_t es = element_size(d);
  auto mem = pg->allocate(a.max_bytes);
  std::memset(mem.get(), 0, a.max_bytes);  // zeros: no denormals, no overflow
  if (pg->rank() == 0) {
    if (!a.json) {
      std::printf("# tandem bench allreduce: backend %s, %d ranks, dtype %s, iters >= %d (+%d warmup), zero-copy buffers\n",
                  a.backend.c_str(), n, a.dtype.c_str(), a.iters, a.warmup);
      std::printf("# %12s %12s %6s %12s %12s %12s %10s %10s %10s\n", "bytes", "count", "dtype", "time_us", "algbw(GB/s)",
                  "busbw(GB/s)", "p50_us", "busbw_p50", "cpu_us");
    }
    std::fflush(stdout);
  }
  for (size_t bytes = a.min_bytes; bytes <= a.max_bytes; bytes *= 2) {
    const int64_t count = static_cast<int64_t>(bytes / es);
    dist::Buffer buf{mem.get(), count, d, kCPU};
    // Small sizes: more iterations, so a row takes a measurable time.
    const int iters = static_cast<int>(std::min<size_t>(20000, std::max<size_t>(a.iters, (size_t{1} << 20) / bytes * a.iters / 4)));
    for (int i = 0; i < a.warmup; ++i) pg->all_reduce(buf)->wait();
    pg->barrier()->wait();
    std::vector<double> each(static_cast<size_t>(iters));
    const double cpu0 = process_cpu_us();
    const auto t0 = std::chrono::steady_clock::now();
    auto prev = t0;
    for (int i = 0; i < iters; ++i) {
      pg->all_reduce(buf)->wait();
      const auto now = std::chrono::steady_clock::now();
      each[static_cast<size_t>(i)] = std::chrono::duration<double, std::micro>(now - prev).count();
      prev = now;
    }
    const double us = std::chrono::duration<double, std::micro>(prev - t0).count() / iters;
    const double cpu = (process_cpu_us() - cpu0) / iters;
    std::nth_element(each.begin(), each.begin() + iters / 2, each.end());
    double slowest[3] = {us, each[static_cast<size_t>(iters / 2)], cpu};  // mean, median, CPU
    pg->all_reduce(dist::Buffer{slowest, 3, DType::f64, kCPU}, dist::ReduceOp::MAX)->wait();
    if (pg->rank() == 0) {
      const double algbw = static_cast<double>(count * es) / (slowest[0] * 1e3);
      const double busbw = algbw * 2.0 * (n - 1) / n;
      const double busbw_p50 = static_cast<double>(count * es) / (slowest[1] * 1e3) * 2.0 * (n - 1) / n;
      if (a.json) {
        std::printf("{\"backend\": \"%s\", \"nproc\": %d, \"bytes\": %zu, \"count\": %lld, \"dtype\": \"%s\", "
                    "\"time_us\": %.3f, \"algbw\": %.4f, \"busbw\": %.4f, \"p50_us\": %.3f, \"busbw_p50\": %.4f, "
                    "\"cpu_us\": %.3f}\n",
                    a.backend.c_str(), n, static_cast<size_t>(count) * es, static_cast<long long>(count), a.dtype.c_str(),
                    slowest[0], algbw, busbw, slowest[1], busbw_p50, slowest[2]);
      } else {
        std::printf("  %12zu %12lld %6s %12.2f %12.3f %12.3f %10.2f %10.3f %10.2f\n", static_cast<size_t>(count) * es,
                    static_cast<long long>(count), a.dtype.c_str(), slowest[0], algbw, busbw, slowest[1], busbw_p50,
                    slowest[2]);
      }
      std::fflush(stdout);
    }
  }
  pg->barrier()->wait();
  dist::destroy_process_group();
}

}  // namespace

int bench_allreduce_main(int argc, char** argv) {
  try {
    for (int i = 1; i < argc; ++i) {
      if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
        usage(stdout);
        return 0;
      }
    }
    const Args a = parse(argc, argv);
    const char* rank = std::getenv("RANK");
    const char* ompi = std::getenv("OMPI_COMM_WORLD_RANK");
    if ((rank != nullptr && *rank != '\0') || (ompi != nullptr && *ompi != '\0')) {
      run_rank(a);  // one rank of a launched job
      return 0;
    }
    dist::SpawnOptions so;
    so.timeout = std::chrono::hours(1);
    dist::spawn(a.nproc, [&](int) { run_rank(a); }, so);
    return 0;
  } catch (const std::exception& e) {
    return report(e);
  }
}

}  // namespace tandem::tools
