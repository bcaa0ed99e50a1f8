// A seeded random sweep of conv2d, max/avg/adaptive pools, batch/group/layer norm and the
// selection ops (where, masked_fill, tril, triu) against PyTorch (tests/oracle/ops_fuzz_oracle.py),
// forward and every input gradient, in f64, f32 and bf16, over the options users pass: strides,
// paddings beyond half the kernel, dilation, groups (depthwise with a channel multiplier), bias
// on/off, batch 1 and 0, non-square sizes, kernel equal to the input, and non-contiguous inputs
// (transposed, channels-last, strided and narrowed views). The parameters come from a fixed-seed
// std::mt19937_64, so a failure names a case that reruns identically; the oracle gets each case's
// spec in cases.json and the shared case protocol of oracle_common.py.
//
// The reference is always PyTorch in f64 on the very values Tandem saw (f32 and bf16 inputs and
// the loss weights are stored as f64, exactly), so each dtype's tolerance is Tandem's own error
// against the exact result, |actual - expected| <= atol + rtol |expected|:
//  * rtol: f64 1e-12; f32 2^-21 (4 ulp: the result's own rounding plus a few roundings of
//    intermediate scale/shift factors); bf16 2^-8 (one bf16 ulp: the output is rounded once to
//    8 significant bits, 2^-9, from an f32 value already carrying its own small error).
//  * atol = 4 u n s with u the unit roundoff of the accumulation (2^-53 for f64, 2^-24 for f32 and
//    bf16, which accumulate in f32), n the longest sum behind an element (conv: C/g*KH*KW forward,
//    N*OH*OW for the weight gradient; a norm's reduction length) and s the size of its terms (inputs
//    in [-1, 1] or a shifted range, loss weights randn < 5; for norms s also carries the
//    conditioning 1/std, computed from the case's own data). This bounds summation error in any
//    order; a wrong index, a dropped term or a wrong formula is off by O(s), far beyond it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fmt/ranges.h>

#include "util/test_util.h"

namespace tandem {
namespace {

using testing::all_close;
using Fn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

constexpr double kU64 = 0x1p-53, kU32 = 0x1p-24;
constexpr double kWeightBound = 5.0;  // |randn| of the loss weights, with margin

const char* dt_tag(DType dt) { return dt == kFloat64 ? "f64" : dt == kFloat32 ? "f32" : "bf16"; }

// ---- input views: the tensor is stored in one shape, the op sees a non-contiguous view ----
// (mirrored by VIEWS in ops_fuzz_oracle.py)
Shape stored_shape(Shape s, const std::string& view) {
  const size_t d = s.size();
  if (view == "t") std::swap(s[d - 2], s[d - 1]);
  else if (view == "cl") s = {s[0], s[2], s[3], s[1]};
  else if (view == "s") s[d - 1] *= 2;
  else if (view == "n1") s[1] += 2;
  return s;
}

Tensor apply_view(const Tensor& t, const std::string& view) {
  const int64_t d = t.dim();
  if (view == "t") return t.transpose(d - 2, d - 1);
  if (view == "cl") return t.permute({0, 3, 1, 2});
  if (view == "s") return t.slice(d - 1, 0, t.size(d - 1), 2);
  if (view == "n1") return t.narrow(1, 1, t.size(1) - 2);
  return t;
}

std::string json_pair(const std::array<int64_t, 2>& a) { return fmt::format("[{}, {}]", a[0], a[1]); }
std::string json_shape(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

struct FuzzCase {
  std::string id;    // "<op>_<index>", the oracle's key; the case is "<id>__<dtype>"
  DType dt;
  std::string spec;  // JSON object for the oracle, without "views"
  std::vector<Tensor> inputs;  // as stored: leaves (requiring grad) or constants
  std::vector<std::string> views;
  Fn fn;             // gets the viewed inputs
  double acc = 1, scale = 1;
  std::vector<Tensor> outputs, grads;
  std::vector<DType> out_dts;  // expected dtype of output k; c.dt past its end
  bool skipped = false;         // fn threw: reported, not sent to the oracle
  std::string name() const { return id + "__" + dt_tag(dt); }
};

class Sweep {
 public:
  explicit Sweep(uint64_t seed) : rng_(seed) {}

  int64_t uni(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng_); }
  bool coin(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  template <class T>
  T pick(const std::vector<T>& v) { return v[static_cast<size_t>(uni(0, static_cast<int64_t>(v.size()) - 1))]; }

  // An input of logical shape `shape`, stored as `view` requires, values uniform in [lo, hi).
  Tensor input(FuzzCase& c, const Shape& shape, const std::string& view, double lo = -1, double hi = 1, bool grad = true) {
    Tensor t = testing::leaf(stored_shape(shape, view), lo, hi, data_seed_++, c.dt);
    if (!grad) t = t.detach();
    c.inputs.push_back(t);
    c.views.push_back(view);
    return t;
  }
  // A constant (no grad) of any dtype, no view.
  void constant(FuzzCase& c, const Tensor& t) {
    c.inputs.push_back(t);
    c.views.emplace_back();
  }

  FuzzCase& start(const std::string& op, DType dt) {
    FuzzCase c;
    c.id = fmt::format("{}_{:03}", op, cases_.size());
    c.dt = dt;
    cases_.push_back(std::move(c));
    return cases_.back();
  }

  size_t size() const { return cases_.size(); }
  std::vector<FuzzCase>& cases() { return cases_; }

  // Runs every case here and in the oracle and compares; returns the number of tensors compared.
  size_t run() {
    Generator wgen(4243);
    std::vector<std::pair<std::string, Tensor>> files;
    std::string specs;
    // Some outputs reach the loss through a transpose, so their gradient arrives non-contiguous.
    std::mt19937_64 out_views(77);
    for (FuzzCase& c : cases_) {
      SCOPED_TRACE(c.name());
      const bool out_t = std::uniform_real_distribution<double>(0, 1)(out_views) < 0.2;
      // Inputs as the oracle needs them, before fn (which may update running stats in place).
      std::vector<std::pair<std::string, Tensor>> inputs;
      for (size_t i = 0; i < c.inputs.size(); ++i) {
        const Tensor& in = c.inputs[i];
        const Tensor saved = is_floating(in.dtype()) ? in.detach().to(kFloat64).clone() : in.detach().clone();
        inputs.emplace_back(c.name() + (in.requires_grad() ? ".x" : ".c") + std::to_string(i), saved);
      }
      std::vector<Tensor> viewed;
      for (size_t i = 0; i < c.inputs.size(); ++i) viewed.push_back(apply_view(c.inputs[i], c.views[i]));
      try {
        c.outputs = c.fn(viewed);
        if (out_t && !c.outputs.empty() && c.outputs[0].dim() >= 2) c.outputs[0] = apply_view(c.outputs[0], "t");
      } catch (const Error& e) {
        // Reported here and left out of the oracle's batch, so the other cases still compare.
        ADD_FAILURE() << c.name() << " {" << c.spec << "}: " << e.what();
        c.skipped = true;
        continue;
      }
      files.insert(files.end(), inputs.begin(), inputs.end());
      std::string views;
      for (size_t i = 0; i < c.views.size(); ++i) views += fmt::format("{}\"{}\"", i ? ", " : "", c.views[i]);
      specs += fmt::format("{}\"{}\": {{{}, \"views\": [{}], \"out_t\": {}}}", specs.empty() ? "" : ",\n", c.id, c.spec,
                           views, out_t);
      Tensor loss;
      for (size_t k = 0; k < c.outputs.size(); ++k) {
        const Tensor& o = c.outputs[k];
        if (!is_floating(o.dtype())) continue;
        const Tensor w = randn(o.shape(), o.dtype(), &wgen);
        files.emplace_back(c.name() + ".w" + std::to_string(k), w.to(kFloat64));
        const Tensor term = ops::sum(ops::mul(o, w));
        loss = loss.defined() ? ops::add(loss, term) : term;
      }
      c.grads = loss.defined() && loss.requires_grad() ? testing::input_grads(loss, c.inputs)
                                                      : std::vector<Tensor>(c.inputs.size());
    }
    specs = "{\n" + specs + "\n}\n";
    testing::TempDir in, out;
    testing::save_tensors(in.path(), files);
    {
      std::FILE* f = std::fopen((in.path() + "/cases.json").c_str(), "w");
      EXPECT_NE(f, nullptr);
      if (!f) return 0;
      std::fputs(specs.c_str(), f);
      std::fclose(f);
    }
    EXPECT_EQ(testing::run_oracle("ops_fuzz_oracle.py", {in.path(), out.path()}), 0) << "ops_fuzz_oracle.py failed";
    const auto expected = testing::load_tensors(out.path());

    size_t compared = 0;
    for (const FuzzCase& c : cases_) {
      if (c.skipped) continue;
      const double u = c.dt == kFloat64 ? kU64 : kU32;
      const double rtol = c.dt == kFloat64 ? 1e-12 : c.dt == kFloat32 ? 0x1p-21 : 0x1p-8;
      const double atol = std::max(4 * u * c.acc * c.scale, c.dt == kFloat64 ? 1e-14 : 1e-9);
      auto check = [&](const Tensor& actual, const std::string& key, DType want_dt) {
        Tensor want;
        try {
          want = testing::find_tensor(expected, key);
        } catch (const ValueError&) {
          ADD_FAILURE() << "the oracle wrote no " << key;
          return;
        }
        EXPECT_EQ(dtype_name(actual.dtype()), dtype_name(want_dt)) << key;
        const Tensor a = is_floating(actual.dtype()) ? actual.to(kFloat64) : actual;
        EXPECT_TRUE(all_close(a, want, rtol, atol)) << key << " {" << c.spec << "} views "
                                                    << fmt::format("{}", fmt::join(c.views, ",")) << " (atol " << atol
                                                    << ")";
        ++compared;
        // A tolerance near the values' own size would make a comparison that cannot fail. (Results
        // well below the O(1) inputs and weights are cancellations, e.g. layer_norm over 2 elements
        // has an input gradient of ~eps / var: there the check is that they do cancel.)
        double largest = 0;
        for (double e : want.to_vector())
          if (std::isfinite(e)) largest = std::max(largest, std::abs(e));
        if (largest > 0.1) EXPECT_LE(atol, 0.02 * largest) << key << " {" << c.spec << "}: atol is too loose to test anything";
      };
      // The op's output has the input's dtype; extra outputs (running stats) keep their own (out_dts).
      for (size_t k = 0; k < c.outputs.size(); ++k)
        check(c.outputs[k], c.name() + ".out" + std::to_string(k), k < c.out_dts.size() ? c.out_dts[k] : c.dt);
      for (size_t i = 0; i < c.grads.size(); ++i)
        if (c.grads[i].defined()) check(c.grads[i], c.name() + ".g" + std::to_string(i), c.inputs[i].dtype());
    }
    EXPECT_EQ(compared, expected.size()) << "the oracle computed tensors this side did not compare";
    return compared;
  }

 private:
  std::mt19937_64 rng_;
  uint64_t data_seed_ = 1;
  std::vector<FuzzCase> cases_;
};

// A view for a 4-d activation (N, C, H, W): mostly contiguous, else one of the strided layouts.
std::string activation_view(Sweep& s) {
  return s.pick<std::string>({"", "", "", "t", "cl", "cl", "s", "n1"});
}

// ---------------------------------------------------------------------------------- conv2d

// A conv2d case's spec for the oracle and the function it runs (bias when a third input exists).
void set_conv(FuzzCase& c, const std::array<int64_t, 2>& stride, const std::array<int64_t, 2>& pad,
              const std::array<int64_t, 2>& dil, int64_t g) {
  c.spec = fmt::format("\"op\": \"conv2d\", \"stride\": {}, \"padding\": {}, \"dilation\": {}, \"groups\": {}",
                       json_pair(stride), json_pair(pad), json_pair(dil), g);
  const ops::Conv2dOptions o{stride, pad, dil, g};
  c.fn = [o](const std::vector<Tensor>& v) {
    return std::vector<Tensor>{ops::conv2d(v[0], v[1], v.size() > 2 ? v[2] : Tensor(), o)};
  };
}

void add_conv(Sweep& s, DType dt, bool empty) {
  FuzzCase& c = s.start("conv2d", dt);
  int64_t g = 1, Cg, O;
  const int64_t kind = s.uni(0, 9);
  if (kind <= 4) {  // groups 1
    Cg = s.uni(1, 5);
    O = s.uni(1, 6);
  } else if (kind <= 6) {  // grouped
    g = s.uni(2, 3);
    Cg = s.uni(1, 3);
    O = g * s.uni(1, 3);
  } else {  // depthwise, channel multiplier 1..3
    g = s.uni(1, 6);
    Cg = 1;
    O = g * s.uni(1, 3);
  }
  std::array<int64_t, 2> k{s.uni(1, 4), s.uni(1, 4)}, stride{s.uni(1, 3), s.uni(1, 3)}, dil{1, 1}, pad{0, 0};
  if (s.coin(0.15)) k = {1, 1};
  if (s.coin(0.3)) dil = {s.uni(1, 3), s.uni(1, 3)};
  if (s.coin(0.6)) pad = {s.uni(0, k[0] + 1), s.uni(0, k[1] + 1)};  // also beyond half the kernel
  if (dt == kBFloat16 && s.coin(0.5)) {  // the im2col weight-gradient path (groups 1, C*KH*KW >= 64)
    g = 1, Cg = s.uni(8, 12), O = s.uni(2, 8), k = {3, 3};
  }
  const int64_t C = g * Cg;
  std::array<int64_t, 2> span{}, size{};
  const bool kernel_is_input = s.coin(0.1);
  for (int i = 0; i < 2; ++i) {
    span[i] = dil[i] * (k[i] - 1) + 1;
    if (kernel_is_input) pad[i] = 0;
    const int64_t lo = std::max<int64_t>(1, span[i] - 2 * pad[i]);
    size[i] = kernel_is_input ? span[i] : s.uni(lo, lo + 8);
  }
  const int64_t N = empty ? 0 : s.uni(1, 3);
  const bool bias = s.coin(0.5);
  const std::string xv = activation_view(s), wv = s.coin(0.2) ? "t" : "";
  s.input(c, {N, C, size[0], size[1]}, xv);
  s.input(c, {O, Cg, k[0], k[1]}, wv);
  if (bias) s.input(c, {O}, "");
  set_conv(c, stride, pad, dil, g);
  int64_t OH = 1, OW = 1;
  OH = (size[0] + 2 * pad[0] - span[0]) / stride[0] + 1;
  OW = (size[1] + 2 * pad[1] - span[1]) / stride[1] + 1;
  // Forward: C/g*KH*KW products (+ bias); input gradient: O/g*KH*KW; weight/bias gradient: N*OH*OW.
  c.acc = static_cast<double>(std::max({Cg * k[0] * k[1] + 1, (O / g) * k[0] * k[1], N * OH * OW}));
  c.scale = kWeightBound;
}

// Wider convolutions (f32, bf16): channel counts where oneDNN picks its blocked AVX-512/AMX
// kernels and reorders the weights, rather than the small-shape fallbacks the cases above reach.
void add_wide_conv(Sweep& s, DType dt) {
  FuzzCase& c = s.start("conv2d_wide", dt);
  const int64_t C = s.pick<int64_t>({16, 32, 48}), kind = s.uni(0, 2);
  const int64_t g = kind == 0 ? 1 : kind == 1 ? 2 : C;
  const int64_t O = kind == 2 ? C * s.uni(1, 2) : s.pick<int64_t>({16, 32, 64});
  const int64_t kk = s.pick<int64_t>({1, 3, 3, 5});
  const std::array<int64_t, 2> k{kk, kk}, stride{s.uni(1, 2), s.uni(1, 2)}, pad{s.uni(0, kk / 2 + 1), s.uni(0, kk / 2 + 1)},
      dil{1, 1};
  const std::array<int64_t, 2> size{s.uni(kk, 16), s.uni(kk, 16)};
  const int64_t N = s.uni(1, 2);
  const bool bias = s.coin(0.5);
  s.input(c, {N, C, size[0], size[1]}, s.pick<std::string>({"", "cl", "cl", "t"}));
  s.input(c, {O, C / g, k[0], k[1]}, "");
  if (bias) s.input(c, {O}, "");
  set_conv(c, stride, pad, dil, g);
  const int64_t OH = (size[0] + 2 * pad[0] - kk) / stride[0] + 1, OW = (size[1] + 2 * pad[1] - kk) / stride[1] + 1;
  c.acc = static_cast<double>(std::max({C / g * kk * kk + 1, O / g * kk * kk, N * OH * OW}));
  c.scale = kWeightBound;
}

// ----------------------------------------------------------------------------------- pools

// Whether every output window of a dilated max pool has a tap inside the input (PyTorch gives
// -inf and an index outside the window otherwise; MaxPoolAllPaddingWindow covers that case).
bool every_window_sees_input(int64_t in, int64_t out, int64_t k, int64_t s, int64_t pad, int64_t dil) {
  for (int64_t o = 0; o < out; ++o) {
    bool any = false;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = o * s - pad + j * dil;
      any |= i >= 0 && i < in;
    }
    if (!any) return false;
  }
  return true;
}

int64_t pooled(int64_t in, int64_t k, int64_t s, int64_t pad, int64_t dil, bool ceil_mode) {
  const int64_t num = in + 2 * pad - (dil * (k - 1) + 1);
  if (num < 0) return 0;
  int64_t out = (ceil_mode ? (num + s - 1) / s : num / s) + 1;
  if (ceil_mode && (out - 1) * s >= in + pad) --out;
  return out;
}

void add_pool(Sweep& s, DType dt, bool max, bool empty) {
  FuzzCase& c = s.start(max ? "max_pool2d" : "avg_pool2d", dt);
  ops::Pool2dOptions o;
  std::array<int64_t, 2> size{};
  for (int attempt = 0;; ++attempt) {
    o.kernel_size = {s.uni(1, 4), s.uni(1, 4)};
    o.stride = s.coin(0.3) ? std::array<int64_t, 2>{0, 0} : std::array<int64_t, 2>{s.uni(1, 3), s.uni(1, 3)};
    o.padding = {s.uni(0, o.kernel_size[0] / 2), s.uni(0, o.kernel_size[1] / 2)};
    o.dilation = max && s.coin(0.3) ? std::array<int64_t, 2>{s.uni(1, 2), s.uni(1, 2)} : std::array<int64_t, 2>{1, 1};
    o.ceil_mode = s.coin(0.4);
    o.count_include_pad = s.coin(0.5);
    bool ok = true;
    for (int i = 0; i < 2; ++i) {
      const int64_t span = o.dilation[i] * (o.kernel_size[i] - 1) + 1;
      const int64_t lo = std::max<int64_t>(1, span - 2 * o.padding[i]);
      size[i] = s.uni(lo, lo + 9);
      const int64_t st = o.stride[i] ? o.stride[i] : o.kernel_size[i];
      const int64_t out = pooled(size[i], o.kernel_size[i], st, o.padding[i], o.dilation[i], o.ceil_mode);
      ok &= out >= 1 && every_window_sees_input(size[i], out, o.kernel_size[i], st, o.padding[i], o.dilation[i]);
    }
    if (ok) break;
    ASSERT_LT(attempt, 100) << "no valid pool configuration drawn";
  }
  const int64_t N = empty ? 0 : s.uni(1, 3);
  s.input(c, {N, s.uni(1, 4), size[0], size[1]}, activation_view(s));
  const std::string stride = o.stride[0] ? json_pair(o.stride) : "null";
  if (max) {
    c.spec = fmt::format(
        "\"op\": \"max_pool2d\", \"kernel_size\": {}, \"stride\": {}, \"padding\": {}, \"dilation\": {}, \"ceil_mode\": {}",
        json_pair(o.kernel_size), stride, json_pair(o.padding), json_pair(o.dilation), o.ceil_mode);
    c.fn = [o](const std::vector<Tensor>& v) { return std::vector<Tensor>{ops::max_pool2d(v[0], o)}; };
  } else {
    c.spec = fmt::format(
        "\"op\": \"avg_pool2d\", \"kernel_size\": {}, \"stride\": {}, \"padding\": {}, \"ceil_mode\": {}, "
        "\"count_include_pad\": {}",
        json_pair(o.kernel_size), stride, json_pair(o.padding), o.ceil_mode, o.count_include_pad);
    c.fn = [o](const std::vector<Tensor>& v) { return std::vector<Tensor>{ops::avg_pool2d(v[0], o)}; };
  }
  // A gradient element sums at most KH*KW window contributions.
  c.acc = static_cast<double>(o.kernel_size[0] * o.kernel_size[1]);
  c.scale = kWeightBound;
}

void add_adaptive(Sweep& s, DType dt, bool empty) {
  FuzzCase& c = s.start("adaptive_avg_pool2d", dt);
  const int64_t H = s.uni(1, 12), W = s.uni(1, 12);
  // Sizes that do not divide the input, larger than it (bins overlap), and the global 1x1 path.
  std::array<int64_t, 2> out = s.coin(0.25) ? std::array<int64_t, 2>{1, 1} : std::array<int64_t, 2>{s.uni(1, H + 3), s.uni(1, W + 3)};
  const int64_t N = empty ? 0 : s.uni(1, 3);
  s.input(c, {N, s.uni(1, 5), H, W}, activation_view(s));
  c.spec = fmt::format("\"op\": \"adaptive_avg_pool2d\", \"output_size\": {}", json_pair(out));
  c.fn = [out](const std::vector<Tensor>& v) { return std::vector<Tensor>{ops::adaptive_avg_pool2d(v[0], out)}; };
  c.acc = static_cast<double>((H / out[0] + 2) * (W / out[1] + 2));
  c.scale = kWeightBound;
}

// ----------------------------------------------------------------------------------- norms

// The tolerance bound n*s (see the header) of a normalisation, from the case's own data: groups of
// elements share a mean and 1/std (a batch_norm channel over (N, *), or a row of `row` elements
// for layer/group norm). An error of n u |x| in a group's mean moves its outputs by n u |x| / std
// |w| and its input gradient by n u 5 |w| / std (1 + xhat^2); the weight and bias gradients sum
// `param_len` terms of size 5 (1 + |xhat|). Returns the largest of these over the groups.
double norm_bound(const Tensor& x_logical, int64_t channels, bool per_channel, int64_t row, double eps, double wmax,
                  int64_t param_len) {
  const Tensor x = x_logical.detach().to(kFloat64).contiguous();
  const std::vector<double> v = x.to_vector();
  const double W = std::max(1.0, wmax);
  double bound = kWeightBound * static_cast<double>(std::max<int64_t>(param_len, 1));
  auto account = [&](const std::vector<double>& vals) {
    if (vals.empty()) return;
    const double n = static_cast<double>(vals.size());
    double m = 0, xmax = 0;
    for (double a : vals) m += a, xmax = std::max(xmax, std::abs(a));
    m /= n;
    double var = 0, dev = 0;
    for (double a : vals) var += (a - m) * (a - m), dev = std::max(dev, std::abs(a - m));
    const double rstd = 1 / std::sqrt(var / n + eps), xh = dev * rstd;
    bound = std::max(bound, n * W * rstd * (xmax + kWeightBound * (1 + xh * xh)));
    bound = std::max(bound, static_cast<double>(param_len) * kWeightBound * (1 + xh));
  };
  if (per_channel) {  // batch_norm: channel c of (N, C, S)
    const int64_t N = x.size(0), C = channels, S = x.numel() / std::max<int64_t>(N * C, 1);
    for (int64_t ch = 0; ch < C; ++ch) {
      std::vector<double> vals;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t i = 0; i < S; ++i) vals.push_back(v[static_cast<size_t>((n * C + ch) * S + i)]);
      account(vals);
    }
  } else {
    for (size_t r = 0; r + static_cast<size_t>(row) <= v.size(); r += static_cast<size_t>(row))
      account(std::vector<double>(v.begin() + static_cast<std::ptrdiff_t>(r), v.begin() + static_cast<std::ptrdiff_t>(r + row)));
  }
  return bound;
}

void add_batch_norm(Sweep& s, DType dt, bool empty) {
  FuzzCase& c = s.start("batch_norm", dt);
  const int64_t rank = s.pick<int64_t>({2, 3, 4, 4, 5});
  // Mostly few channels; sometimes enough for the vectorised channel kernels (16 lanes) and their
  // remainders, which a channels-last activation runs over rows of C.
  const int64_t C = s.coin(0.3) ? s.pick<int64_t>({16, 17, 31, 33, 48}) : s.uni(1, 5);
  Shape shape{s.uni(1, 4), C};
  if (rank >= 3) shape.push_back(s.uni(1, 6));
  if (rank == 4) shape.push_back(s.coin(0.2) ? s.uni(20, 30) : s.uni(1, 6));  // long channels: more than one 256 block
  if (rank == 5) {  // (N, C, D, H, W): BatchNorm3d
    shape.push_back(s.uni(1, 4));
    shape.push_back(s.uni(1, 5));
  }
  if (shape_numel(shape) / C == 1) shape[0] = 2;  // training needs more than one value per channel
  if (empty) shape[0] = 0;  // an empty batch: PyTorch leaves the running stats alone
  const bool training = s.coin(0.65), running = !training || s.coin(0.7);
  const bool weight = s.coin(0.7), bias = s.coin(0.7), relu = s.coin(0.25);
  const double momentum = s.pick<double>({0.1, 0.1, 0.3, 1.0, 0.01}), eps = s.pick<double>({1e-5, 1e-5, 1e-3, 0.1});
  const double lo = s.pick<double>({-1.0, -1.0, 2.0, -5.0});
  const std::string xv = rank == 4 ? activation_view(s) : (rank == 3 && s.coin(0.3) ? "t" : "");
  s.input(c, shape, xv, lo, lo + 2);
  const DType stat_dt = dt == kFloat64 ? kFloat64 : kFloat32;  // module buffers are f32
  if (running) {
    Tensor rm = testing::leaf({C}, -1, 1, 900 + s.size(), stat_dt).detach();
    Tensor rv = testing::leaf({C}, 0.2, 2, 950 + s.size(), stat_dt).detach();
    s.constant(c, rm);
    s.constant(c, rv);
  }
  const DType param_dt = dt == kFloat64 ? kFloat64 : kFloat32;
  double wmax = 1;
  if (weight) {
    c.inputs.push_back(testing::leaf({C}, 0.5, 2, 1000 + s.size(), param_dt));
    c.views.emplace_back();
    wmax = 2;
  }
  if (bias) {
    c.inputs.push_back(testing::leaf({C}, -1, 1, 1100 + s.size(), param_dt));
    c.views.emplace_back();
  }
  c.spec = fmt::format(
      "\"op\": \"batch_norm\", \"training\": {}, \"running\": {}, \"weight\": {}, \"bias\": {}, \"relu\": {}, "
      "\"momentum\": {}, \"eps\": {}",
      training, running, weight, bias, relu, momentum, eps);
  c.out_dts = {dt, stat_dt, stat_dt};
  c.fn = [=](const std::vector<Tensor>& v) {
    size_t i = 1;
    const Tensor rm = running ? v[i++] : Tensor(), rv = running ? v[i++] : Tensor();
    const Tensor w = weight ? v[i++] : Tensor(), b = bias ? v[i++] : Tensor();
    const Tensor y = (relu ? ops::batch_norm_relu : ops::batch_norm)(v[0], rm, rv, w, b, training, momentum, eps);
    return running ? std::vector<Tensor>{y, rm, rv} : std::vector<Tensor>{y};
  };
  const int64_t n = shape_numel(shape) / C;
  if (training) {
    c.scale = norm_bound(apply_view(c.inputs[0], xv), C, true, 0, eps, wmax, n);
  } else {
    // Eval is elementwise with running stats (var >= 0.2): y = x * k + shift, |x| <= |lo| + 2,
    // |k| <= |w| / sqrt(0.2), |shift| <= 1 + |k|; weight/bias gradients sum n terms 5 |xhat|.
    const double k = wmax / std::sqrt(0.2), xmax = std::abs(lo) + 2;
    c.scale = std::max(4 * (xmax * k + 1 + k), static_cast<double>(n) * kWeightBound * (xmax + 1) / std::sqrt(0.2));
  }
}

// nn::BatchNorm2d as a user runs it: two training steps, then eval, with the module's options
// (momentum incl. None = cumulative average, affine off, track_running_stats off, where eval
// normalises with the batch's own statistics). Outputs: the three results and the buffers.
void add_batch_norm_module(Sweep& s, DType dt) {
  FuzzCase& c = s.start("bn_module", dt);
  const int64_t C = s.uni(1, 6);
  nn::BatchNormOptions o;
  o.momentum = s.coin(0.3) ? std::nullopt : std::optional<double>(s.pick<double>({0.1, 0.5}));
  o.eps = s.pick<double>({1e-5, 1e-2});
  o.affine = s.coin(0.6);
  o.track_running_stats = s.coin(0.7);
  const Shape shape{s.uni(2, 3), C, s.uni(1, 4), s.uni(2, 5)};
  const std::string xv = activation_view(s);
  for (int i = 0; i < 3; ++i) s.input(c, shape, xv, -1.0 + i, 1.0 + 2 * i);
  const DType param_dt = dt == kFloat64 ? kFloat64 : kFloat32;
  if (o.affine) {
    c.inputs.push_back(testing::leaf({C}, 0.5, 2, 1600 + s.size(), param_dt));
    c.inputs.push_back(testing::leaf({C}, -1, 1, 1700 + s.size(), param_dt));
    c.views.emplace_back(), c.views.emplace_back();
  }
  c.spec = fmt::format("\"op\": \"bn_module\", \"momentum\": {}, \"eps\": {}, \"affine\": {}, \"track_running_stats\": {}",
                       o.momentum ? fmt::format("{}", *o.momentum) : "null", o.eps, o.affine, o.track_running_stats);
  c.fn = [o, C, param_dt](const std::vector<Tensor>& v) {
    nn::BatchNorm2d bn(C, o);
    if (param_dt == kFloat64) bn.to(kFloat64);
    if (o.affine) bn.weight = v[3], bn.bias = v[4];  // the case's leaves, so their gradients reach the oracle
    std::vector<Tensor> out{bn.forward(v[0]), bn.forward(v[1])};
    bn.eval();
    out.push_back(bn.forward(v[2]));
    if (o.track_running_stats) {
      out.push_back(bn.running_mean);
      out.push_back(bn.running_var);
      out.push_back(bn.num_batches_tracked);
    }
    return out;
  };
  const DType stat_dt = dt == kFloat64 ? kFloat64 : kFloat32;
  c.out_dts = {dt, dt, dt, stat_dt, stat_dt, kInt64};
  // The eval step normalises with the running stats (or the batch's own without them), within
  // the training steps' bound since every batch is drawn alike.
  for (int i = 0; i < 3; ++i)
    c.scale = std::max(c.scale, norm_bound(apply_view(c.inputs[i], xv), C, true, 0, o.eps, 2, shape_numel(shape) / C));
}

void add_group_norm(Sweep& s, DType dt, bool empty) {
  FuzzCase& c = s.start("group_norm", dt);
  const int64_t G = s.uni(1, 3), Cg = s.uni(1, 3), C = G * Cg;
  const int64_t num_groups = s.coin(0.2) ? 1 : s.coin(0.25) ? C : G;  // groups 1 and C, and between
  Shape shape{empty ? 0 : s.uni(1, 3), C};
  const int64_t extra = s.uni(0, 2);
  for (int64_t i = 0; i < extra; ++i) shape.push_back(s.uni(1, 5));
  if (s.coin(0.2)) {  // rows past one 256-element block
    const int64_t side = s.pick<int64_t>({9, 17});
    shape.resize(2), shape.push_back(side), shape.push_back(side);
  }
  if (shape_numel(shape) > 0 && shape_numel(shape) / shape[0] / num_groups == 1) shape.push_back(2);
  const bool weight = s.coin(0.6), bias = s.coin(0.6);
  const double eps = s.pick<double>({1e-5, 1e-3, 0.1});
  const double lo = s.pick<double>({-1.0, 2.0});
  const std::string xv = shape.size() == 4 ? activation_view(s) : "";
  s.input(c, shape, xv, lo, lo + 2);
  const DType param_dt = dt == kFloat64 ? kFloat64 : kFloat32;
  if (weight) {
    c.inputs.push_back(testing::leaf({C}, 0.5, 2, 1200 + s.size(), param_dt));
    c.views.emplace_back();
  }
  if (bias) {
    c.inputs.push_back(testing::leaf({C}, -1, 1, 1300 + s.size(), param_dt));
    c.views.emplace_back();
  }
  c.spec = fmt::format("\"op\": \"group_norm\", \"num_groups\": {}, \"weight\": {}, \"bias\": {}, \"eps\": {}", num_groups,
                       weight, bias, eps);
  c.fn = [=](const std::vector<Tensor>& v) {
    size_t i = 1;
    const Tensor w = weight ? v[i++] : Tensor(), b = bias ? v[i++] : Tensor();
    return std::vector<Tensor>{ops::group_norm(v[0], num_groups, w, b, eps)};
  };
  const int64_t row = shape[0] == 0 ? 1 : shape_numel(shape) / shape[0] / num_groups;
  const int64_t per_channel = shape[0] == 0 ? 0 : shape_numel(shape) / C;  // a weight gradient sums N*S terms
  c.scale = norm_bound(apply_view(c.inputs[0], xv), C, false, row, eps, 2, per_channel);
}

void add_layer_norm(Sweep& s, DType dt, bool empty) {
  FuzzCase& c = s.start("layer_norm", dt);
  const int64_t rank = s.uni(1, 4);
  Shape shape;
  for (int64_t i = 0; i < rank; ++i) shape.push_back(s.uni(1, 6));
  if (s.coin(0.25)) shape.back() = s.pick<int64_t>({16, 17, 33, 65, 257});  // vector lanes, remainders, past a 256 block
  const int64_t k = s.uni(1, std::min<int64_t>(3, rank));
  const Shape norm(shape.end() - k, shape.end());
  if (shape_numel(norm) == 1) shape.back() = 3;
  if (empty && rank > k) shape[0] = 0;  // no rows
  const Shape nshape(shape.end() - k, shape.end());
  const bool weight = s.coin(0.6), bias = s.coin(0.6);  // elementwise_affine off, and weight or bias alone
  const double eps = s.pick<double>({1e-5, 1e-3, 0.1});
  const double lo = s.pick<double>({-1.0, 2.0});
  const std::string xv = rank >= 2 && s.coin(0.3) ? "t" : (rank >= 2 && s.coin(0.2) ? "s" : "");
  s.input(c, shape, xv, lo, lo + 2);
  const DType param_dt = dt == kFloat64 ? kFloat64 : kFloat32;
  if (weight) {
    c.inputs.push_back(testing::leaf(nshape, 0.5, 2, 1400 + s.size(), param_dt));
    c.views.emplace_back();
  }
  if (bias) {
    c.inputs.push_back(testing::leaf(nshape, -1, 1, 1500 + s.size(), param_dt));
    c.views.emplace_back();
  }
  c.spec = fmt::format("\"op\": \"layer_norm\", \"normalized_shape\": {}, \"weight\": {}, \"bias\": {}, \"eps\": {}",
                       json_shape(nshape), weight, bias, eps);
  c.fn = [=](const std::vector<Tensor>& v) {
    size_t i = 1;
    const Tensor w = weight ? v[i++] : Tensor(), b = bias ? v[i++] : Tensor();
    return std::vector<Tensor>{ops::layer_norm(v[0], nshape, w, b, eps)};
  };
  const int64_t D = shape_numel(nshape), rows = shape_numel(shape) / D;
  c.scale = norm_bound(apply_view(c.inputs[0], xv), 0, false, D, eps, 2, rows);
}

// ------------------------------------------------------------------------ selection ops

// A shape that broadcasts to `full`: some dims set to 1, some leading dims dropped.
Shape broadcastable(Sweep& s, const Shape& full) {
  Shape out = full;
  for (auto& d : out)
    if (s.coin(0.35)) d = 1;
  const int64_t drop = s.uni(0, static_cast<int64_t>(out.size()));
  out.erase(out.begin(), out.begin() + (s.coin(0.5) ? drop : 0));
  return out;
}

Tensor random_mask(const Shape& shape, uint64_t seed) {
  return ops::gt(testing::leaf(shape, -1, 1, seed, kFloat64).detach(), 0.0);
}

void add_selection(Sweep& s, DType dt) {
  const int64_t which = s.uni(0, 3);
  Shape full;
  const int64_t rank = s.uni(1, 4);
  for (int64_t i = 0; i < rank; ++i) full.push_back(s.uni(1, 5));
  if (which == 0) {
    FuzzCase& c = s.start("where", dt);
    const Shape cs = broadcastable(s, full), as = broadcastable(s, full), bs = broadcastable(s, full);
    // Some dim at full size in at least one operand, so the broadcast shape is `full`.
    s.constant(c, random_mask(cs, 2000 + s.size()));
    s.input(c, as, as.size() >= 2 && s.coin(0.3) ? "t" : "");
    s.input(c, bs, "");
    c.spec = "\"op\": \"where\"";
    c.fn = [](const std::vector<Tensor>& v) { return std::vector<Tensor>{ops::where(v[0], v[1], v[2])}; };
    c.acc = static_cast<double>(shape_numel(full));
  } else if (which == 1) {
    FuzzCase& c = s.start("masked_fill", dt);
    // Mostly a mask that broadcasts to x; sometimes x that broadcasts to the mask (PyTorch's
    // out-of-place masked_fill returns the broadcast shape).
    const bool x_broadcasts = s.coin(0.25);
    const Shape xs = x_broadcasts ? broadcastable(s, full) : full;
    const std::string xv = xs.size() >= 2 && s.coin(0.3) ? "t" : "";
    s.input(c, xs, xv);
    s.constant(c, random_mask(x_broadcasts ? full : broadcastable(s, full), 2100 + s.size()));
    c.acc = static_cast<double>(shape_numel(full));
    const double value = s.pick<double>({0.0, -1.5, 3.25, -INFINITY});
    c.spec = fmt::format("\"op\": \"masked_fill\", \"value\": {}", std::isinf(value) ? "\"-inf\"" : fmt::format("{}", value));
    c.fn = [value](const std::vector<Tensor>& v) { return std::vector<Tensor>{ops::masked_fill(v[0], v[1], value)}; };
  } else {
    const bool lower = which == 2;
    FuzzCase& c = s.start(lower ? "tril" : "triu", dt);
    if (full.size() < 2) full.push_back(s.uni(1, 6));
    const int64_t diagonal = s.uni(-3, 3);
    s.input(c, full, s.coin(0.3) ? "t" : "");
    c.spec = fmt::format("\"op\": \"{}\", \"diagonal\": {}", lower ? "tril" : "triu", diagonal);
    c.fn = [lower, diagonal](const std::vector<Tensor>& v) {
      return std::vector<Tensor>{lower ? ops::tril(v[0], diagonal) : ops::triu(v[0], diagonal)};
    };
  }
  s.cases().back().scale = kWeightBound;
}

// ------------------------------------------------------------------------------- the sweep

TEST(OpsFuzzOracle, ConvPoolNormSelection) {
  TANDEM_REQUIRE_TORCH();
  Sweep s(20261203);
  const DType dts[] = {kFloat64, kFloat64, kFloat64, kFloat32, kBFloat16};  // mostly f64: tight tolerances
  // i = 7 and 8 (an f64 and an f32 case): an empty batch, which PyTorch accepts.
  for (int i = 0; i < 80; ++i) add_conv(s, dts[i % 5], i == 7 || i == 8);
  for (int i = 0; i < 12; ++i) add_wide_conv(s, i % 2 ? kBFloat16 : kFloat32);
  for (int i = 0; i < 40; ++i) add_pool(s, dts[i % 5], true, i == 7 || i == 8);
  for (int i = 0; i < 40; ++i) add_pool(s, dts[i % 5], false, i == 7 || i == 8);
  for (int i = 0; i < 25; ++i) add_adaptive(s, dts[i % 5], i == 7 || i == 8);
  for (int i = 0; i < 50; ++i) add_batch_norm(s, dts[i % 5], i == 7 || i == 8);
  for (int i = 0; i < 15; ++i) add_batch_norm_module(s, dts[i % 5]);
  for (int i = 0; i < 25; ++i) add_group_norm(s, dts[i % 5], i == 7 || i == 8);
  for (int i = 0; i < 30; ++i) add_layer_norm(s, dts[i % 5], i == 7 || i == 8);
  for (int i = 0; i < 40; ++i) add_selection(s, dts[i % 5]);
  const size_t compared = s.run();
  EXPECT_GT(compared, 2 * s.size());  // every case has an output and at least one gradient
}

// ------------------------------------------------------- regressions found by the sweep
// Each failed before its fix (the commit that added it says how).

// A dilated max-pool window whose taps all fall in the padding (k 2, padding 1, dilation 2 over a
// height of 1: rows -1 and 1). PyTorch outputs -inf there (and returns an index outside the
// window, whose gradient lands in another plane); Tandem outputs -inf and the window has no
// gradient. Before the fix its argmax was -1 and backward wrote the gradient to element -1 of the
// plane: the last element of the previous plane, and before the buffer for the first plane.
TEST(OpsFuzzRegression, MaxPoolWindowAllInPadding) {
  const Tensor x = testing::leaf({1, 2, 1, 4}, -1, 1, 7, kFloat64);
  const Tensor y = ops::max_pool2d(x, {.kernel_size = {2, 2}, .padding = {1, 1}, .dilation = {2, 2}});
  ASSERT_EQ(y.shape(), (Shape{1, 2, 1, 2}));
  for (double v : y.to_vector()) EXPECT_EQ(v, -INFINITY);
  const Tensor gx = autograd::grad({ops::sum(y)}, {x})[0];
  for (double v : gx.to_vector()) EXPECT_EQ(v, 0.0);
}

// batch_norm on an empty batch (N = 0), training with running stats: PyTorch returns an empty
// output, leaves the running stats as they were and gives zero weight/bias gradients (its
// "more than 1 value per channel" check is for exactly one). Tandem threw that error; the sweep
// also compares N = 0 cases with the oracle.
TEST(OpsFuzzRegression, BatchNormEmptyBatch) {
  const Tensor x = testing::leaf({0, 3, 4, 4}, -1, 1, 8, kFloat32);
  const Tensor w = testing::leaf({3}, 0.5, 2, 9, kFloat32), b = testing::leaf({3}, -1, 1, 10, kFloat32);
  Tensor rm = full({3}, 0.25), rv = full({3}, 2.0);
  const Tensor y = ops::batch_norm(x, rm, rv, w, b, true);
  EXPECT_EQ(y.shape(), x.shape());
  EXPECT_EQ(rm.to_vector(), std::vector<double>(3, 0.25));
  EXPECT_EQ(rv.to_vector(), std::vector<double>(3, 2.0));
  const auto g = autograd::grad({ops::sum(y)}, {x, w, b});
  EXPECT_EQ(g[0].shape(), x.shape());
  EXPECT_EQ(g[1].to_vector(), std::vector<double>(3, 0.0));
  EXPECT_EQ(g[2].to_vector(), std::vector<double>(3, 0.0));
  // The module counts the batch (PyTorch increments num_batches_tracked before the call).
  nn::BatchNorm2d bn(3);
  bn.forward(x);
  EXPECT_EQ(bn.num_batches_tracked.to_vector(), std::vector<double>{1.0});
  EXPECT_EQ(bn.running_mean.to_vector(), std::vector<double>(3, 0.0));
  EXPECT_EQ(bn.running_var.to_vector(), std::vector<double>(3, 1.0));
  EXPECT_THROW(ops::batch_norm(testing::leaf({1, 3}, -1, 1, 11, kFloat32), Tensor(), Tensor(), Tensor(), Tensor(), true),
               ValueError);
}

// masked_fill with a mask of more dims than x: PyTorch broadcasts x to the mask's shape
// (torch.zeros(3).masked_fill(mask (2, 3), v) is (2, 3)); Tandem threw a ShapeError.
TEST(OpsFuzzRegression, MaskedFillBroadcastsInputToMask) {
  const Tensor x = testing::leaf({3}, -1, 1, 12, kFloat64);
  const Tensor mask = tensor(std::vector<double>{1, 0, 0, 1, 1, 0}, {2, 3}, kFloat64);
  const Tensor y = ops::masked_fill(x, ops::gt(mask, 0.5), -2.0);
  ASSERT_EQ(y.shape(), (Shape{2, 3}));
  const std::vector<double> xv = x.to_vector(), yv = y.to_vector();
  EXPECT_EQ(yv, (std::vector<double>{-2.0, xv[1], xv[2], -2.0, -2.0, xv[2]}));
  // Each x element gets one gradient per unmasked row.
  EXPECT_EQ(autograd::grad({ops::sum(y)}, {x})[0].to_vector(), (std::vector<double>{0, 1, 2}));
}

// bf16 pool gradients where windows overlap (stride < kernel, adaptive bins sharing rows): the
// contributions to an input element are summed in f32 and rounded once, so the result is within
// one bf16 rounding (2^-9, 2^-8 allowed) of the f64 gradient of the same values. Before, each
// contribution was added into the bf16 gradient and rounded: errors of several bf16 ulps (5% on
// an adaptive pool's element that cancels to 1e-3).
TEST(OpsFuzzRegression, Bf16PoolGradientsRoundOnce) {
  const Tensor x = testing::leaf({2, 3, 12, 11}, -1, 1, 23, kBFloat16);
  const Tensor x64 = x.detach().to(kFloat64).requires_grad_(true);
  const std::vector<std::function<Tensor(const Tensor&)>> pools = {
      [](const Tensor& t) { return ops::avg_pool2d(t, {.kernel_size = {3, 3}, .stride = {1, 1}}); },
      [](const Tensor& t) { return ops::max_pool2d(t, {.kernel_size = {3, 2}, .stride = {1, 1}}); },
      [](const Tensor& t) { return ops::adaptive_avg_pool2d(t, {5, 4}); },
  };
  Generator gen(24);
  for (size_t i = 0; i < pools.size(); ++i) {
    SCOPED_TRACE(i);
    const Tensor y = pools[i](x);
    const Tensor w = randn(y.shape(), kBFloat16, &gen);
    const Tensor g = autograd::grad({ops::sum(ops::mul(y, w))}, {x})[0];
    const Tensor g64 = autograd::grad({ops::sum(ops::mul(pools[i](x64), w.to(kFloat64)))}, {x64})[0];
    ASSERT_EQ(g.dtype(), kBFloat16);
    // atol: 4 u32 n s for at most 9 f32 additions of terms below 5.
    EXPECT_TRUE(testing::all_close(g.to(kFloat64), g64, 0x1p-8, 4 * 0x1p-24 * 9 * 5));
  }
}

// Invalid arguments: a tandem error whose message names the offending value, never a crash or a
// message from inside oneDNN.
template <class E>
void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning " << fmt::format("{}", fmt::join(parts, " / "));
  } catch (const E& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong error type: " << e.what();
  }
}

TEST(OpsFuzzRegression, InvalidArgumentsNameTheValue) {
  const Tensor x = testing::leaf({2, 4, 5, 6}, -1, 1, 13, kFloat32);
  const Tensor w = testing::leaf({6, 4, 3, 3}, -1, 1, 14, kFloat32);
  // conv2d
  expect_error<ValueError>([&] { ops::conv2d(x, w, Tensor(), {.padding = {-1, 0}}); }, {"padding (-1, 0)"});
  expect_error<ValueError>([&] { ops::conv2d(x, w, Tensor(), {.stride = {0, 1}}); }, {"stride (0, 1)"});
  expect_error<ValueError>([&] { ops::conv2d(x, w, Tensor(), {.dilation = {1, -2}}); }, {"dilation (1, -2)"});
  expect_error<ValueError>([&] { ops::conv2d(x, testing::leaf({6, 2, 3, 3}, -1, 1, 15, kFloat32), Tensor(), {.groups = 3}); },
                           {"groups=3", "4"});
  expect_error<ValueError>([&] { ops::conv2d(x, w, Tensor(), {.groups = 0}); }, {"groups=0"});
  expect_error<ShapeError>([&] { ops::conv2d(x, testing::leaf({6, 4, 7, 3}, -1, 1, 16, kFloat32)); },
                           {"larger than the padded input", "7x3"});
  expect_error<ShapeError>([&] { ops::conv2d(x, testing::leaf({6, 2, 3, 3}, -1, 1, 17, kFloat32)); },
                           {"expects 2 input channels", "has 4"});
  expect_error<ShapeError>([&] { ops::conv2d(x, w, testing::leaf({5}, -1, 1, 18, kFloat32)); }, {"bias of shape [5]"});
  // Zero channels reached oneDNN ("could not create a descriptor ...") before.
  expect_error<ShapeError>([&] { ops::conv2d(testing::leaf({1, 0, 5, 5}, -1, 1, 19, kFloat32), testing::leaf({2, 0, 3, 3}, -1, 1, 20, kFloat32)); },
                           {"[2, 0, 3, 3]", "must be >= 1"});
  expect_error<ShapeError>([&] { ops::conv2d(x, testing::leaf({0, 4, 3, 3}, -1, 1, 21, kFloat32)); }, {"[0, 4, 3, 3]"});
  // pools: each check names its own value (dilation and negative padding were reported as
  // "kernel_size, stride and dilation must be >= 1 (got kernel (2, 2), stride (0, 0))" and
  // "padding (-1, 0) must be at most half the kernel size").
  expect_error<ValueError>([&] { ops::max_pool2d(x, {.kernel_size = {2, 2}, .dilation = {0, 1}}); }, {"dilation (0, 1)"});
  expect_error<ValueError>([&] { ops::max_pool2d(x, {.kernel_size = {2, 2}, .padding = {-1, 0}}); }, {"padding (-1, 0) must be >= 0"});
  expect_error<ValueError>([&] { ops::avg_pool2d(x, {.kernel_size = {2, 0}}); }, {"kernel_size (2, 0)"});
  expect_error<ValueError>([&] { ops::avg_pool2d(x, {.kernel_size = {2, 2}, .stride = {-1, 1}}); }, {"stride (-1, 1)"});
  expect_error<ValueError>([&] { ops::max_pool2d(x, {.kernel_size = {3, 3}, .padding = {2, 0}}); }, {"padding (2, 0)", "half"});
  expect_error<ShapeError>([&] { ops::max_pool2d(x, {.kernel_size = {7, 2}}); }, {"too small", "(7, 2)"});
  expect_error<ValueError>([&] { ops::adaptive_avg_pool2d(x, {0, 2}); }, {"(0, 2)"});
  // An empty plane averaged into bins: 0/0 = NaN before (PyTorch rejects it; its 1x1 mean gives
  // NaN, and so does Tandem's).
  expect_error<ShapeError>([&] { ops::adaptive_avg_pool2d(testing::leaf({2, 3, 0, 4}, -1, 1, 25, kFloat32), {2, 2}); },
                           {"[2, 3, 0, 4]", "empty"});
  // norms
  expect_error<ValueError>([&] { ops::batch_norm(testing::leaf({1, 4}, -1, 1, 22, kFloat32), Tensor(), Tensor(), Tensor(), Tensor(), true); },
                           {"more than 1 value", "[1, 4]"});
  expect_error<ShapeError>([&] { ops::batch_norm(x, Tensor(), Tensor(), ones({3}), Tensor(), true); }, {"weight has 3 elements"});
  expect_error<ValueError>([&] { ops::group_norm(x, 3); }, {"num_groups=3", "4"});
  expect_error<ShapeError>([&] { ops::layer_norm(x, {5}); }, {"[5]", "[2, 4, 5, 6]"});
  expect_error<ShapeError>([&] { ops::layer_norm(x, {6}, ones({5})); }, {"weight of shape [5]"});
  // selection ops
  expect_error<ShapeError>([&] { ops::where(ops::gt(x, 0.0), x, ones({3})); }, {"[3]"});
  expect_error<DTypeError>([&] { ops::masked_fill(x, x, 0.0); }, {"bool"});
  expect_error<ShapeError>([&] { ops::tril(ones({3})); }, {"[3]"});
}


}  // namespace
}  // namespace tandem
