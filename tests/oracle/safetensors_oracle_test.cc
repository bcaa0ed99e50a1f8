// safetensors against Python's own implementation (tests/oracle/safetensors_roundtrip.py, run
// with .venv-test/bin/python from scripts/install-deps.sh): Tandem's files load in
// safetensors.torch / safetensors.numpy bit for bit, Python's writer produces the same bytes as
// Tandem's, files written by safetensors.torch (bfloat16 and float16 included) load in Tandem bit
// for bit, the MLP's state dict saved by Tandem drives torch's equivalent nn.Sequential to the
// same logits, and the W3 GPT and a model with tied weights go both ways through
// load_state_dict(strict) bit for bit (Python's save_model stores a shared tensor once, Tandem under
// each name).
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tandem/core/safetensors.h"
#include "tandem/nn/layers.h"
#include "tandem/nn/models/gpt.h"
#include "tandem/nn/serialize.h"
#include "util/test_util.h"

namespace td = tandem;
using td::Tensor;
using td::testing::source_path;
using Named = std::vector<std::pair<std::string, Tensor>>;

namespace {

// The venv Python when it exists and can import safetensors and torch, else "".
const std::string& venv_python() {
  static const std::string found = [] {
    const std::string py = source_path(".venv-test/bin/python");
    if (!std::filesystem::exists(py)) return std::string();
    const std::string cmd = "'" + py + "' -c 'import safetensors, torch, numpy' >/dev/null 2>&1";
    return std::system(cmd.c_str()) == 0 ? py : std::string();
  }();
  return found;
}

#define REQUIRE_SAFETENSORS_PYTHON()                                                                      \
  do {                                                                                                    \
    if (venv_python().empty())                                                                            \
      GTEST_SKIP() << "needs .venv-test/bin/python with safetensors and torch: run scripts/install-deps.sh"; \
  } while (0)

// Runs safetensors_roundtrip.py with `args` from tests/oracle; returns its exit status.
int run_py(const std::vector<std::string>& args) {
  std::string cmd = "cd '" + source_path("tests/oracle") + "' && OPENBLAS_CORETYPE=SkylakeX OMP_NUM_THREADS=1 '" +
                    venv_python() + "' safetensors_roundtrip.py";
  for (const auto& a : args) cmd += " '" + a + "'";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::string bytes_of(const Tensor& t) {
  const Tensor c = t.detach().contiguous();
  return c.nbytes() == 0 ? std::string() : std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

template <class Bits>
Tensor from_bits(const std::vector<Bits>& bits, const td::Shape& shape, td::DType dtype) {
  Tensor t = td::empty(shape, dtype);
  std::memcpy(t.data_ptr(), bits.data(), bits.size() * sizeof(Bits));
  return t;
}

TEST(SafetensorsOracle, TandemFileLoadsInPython) {
  REQUIRE_SAFETENSORS_PYTHON();
  td::testing::TempDir dir;
  td::Generator g(11);
  const Named tensors = {
      {"f32", from_bits<uint32_t>({0x3fc00000u, 0x80000000u, 0x7f800000u, 0x7fc00123u, 0x00000001u, 0xc2f60000u}, {3, 2},
                                  td::kFloat32)},
      {"f64", td::randn({2, 2}, td::kFloat64, &g)},
      {"f16", from_bits<uint16_t>({0x3c00, 0x7bff, 0x0001, 0x8000, 0xfc00}, {5}, td::kFloat16)},
      {"bf16", from_bits<uint16_t>({0x3f80, 0xff80, 0x0001, 0x4049}, {2, 2}, td::kBFloat16)},
      {"i64", td::tensor(std::vector<int64_t>{INT64_MIN, -3, INT64_MAX}, {3})},
      {"i32", td::tensor({-2147483648.0, 9, 2147483647.0}, {1, 3}, td::kInt32)},
      {"u8", td::tensor({0, 128, 255}, {3}, td::kUInt8)},
      {"bool", td::tensor({1, 0, 0, 1, 1}, {5}, td::kBool)},
      {"scalar", td::scalar_tensor(-1.75, td::kFloat64)},
      {"empty", td::zeros({2, 0}, td::kFloat32)},
      {"transposed", td::randn({3, 4}, td::kFloat32, &g).t()},
  };
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "h\xc3\xa9llo"}, {"empty", ""}};
  const std::string path = dir.path() + "/tandem.safetensors";
  td::save_safetensors(path, tensors, meta);
  td::testing::save_tensors(dir.path() + "/expect", tensors);
  {
    nlohmann::json j(meta);
    std::ofstream(dir.path() + "/meta.json") << j.dump();
  }
  EXPECT_EQ(run_py({"check", path, dir.path() + "/expect", dir.path() + "/meta.json"}), 0);

  // A bfloat16-free file also goes through safetensors.numpy.load_file whole.
  const std::string plain = dir.path() + "/plain.safetensors";
  td::save_safetensors(plain, {tensors[0], tensors[1], tensors[7]});
  td::testing::save_tensors(dir.path() + "/expect_plain", {tensors[0], tensors[1], tensors[7]});
  std::ofstream(dir.path() + "/empty_meta.json") << "{}";
  EXPECT_EQ(run_py({"check", plain, dir.path() + "/expect_plain", dir.path() + "/empty_meta.json"}), 0);

  // The check can fail: the same file against different expectations.
  td::testing::save_tensors(dir.path() + "/wrong", {{"f32", td::zeros({3, 2})}});
  std::fprintf(stderr, "(the mismatches printed next are expected: a deliberately wrong expectation)\n");
  EXPECT_NE(run_py({"check", plain, dir.path() + "/wrong", dir.path() + "/empty_meta.json"}), 0);
}

TEST(SafetensorsOracle, PythonWritesTheSameBytes) {
  // Python orders tensors by dtype size, then name, and metadata keys by hash: with one dtype,
  // names in order and one metadata key, both writers must agree byte for byte.
  REQUIRE_SAFETENSORS_PYTHON();
  td::testing::TempDir dir;
  td::Generator g(5);
  const std::string path = dir.path() + "/tandem.safetensors", py = dir.path() + "/python.safetensors";
  td::save_safetensors(path, {{"a.bias", td::randn({3}, td::kFloat32, &g)}, {"a.weight", td::randn({3, 2}, td::kFloat32, &g)},
                              {"z", td::scalar_tensor(1.0)}},
                       {{"format", "pt"}});
  ASSERT_EQ(run_py({"rewrite", path, py}), 0);
  EXPECT_EQ(read_file(path), read_file(py));
}

TEST(SafetensorsOracle, TorchFileLoadsInTandem) {
  REQUIRE_SAFETENSORS_PYTHON();
  td::testing::TempDir dir;
  const std::string path = dir.path() + "/torch.safetensors";
  ASSERT_EQ(run_py({"write", path, dir.path() + "/expect"}), 0);
  const Named expected = td::testing::load_tensors(dir.path() + "/expect");
  const td::SafetensorsFile f = td::load_safetensors(path);
  EXPECT_EQ(f.metadata, (std::map<std::string, std::string>{{"source", "torch"}, {"seed", "7"}}));
  ASSERT_EQ(f.tensors.size(), expected.size());
  bool saw_bf16 = false, saw_f16 = false;
  for (const auto& [name, want] : expected) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(f.contains(name));
    const Tensor& got = f.at(name);
    EXPECT_EQ(got.dtype(), want.dtype());
    EXPECT_EQ(got.shape(), want.shape());
    EXPECT_EQ(bytes_of(got), bytes_of(want));
    saw_bf16 |= got.dtype() == td::kBFloat16;
    saw_f16 |= got.dtype() == td::kFloat16;
  }
  EXPECT_TRUE(saw_bf16 && saw_f16);
  EXPECT_EQ(f.at("scalar").shape(), td::Shape{});
  EXPECT_EQ(f.at("scalar").item(), 2.5);
}

TEST(SafetensorsOracle, MlpStateDictDrivesTorchToTheSameLogits) {
  // Tolerance: rtol 1e-5 as every f32 oracle here; the logits are sums of 1024 products whose
  // terms are below ~0.05 in size (Linear's U(-1/32, 1/32) weights times activations below ~1.5),
  // so differently-ordered f32 GEMM accumulation differs by at most ~4 u n s = 4 * 2^-24 * 1024 *
  // 0.05 = 1.2e-5 absolute: atol 2e-5. A transposed or misnamed weight changes logits by ~0.1.
  REQUIRE_SAFETENSORS_PYTHON();
  td::testing::TempDir dir;
  auto model = td::nn::models::mlp();
  const std::string path = dir.path() + "/mlp.safetensors";
  td::nn::save_state_dict(*model, path, {{"format", "pt"}});

  td::Generator g(3);
  const Tensor x = td::rand({8, 1, 28, 28}, td::kFloat32, &g);
  td::testing::save_tensors(dir.path() + "/in", {{"x", x}});
  ASSERT_EQ(run_py({"mlp", path, dir.path() + "/in", dir.path() + "/out"}), 0);
  const Tensor expected = td::testing::find_tensor(td::testing::load_tensors(dir.path() + "/out"), "logits");
  Tensor logits;
  {
    td::NoGradGuard no_grad;
    logits = (*model)(x);
  }
  EXPECT_ALL_CLOSE(logits, expected, 1e-5, 2e-5);

  // The same comparison fails for a model with other weights, so it can catch a wrong load.
  auto other = td::nn::models::mlp();
  td::NoGradGuard no_grad;
  EXPECT_FALSE(td::testing::all_close((*other)(x), expected, 1e-5, 2e-5));
}

// Every tensor of `module`'s state dict equals (dtype, shape, bits) the one of its name in `dir`.
void expect_state_equals_files(const td::nn::Module& module, const std::string& dir) {
  const Named files = td::testing::load_tensors(dir);
  const Named state = module.state_dict();
  ASSERT_EQ(state.size(), files.size()) << dir;
  for (const auto& [name, t] : state) {
    SCOPED_TRACE(name);
    const Tensor want = td::testing::find_tensor(files, name);
    EXPECT_EQ(t.dtype(), want.dtype());
    EXPECT_EQ(t.shape(), want.shape());
    EXPECT_EQ(bytes_of(t), bytes_of(want));
  }
}

// emb.weight and head.weight: one tensor under two names, as in Tied of safetensors_roundtrip.py.
struct TiedModel : td::nn::Module {
  TiedModel() : Module("TiedModel") {
    emb = register_module("emb", std::make_shared<td::nn::Embedding>(5, 4));
    head = register_module("head", std::make_shared<td::nn::Module>("Linear"));
    head->register_parameter("weight", emb->weight);
  }
  std::shared_ptr<td::nn::Embedding> emb;
  std::shared_ptr<td::nn::Module> head;
};

TEST(SafetensorsOracle, GptAndTiedWeightsGoBothWaysThroughLoadStateDict) {
  REQUIRE_SAFETENSORS_PYTHON();
  td::testing::TempDir dir;
  const td::nn::models::GptOptions o{.vocab_size = 64, .context = 16, .n_layer = 2, .d_model = 32, .n_head = 4};
  td::manual_seed(3);
  auto gpt = td::nn::models::gpt(o);
  const std::string gpt_file = dir.path() + "/gpt.safetensors", tied_file = dir.path() + "/tied.safetensors";
  td::nn::save_state_dict(*gpt, gpt_file, {{"format", "pt"}});
  TiedModel tied;
  td::nn::save_state_dict(tied, tied_file);
  ASSERT_EQ(run_py({"models", gpt_file, tied_file, std::to_string(o.n_head), dir.path()}), 0);

  // Tandem -> torch: loaded strictly, bit for bit, the tied pair still one tensor (checked there).
  expect_state_equals_files(*gpt, dir.path() + "/gpt_loaded");
  EXPECT_EQ(bytes_of(td::testing::find_tensor(td::testing::load_tensors(dir.path() + "/tied_loaded"), "emb.weight")),
            bytes_of(tied.emb->weight));

  // torch -> Tandem: save_file's GPT and save_model's tied model (one name, "head.weight" only as
  // metadata) load strictly, bit for bit, into fresh models (other seeds, so a no-op load fails).
  td::manual_seed(4);
  auto gpt2 = td::nn::models::gpt(o);
  td::nn::load_state_dict_file(*gpt2, dir.path() + "/torch_gpt.safetensors");
  expect_state_equals_files(*gpt2, dir.path() + "/torch_gpt_expect");
  TiedModel tied2;
  const std::string torch_tied = dir.path() + "/torch_tied.safetensors";
  EXPECT_EQ(td::load_safetensors(torch_tied).tensors.size(), 1u) << "save_model stores a shared tensor once";
  td::nn::load_state_dict_file(tied2, torch_tied);
  const Tensor want = td::testing::find_tensor(td::testing::load_tensors(dir.path() + "/torch_tied_expect"), "emb.weight");
  EXPECT_EQ(bytes_of(tied2.emb->weight), bytes_of(want));
  EXPECT_TRUE(tied2.head->named_parameters()[0].second.is_same(tied2.emb->weight));
}

}  // namespace
