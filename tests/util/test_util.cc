#include "util/test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

namespace tandem::testing {

::testing::AssertionResult all_close(const Tensor& actual, const Tensor& expected, double rtol, double atol) {
  if (actual.shape() != expected.shape()) {
    return ::testing::AssertionFailure() << "shape " << shape_str(actual.shape()) << " vs expected "
                                         << shape_str(expected.shape());
  }
  const std::vector<double> a = actual.to_vector(), e = expected.to_vector();
  double worst = -1;
  size_t worst_i = 0;
  size_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(e[i])) {
      if (std::isnan(a[i]) != std::isnan(e[i])) {
        ++bad;
        if (worst < 0) worst_i = i, worst = INFINITY;
      }
      continue;
    }
    if (a[i] == e[i]) continue;  // also equal infinities
    const double err = std::abs(a[i] - e[i]);
    const double allowed = atol + rtol * std::abs(e[i]);
    if (!(err <= allowed)) {
      ++bad;
      if (err - allowed > worst) worst = err - allowed, worst_i = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << a.size() << " elements differ beyond rtol=" << rtol
                                       << " atol=" << atol << "; worst at flat index " << worst_i << ": "
                                       << fmt::format("{:.9g}", a[worst_i]) << " vs expected "
                                       << fmt::format("{:.9g}", e[worst_i]);
}

Tensor leaf(const Shape& shape, double lo, double hi, uint64_t seed, DType dtype) {
  Generator g(seed + 12345);
  Tensor t = rand(shape, kFloat64, &g);
  t.mul_(hi - lo);
  Tensor shifted = full(shape, lo, kFloat64);
  shifted.add_(t);
  Tensor out = shifted.to(dtype);
  out.requires_grad_(true);
  return out;
}

::testing::AssertionResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                                     const std::vector<Tensor>& inputs, const GradcheckOptions& o) {
  for (const Tensor& t : inputs) {
    if (t.dtype() != kFloat64) return ::testing::AssertionFailure() << "gradcheck needs f64 inputs";
  }
  Tensor y = fn(inputs);
  Generator g(777);
  const Tensor w = randn(y.shape(), kFloat64, &g);
  auto reduce = [&](const Tensor& out) { return ops::sum(ops::mul(out, w)); };
  std::vector<Tensor> wanted;
  for (const Tensor& t : inputs)
    if (t.requires_grad()) wanted.push_back(t);
  std::vector<Tensor> analytic = autograd::grad({reduce(y)}, wanted, {}, false, /*allow_unused=*/true);
  size_t k = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    if (!x.requires_grad()) continue;
    const Tensor ga = analytic[k++];
    const std::vector<double> av = ga.defined() ? ga.to_vector() : std::vector<double>(x.numel(), 0.0);
    NoGradGuard no_grad;
    Tensor xc = x.detach();
    if (!xc.is_contiguous()) return ::testing::AssertionFailure() << "gradcheck needs contiguous inputs";
    double* p = xc.data_ptr<double>();
    for (int64_t j = 0; j < x.numel(); ++j) {
      const double orig = p[j];
      p[j] = orig + o.eps;
      const double plus = reduce(fn(inputs)).item();
      p[j] = orig - o.eps;
      const double minus = reduce(fn(inputs)).item();
      p[j] = orig;
      const double numeric = (plus - minus) / (2 * o.eps);
      const double err = std::abs(numeric - av[static_cast<size_t>(j)]);
      if (err > o.atol + o.rtol * std::abs(numeric)) {
        return ::testing::AssertionFailure() << "input " << i << " element " << j << ": analytic "
                                             << fmt::format("{:.10g}", av[static_cast<size_t>(j)]) << " vs numeric "
                                             << fmt::format("{:.10g}", numeric);
      }
    }
  }
  return ::testing::AssertionSuccess();
}

const std::string& torch_python() {
  static const std::string found = [] {
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("TANDEM_TORCH_PYTHON"); env && *env) candidates.push_back(env);
    candidates.push_back("/usr/bin/python3");
    for (const auto& py : candidates) {
      const std::string cmd = py + " -c 'import torch' >/dev/null 2>&1";
      if (std::system(cmd.c_str()) == 0) return py;
    }
    return std::string();
  }();
  return found;
}

TempDir::TempDir() {
  std::random_device rd;
  for (int attempt = 0; attempt < 100; ++attempt) {
    const auto p = std::filesystem::temp_directory_path() / fmt::format("tandem-test-{:016x}", (uint64_t{rd()} << 32) | rd());
    if (std::filesystem::create_directory(p)) {
      path_ = p.string();
      return;
    }
  }
  throw IOError("TempDir: could not create a temporary directory");
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void save_tensors(const std::string& dir, const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::filesystem::create_directories(dir);
  nlohmann::json manifest = nlohmann::json::object();
  for (const auto& [name, t] : tensors) {
    const Tensor c = t.detach().contiguous();
    const std::string file = name + ".bin";
    std::ofstream f(dir + "/" + file, std::ios::binary);
    f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
    if (!f) throw IOError(fmt::format("save_tensors: cannot write {}/{}", dir, file));
    manifest[name] = {{"dtype", std::string(dtype_name(c.dtype()))}, {"shape", c.shape()}, {"file", file}};
  }
  std::ofstream m(dir + "/manifest.json");
  m << manifest.dump(1);
}

std::vector<std::pair<std::string, Tensor>> load_tensors(const std::string& dir) {
  std::ifstream m(dir + "/manifest.json");
  if (!m) throw IOError(fmt::format("load_tensors: {}/manifest.json not found", dir));
  const nlohmann::json manifest = nlohmann::json::parse(m);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, e] : manifest.items()) {
    const std::string dt = e.at("dtype");
    DType dtype = kFloat32;
    for (DType d : {kFloat32, kFloat64, kFloat16, kBFloat16, kInt64, kInt32, kUInt8, kBool})
      if (dtype_name(d) == dt) dtype = d;
    const Shape shape = e.at("shape").get<Shape>();
    Tensor t = empty(shape, dtype);
    std::ifstream f(dir + "/" + e.at("file").get<std::string>(), std::ios::binary);
    f.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    if (!f) throw IOError(fmt::format("load_tensors: {}/{} is short", dir, e.at("file").get<std::string>()));
    out.emplace_back(name, t);
  }
  return out;
}

Tensor find_tensor(const std::vector<std::pair<std::string, Tensor>>& tensors, const std::string& name) {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  throw ValueError(fmt::format("find_tensor: no tensor named \"{}\"", name));
}

std::string source_path(const std::string& relative) { return std::string(TANDEM_SOURCE_DIR) + "/" + relative; }

int run_oracle(const std::string& script, const std::vector<std::string>& args) {
  std::string cmd = "cd '" + source_path("tests/oracle") + "' && OPENBLAS_CORETYPE=SkylakeX OMP_NUM_THREADS=1 '" +
                    torch_python() + "' '" + script + "'";
  for (const auto& a : args) cmd += " '" + a + "'";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

std::vector<std::string> names(const std::vector<std::pair<std::string, Tensor>>& named) {
  std::vector<std::string> out;
  out.reserve(named.size());
  for (const auto& [n, t] : named) out.push_back(n);
  return out;
}

std::vector<Tensor> input_grads(const Tensor& loss, const std::vector<Tensor>& inputs) {
  std::vector<Tensor> grads(inputs.size());
  std::vector<Tensor> leaves;
  for (const Tensor& in : inputs)
    if (in.requires_grad()) leaves.push_back(in);
  if (!loss.defined() || leaves.empty()) return grads;
  const std::vector<Tensor> g = autograd::grad({loss}, leaves, {}, false, /*allow_unused=*/true);
  size_t j = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].requires_grad()) continue;
    grads[i] = g[j].defined() ? g[j] : zeros(inputs[i].shape(), inputs[i].dtype());
    ++j;
  }
  return grads;
}

::testing::AssertionResult within(const Tensor& actual, const Tensor& expected, const Tensor& bound) {
  const std::vector<double> a = actual.to_vector(), e = expected.to_vector(), b = bound.to_vector();
  if (a.size() != e.size() || a.size() != b.size()) return ::testing::AssertionFailure() << "size mismatch";
  size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double err = std::abs(a[i] - e[i]);
    const double ratio = err / std::max(b[i], 1e-300);
    if (!(err <= b[i])) ++bad;
    if (!(ratio <= worst_ratio)) worst_ratio = ratio, worst = i;
  }
  if (bad == 0) {
    std::printf("[ note     ] worst |error| / bound = %.3g\n", worst_ratio);
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << bad << " of " << a.size() << " elements beyond the bound; worst at " << worst
                                       << ": " << a[worst] << " vs " << e[worst] << " (bound " << b[worst] << ", "
                                       << worst_ratio << "x)";
}

// How far bf16 attention may be from f32 attention on the same bf16-representable q, k, v and
// upstream gradient gy ((B, H, T, D) views; y and dq/dk/dv the f32 results). The bf16 kernel
// (AMX path, attention.h) rounds the probabilities P and dS = P * (dP - delta) to bf16 before the
// products they feed and rounds out/dq/dk/dv once; with u = 2^-8 and scale the softmax scale:
//   out:  u |y| + u P |v|                     (P rounded: u P_j per term of P v)
//   delta = rowsum(gy * out) is taken from the bf16 out: its error is rowsum(|gy| E_out)
//   dS:   E_dS = u |dS| + P * E_delta
//   dq:   u |dq| + scale E_dS |k|    dk: u |dk| + scale E_dS^T |q|    dv: u |dv| + u P^T |gy|
// each times (1 + 2^-4) for the two paths' different f32 summation orders (at most n 2^-24
// relative to the same magnitudes: below 2^-12 for sums of up to 4096 terms). A path that computes in f32 and
// rounds once (CPUs without AMX) is within the same bounds.
AttentionBounds attention_bf16_bounds(const Tensor& q0, const Tensor& k0, const Tensor& v0, const Tensor& gy0, bool causal,
                                      const Tensor& y0, const std::vector<Tensor>& g) {
  const Tensor q = q0.detach().to(kFloat32), k = k0.detach().to(kFloat32), v = v0.detach().to(kFloat32);
  const Tensor gy = gy0.detach().to(kFloat32), y = y0.detach().to(kFloat32);
  const int64_t T = q.size(2), S = k.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3))), u = 0x1p-8, f = 1.0 + 1.0 / 16;
  Tensor sc = ops::mul(ops::matmul(q, k.transpose(2, 3)), scale);
  if (causal) {
    Tensor above = empty({T, S}, kBool);
    bool* pa = above.data_ptr<bool>();
    for (int64_t i = 0; i < T; ++i)
      for (int64_t j = 0; j < S; ++j) pa[i * S + j] = j > i;
    sc = ops::masked_fill(sc, above, -INFINITY);
  }
  const Tensor P = ops::softmax(sc, -1);
  AttentionBounds b;
  b.y = ops::mul(ops::add(ops::mul(ops::abs(y), u), ops::mul(ops::matmul(P, ops::abs(v)), u)), f);
  const Tensor delta = ops::sum(ops::mul(gy, y), {-1}, true);
  const Tensor dS = ops::mul(P, ops::sub(ops::matmul(gy, v.transpose(2, 3)), delta));
  const Tensor e_delta = ops::sum(ops::mul(ops::abs(gy), b.y), {-1}, true);
  const Tensor e_dS = ops::add(ops::mul(ops::abs(dS), u), ops::mul(P, e_delta));
  auto mag = [&](const Tensor& t) { return ops::mul(ops::abs(t.detach().to(kFloat32)), u); };
  b.dq = ops::mul(ops::add(mag(g[0]), ops::mul(ops::matmul(e_dS, ops::abs(k)), scale)), f);
  b.dk = ops::mul(ops::add(mag(g[1]), ops::mul(ops::matmul(e_dS.transpose(2, 3), ops::abs(q)), scale)), f);
  b.dv = ops::mul(ops::add(mag(g[2]), ops::mul(ops::matmul(P.transpose(2, 3), ops::abs(gy)), u)), f);
  return b;
}

std::vector<uint16_t> random_bf16(int64_t n, uint64_t seed, float lo, float hi) {
  const Generator gen(seed);
  std::vector<uint16_t> v(static_cast<size_t>(std::max<int64_t>(n, 1)));
  for (int64_t i = 0; i < n; ++i) {
    v[static_cast<size_t>(i)] = bf16_bits(gen.uniform(0, static_cast<uint64_t>(i)) * (hi - lo) + lo);
  }
  return v;
}

uint16_t unused_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace tandem::testing
