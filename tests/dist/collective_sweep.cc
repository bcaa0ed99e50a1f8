// The collective sweep: inputs are closed-form functions of (rank, index), references are
// computed serially in f64 from the very values the ranks hold, and tolerances follow from the
// dtype (integers exact; f32/f64 sums within the summation-order bound; f16/bf16 sums within one
// ulp of the f64 sum when the backend accumulates in f32).
#include "collective_sweep.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>

#include <fmt/format.h>

namespace tandem::dist::testing {
namespace {

// ---- typed element access on raw buffers ----

void put(DType dt, void* base, int64_t i, double v) {
  switch (dt) {
    case DType::f32: static_cast<float*>(base)[i] = static_cast<float>(v); return;
    case DType::f64: static_cast<double*>(base)[i] = v; return;
    case DType::f16: static_cast<half*>(base)[i] = half(static_cast<float>(v)); return;
    case DType::bf16: static_cast<bfloat16*>(base)[i] = bfloat16(static_cast<float>(v)); return;
    case DType::i32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
    case DType::i64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); return;
    case DType::u8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); return;
    case DType::b8: static_cast<bool*>(base)[i] = v != 0; return;
  }
}

double get(DType dt, const void* base, int64_t i) {
  switch (dt) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::f64: return static_cast<const double*>(base)[i];
    case DType::f16: return static_cast<float>(static_cast<const half*>(base)[i]);
    case DType::bf16: return static_cast<float>(static_cast<const bfloat16*>(base)[i]);
    case DType::i32: return static_cast<const int32_t*>(base)[i];
    case DType::i64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DType::u8: return static_cast<const uint8_t*>(base)[i];
    case DType::b8: {
      uint8_t byte;
      std::memcpy(&byte, static_cast<const uint8_t*>(base) + i, 1);
      return byte;  // a bool byte other than 0/1 is a corruption worth seeing
    }
  }
  return 0;
}

// v rounded to what dtype dt holds (so references use exactly the ranks' values).
double representable(DType dt, double v) {
  double out;
  put(dt, &out, 0, v);
  return get(dt, &out, 0);
}

bool is_signed_int(DType dt) { return dt == DType::i32 || dt == DType::i64; }
bool is_int(DType dt) { return dt == DType::i32 || dt == DType::i64 || dt == DType::u8 || dt == DType::b8; }

// One unit in the last place of a 16-bit float at magnitude |x|.
double ulp16(DType dt, double x) {
  const int mantissa = dt == DType::bf16 ? 7 : 10;
  const int min_exp = dt == DType::bf16 ? -126 : -14;
  const double ax = std::fabs(x);
  int e = ax > 0 ? static_cast<int>(std::floor(std::log2(ax))) : min_exp;
  if (e < min_exp) e = min_exp;
  return std::ldexp(1.0, e - mantissa);
}

// ---- closed-form inputs ----

// Values that collectives only move: distinct per (rank, index) and exact in the dtype.
double move_value(DType dt, int r, int64_t i) {
  switch (dt) {
    case DType::b8: return static_cast<double>((r + i) % 2);
    case DType::u8: case DType::bf16: return static_cast<double>((r * 31 + i * 7) % 251);
    case DType::f16: return static_cast<double>((r * 31 + i * 7) % 2039);
    case DType::i64: return static_cast<double>((int64_t{r} << 33) + r * 100003 + i);
    default: return static_cast<double>(r * 100003 + i);  // f32, f64, i32: exact below 2^24
  }
}

// Inputs of reductions, exact in the dtype; sums of n <= 8 ranks stay in range.
double reduce_value(DType dt, ReduceOp op, int r, int64_t i) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      if (dt == DType::u8) return static_cast<double>((r + 1) * (i % 7 + 1));
      if (is_signed_int(dt)) return static_cast<double>((r + 1) * (i % 7 - 3));
      if (is_reduced_float(dt)) {
        // +-1.mmmmmmm x 2^k: 8 significant bits (exact in bf16 and f16) whose sums need more,
        // so a backend that rounds partial sums to 16 bits shows it; mixed signs make partial
        // sums larger than the result, where their rounding errors exceed the result's ulp.
        // Every value is a multiple of 2^-9 below 2^3, so f32 sums of them are exact.
        const int64_t m = (i * 37 + r * 11) % 128;
        const double sign = (i * 5 + r * 3) % 4 == 0 ? -1.0 : 1.0;
        return sign * std::ldexp(1.0 + static_cast<double>(m) / 128.0, static_cast<int>(i % 5) - 2);
      }
      return representable(dt, 0.1 * (r + 1) + 0.37 * static_cast<double>(i % 13) - 1.1);
    case ReduceOp::MAX:
    case ReduceOp::MIN: {
      const double v = static_cast<double>((i * 7 + r * 13) % 50);
      return dt == DType::u8 ? v : v - 25.0;
    }
    case ReduceOp::PRODUCT: {
      const int64_t k = (i + r) % 3;
      if (dt == DType::u8) return k == 0 ? 2.0 : 1.0;
      return k == 0 ? 2.0 : (k == 1 ? -1.0 : 1.0);
    }
  }
  return 0;
}

struct Expect {
  double value;
  double tolerance;
};

// The reduction over ranks 0..n-1 of reduce_value(dt, op, r, i), with its tolerance.
Expect reduce_reference(DType dt, ReduceOp op, int n, int64_t i, bool one_rounding) {
  double acc = reduce_value(dt, op, 0, i);
  double abs_sum = std::fabs(acc);
  for (int r = 1; r < n; ++r) {
    const double v = reduce_value(dt, op, r, i);
    abs_sum += std::fabs(v);
    switch (op) {
      case ReduceOp::SUM: case ReduceOp::AVG: acc += v; break;
      case ReduceOp::PRODUCT: acc *= v; break;
      case ReduceOp::MAX: acc = std::max(acc, v); break;
      case ReduceOp::MIN: acc = std::min(acc, v); break;
    }
  }
  if (op == ReduceOp::MAX || op == ReduceOp::MIN || op == ReduceOp::PRODUCT) return {acc, 0.0};  // exact
  double tol = 0.0;
  if (dt == DType::f32) tol = n * std::ldexp(1.0, -23) * abs_sum;  // n roundings of <= 1/2 ulp
  if (dt == DType::f64) tol = n * std::ldexp(1.0, -52) * abs_sum;
  if (is_reduced_float(dt)) {
    // One final rounding (<= 1/2 ulp) plus f32 accumulation error: within 1 ulp of the f64
    // sum. A 16-bit partial sum per step adds up to 1/2 ulp of the growing sum each time.
    tol = one_rounding ? ulp16(dt, acc) : std::max(1, n - 1) * ulp16(dt, abs_sum);
  }
  if (op == ReduceOp::AVG) {
    if (is_int(dt)) return {std::trunc(acc / n), 0.0};
    const double avg = acc / n;
    if (is_reduced_float(dt)) return {avg, one_rounding ? ulp16(dt, avg) : tol / n + ulp16(dt, avg)};
    return {avg, tol / n + (dt == DType::f32 ? std::ldexp(std::fabs(avg), -23) : std::ldexp(std::fabs(avg), -52))};
  }
  return {acc, tol};
}

// ---- the sweep ----

struct Context {
  ProcessGroup& pg;
  const SweepOptions& opt;
  SweepReport report;
  int rank() const { return pg.rank(); }
  int n() const { return pg.size(); }
};

// A typed host buffer filled with a byte sentinel (so elements a collective never wrote show).
struct HostBuf {
  DType dt;
  int64_t count;
  std::vector<unsigned char> bytes;
  HostBuf(DType d, int64_t c) : dt(d), count(c), bytes(static_cast<size_t>(c) * element_size(d) + 1, 0xA5) {}
  Buffer buffer() { return Buffer{bytes.data(), count, dt, kCPU}; }
  void set(int64_t i, double v) { put(dt, bytes.data(), i, v); }
  double at(int64_t i) const { return get(dt, bytes.data(), i); }
};

// A collective issued and not yet checked.
struct Pending {
  std::string what;
  std::shared_ptr<Work> work;
  std::function<void()> check;
  std::vector<std::shared_ptr<HostBuf>> hold;  // buffers the collective uses, kept until it completed
};

std::string describe(const Context& c, const std::string& op, DType dt, int64_t count) {
  return fmt::format("{} {} count {} (rank {} of {}, backend {})", op, dtype_name(dt), count, c.rank(), c.n(),
                     c.pg.backend_name());
}

void expect_element(const std::string& what, int64_t index, double got, Expect e) {
  const bool ok = std::isfinite(got) && std::fabs(got - e.value) <= e.tolerance;
  if (!ok) {
    throw SweepError(fmt::format("{}: element {} is {}, expected {} (tolerance {:g})", what, index, got, e.value, e.tolerance));
  }
}

bool wanted(const Context& c, const char* op) { return c.opt.ops.empty() || c.opt.ops.count(op) > 0; }

void sweep_one(Context& c, DType dt, int64_t count, std::vector<Pending>& pending) {
  const int n = c.n(), me = c.rank();
  const bool one_rounding = c.opt.reduced_float_one_rounding;
  auto keep = [&pending](std::string what, std::shared_ptr<Work> work, std::function<void()> check,
                          std::vector<std::shared_ptr<HostBuf>> hold) {
    pending.push_back(Pending{std::move(what), std::move(work), std::move(check), std::move(hold)});
  };
  const bool reducible = dt != DType::b8;

  if (wanted(c, "all_reduce") && reducible) {
    for (ReduceOp op : c.opt.reduce_ops) {
      auto buf = std::make_shared<HostBuf>(dt, count);
      for (int64_t i = 0; i < count; ++i) buf->set(i, reduce_value(dt, op, me, i));
      const std::string what = describe(c, fmt::format("all_reduce({})", reduce_op_name(op)), dt, count);
      keep(what, c.pg.all_reduce(buf->buffer(), op), [=, &c] {
        for (int64_t i = 0; i < count; ++i) expect_element(what, i, buf->at(i), reduce_reference(dt, op, n, i, one_rounding));
        c.report.elements_checked += count;
      }, {buf});
    }
  }
  if (wanted(c, "reduce") && reducible) {
    for (ReduceOp op : {ReduceOp::SUM, ReduceOp::MAX}) {
      const int root = static_cast<int>((count + (op == ReduceOp::MAX ? 1 : 0)) % n);
      auto buf = std::make_shared<HostBuf>(dt, count);
      for (int64_t i = 0; i < count; ++i) buf->set(i, reduce_value(dt, op, me, i));
      const std::string what = describe(c, fmt::format("reduce({}, root {})", reduce_op_name(op), root), dt, count);
      keep(what, c.pg.reduce(buf->buffer(), root, op), [=, &c] {
        if (me != root) return;  // other ranks' buffers are unspecified after reduce (c10d)
        for (int64_t i = 0; i < count; ++i) expect_element(what, i, buf->at(i), reduce_reference(dt, op, n, i, one_rounding));
        c.report.elements_checked += count;
      }, {buf});
    }
  }
  if (wanted(c, "broadcast")) {
    const int root = static_cast<int>(count % n);
    auto buf = std::make_shared<HostBuf>(dt, count);
    for (int64_t i = 0; i < count; ++i) buf->set(i, move_value(dt, me, i));
    const std::string what = describe(c, fmt::format("broadcast(root {})", root), dt, count);
    keep(what, c.pg.broadcast(buf->buffer(), root), [=, &c] {
      for (int64_t i = 0; i < count; ++i) expect_element(what, i, buf->at(i), {move_value(dt, root, i), 0});
      c.report.elements_checked += count;
    }, {buf});
  }
  if (wanted(c, "all_gather")) {
    auto in = std::make_shared<HostBuf>(dt, count);
    auto out = std::make_shared<HostBuf>(dt, count * n);
    for (int64_t i = 0; i < count; ++i) in->set(i, move_value(dt, me, i));
    const std::string what = describe(c, "all_gather", dt, count);
    keep(what, c.pg.all_gather(out->buffer(), in->buffer()), [=, &c] {
      for (int r = 0; r < n; ++r)
        for (int64_t i = 0; i < count; ++i) expect_element(what, r * count + i, out->at(r * count + i), {move_value(dt, r, i), 0});
      c.report.elements_checked += count * n;
    }, {in, out});
  }
  if (wanted(c, "all_gather_list")) {
    auto in = std::make_shared<HostBuf>(dt, count);
    for (int64_t i = 0; i < count; ++i) in->set(i, move_value(dt, me, i));
    std::vector<std::shared_ptr<HostBuf>> outs;
    std::vector<Buffer> views;
    std::vector<std::shared_ptr<HostBuf>> hold{in};
    for (int r = 0; r < n; ++r) {
      outs.push_back(std::make_shared<HostBuf>(dt, count));
      views.push_back(outs.back()->buffer());
      hold.push_back(outs.back());
    }
    const std::string what = describe(c, "all_gather(list)", dt, count);
    keep(what, c.pg.all_gather(views, in->buffer()), [=, &c] {
      for (int r = 0; r < n; ++r)
        for (int64_t i = 0; i < count; ++i)
          expect_element(fmt::format("{} output {}", what, r), i, outs[r]->at(i), {move_value(dt, r, i), 0});
      c.report.elements_checked += count * n;
    }, hold);
  }
  if (wanted(c, "reduce_scatter") && reducible) {
    for (ReduceOp op : {ReduceOp::SUM, ReduceOp::MAX}) {
      auto in = std::make_shared<HostBuf>(dt, count * n);
      auto out = std::make_shared<HostBuf>(dt, count);
      for (int64_t j = 0; j < count * n; ++j) in->set(j, reduce_value(dt, op, me, j));
      const std::string what = describe(c, fmt::format("reduce_scatter({})", reduce_op_name(op)), dt, count);
      keep(what, c.pg.reduce_scatter(out->buffer(), in->buffer(), op), [=, &c] {
        for (int64_t i = 0; i < count; ++i)
          expect_element(what, i, out->at(i), reduce_reference(dt, op, n, me * count + i, one_rounding));
        c.report.elements_checked += count;
      }, {in, out});
    }
  }
  if (wanted(c, "gather")) {
    const int root = static_cast<int>((count + 1) % n);
    auto in = std::make_shared<HostBuf>(dt, count);
    auto out = std::make_shared<HostBuf>(dt, me == root ? count * n : 0);
    for (int64_t i = 0; i < count; ++i) in->set(i, move_value(dt, me, i));
    const std::string what = describe(c, fmt::format("gather(root {})", root), dt, count);
    keep(what, c.pg.gather(out->buffer(), in->buffer(), root), [=, &c] {
      if (me != root) return;
      for (int r = 0; r < n; ++r)
        for (int64_t i = 0; i < count; ++i) expect_element(what, r * count + i, out->at(r * count + i), {move_value(dt, r, i), 0});
      c.report.elements_checked += count * n;
    }, {in, out});
  }
  if (wanted(c, "scatter")) {
    const int root = static_cast<int>((count + 2) % n);
    auto in = std::make_shared<HostBuf>(dt, me == root ? count * n : 0);
    auto out = std::make_shared<HostBuf>(dt, count);
    if (me == root)
      for (int64_t j = 0; j < count * n; ++j) in->set(j, move_value(dt, root, j));
    const std::string what = describe(c, fmt::format("scatter(root {})", root), dt, count);
    keep(what, c.pg.scatter(out->buffer(), in->buffer(), root), [=, &c] {
      for (int64_t i = 0; i < count; ++i) expect_element(what, i, out->at(i), {move_value(dt, root, me * count + i), 0});
      c.report.elements_checked += count;
    }, {in, out});
  }
  if (wanted(c, "all_to_all")) {
    auto in = std::make_shared<HostBuf>(dt, count * n);
    auto out = std::make_shared<HostBuf>(dt, count * n);
    for (int64_t j = 0; j < count * n; ++j) in->set(j, move_value(dt, me, j));  // block j goes to rank j
    const std::string what = describe(c, "all_to_all", dt, count * n);
    keep(what, c.pg.all_to_all(out->buffer(), in->buffer()), [=, &c] {
      for (int r = 0; r < n; ++r)  // block r came from rank r: its block `me`
        for (int64_t k = 0; k < count; ++k)
          expect_element(what, r * count + k, out->at(r * count + k), {move_value(dt, r, me * count + k), 0});
      c.report.elements_checked += count * n;
    }, {in, out});
  }
  if (wanted(c, "barrier")) {
    keep(describe(c, "barrier", dt, count), c.pg.barrier(), [] {}, {});
  }
}

void finish_all(Context& c, std::vector<Pending>& pending) {
  // Waited in issue order: this also checks that a backend completes them in that order.
  for (auto& p : pending) {
    try {
      p.work->wait(c.opt.wait_timeout);
    } catch (const std::exception& e) {
      throw SweepError(fmt::format("{}: the collective failed: {}", p.what, e.what()));
    }
    p.check();
    ++c.report.collectives;
  }
  pending.clear();
}

// Ring exchange: rank r sends to r+1 and receives from r-1. Even ranks send first, odd ranks
// receive first, so even a backend that runs point-to-point ops one at a time cannot deadlock.
void send_recv(Context& c, DType dt, int64_t count) {
  const int n = c.n(), me = c.rank();
  if (n < 2) return;
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  HostBuf out(dt, count), in(dt, count);
  for (int64_t i = 0; i < count; ++i) out.set(i, move_value(dt, me, i));
  const std::string what = describe(c, fmt::format("send/recv (to {}, from {})", next, prev), dt, count);
  try {
    if (me % 2 == 0) {
      c.pg.send(out.buffer(), next, 3)->wait(c.opt.wait_timeout);
      c.pg.recv(in.buffer(), prev, 3)->wait(c.opt.wait_timeout);
    } else {
      c.pg.recv(in.buffer(), prev, 3)->wait(c.opt.wait_timeout);
      c.pg.send(out.buffer(), next, 3)->wait(c.opt.wait_timeout);
    }
  } catch (const std::exception& e) {
    throw SweepError(fmt::format("{}: failed: {}", what, e.what()));
  }
  for (int64_t i = 0; i < count; ++i) expect_element(what, i, in.at(i), {move_value(dt, prev, i), 0});
  c.report.collectives += 2;
  c.report.elements_checked += count;
}

}  // namespace

SweepReport run_collective_sweep(ProcessGroup& pg, const SweepOptions& options) {
  Context c{pg, options, {}};
  std::vector<int64_t> counts = options.counts;
  if (counts.empty()) counts = {0, 1, 1009, 4 * 37 + 1};
  std::vector<Pending> pending;
  for (DType dt : options.dtypes) {
    for (int64_t count : counts) {
      sweep_one(c, dt, count, pending);
      finish_all(c, pending);
      if (wanted(c, "send_recv")) send_recv(c, dt, count);
    }
  }
  if (options.large && wanted(c, "all_reduce")) {
    // 64 MiB of f32, SUM.
    const int64_t count = int64_t{16} << 20;
    const DType dt = DType::f32;
    auto buf = std::make_shared<HostBuf>(dt, count);
    for (int64_t i = 0; i < count; ++i) buf->set(i, reduce_value(dt, ReduceOp::SUM, pg.rank(), i));
    const std::string what = describe(c, "all_reduce(SUM, 64 MiB)", dt, count);
    pending.push_back(Pending{what, pg.all_reduce(buf->buffer(), ReduceOp::SUM), [&c, buf, what, count, n = pg.size()] {
                                for (int64_t i = 0; i < count; ++i)
                                  expect_element(what, i, buf->at(i), reduce_reference(DType::f32, ReduceOp::SUM, n, i, true));
                                c.report.elements_checked += count;
                              }, {buf}});
    finish_all(c, pending);
  }
  return c.report;
}

}  // namespace tandem::dist::testing
