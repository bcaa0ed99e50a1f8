// W1: train the 784-1024-1024-10 MLP on Fashion-MNIST with SGD (momentum 0.9, lr 0.05,
// batch 128) for one epoch on one thread, then report test accuracy and throughput.
//
//   fashion_mnist_mlp [--epochs N] [--batch-size B] [--lr LR] [--momentum M] [--threads T]
//                     [--seed S] [--data-dir DIR] [--summary-json PATH]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tandem/tandem.h"

namespace td = tandem;

namespace {

struct Args {
  int64_t epochs = 1;
  int64_t batch_size = 128;
  double lr = 0.05;
  double momentum = 0.9;
  int threads = 1;
  uint64_t seed = 0;
  std::string data_dir;
  std::string summary_json;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw td::ValueError(fmt::format("{} needs a value", k));
      return argv[++i];
    };
    auto number = [&](const std::string& v) {
      try {
        size_t pos = 0;
        const double d = std::stod(v, &pos);
        if (pos != v.size()) throw std::invalid_argument(v);
        return d;
      } catch (const std::exception&) {
        throw td::ValueError(fmt::format("{}: \"{}\" is not a number", k, v));
      }
    };
    if (k == "--epochs") a.epochs = static_cast<int64_t>(number(value()));
    else if (k == "--batch-size") a.batch_size = static_cast<int64_t>(number(value()));
    else if (k == "--lr") a.lr = number(value());
    else if (k == "--momentum") a.momentum = number(value());
    else if (k == "--threads") a.threads = static_cast<int>(number(value()));
    else if (k == "--seed") a.seed = static_cast<uint64_t>(number(value()));
    else if (k == "--data-dir") a.data_dir = value();
    else if (k == "--summary-json") a.summary_json = value();
    else if (k == "--help" || k == "-h") {
      std::printf("usage: fashion_mnist_mlp [--epochs N] [--batch-size B] [--lr LR] [--momentum M] [--threads T] "
                  "[--seed S] [--data-dir DIR] [--summary-json PATH]\n");
      std::exit(0);
    } else {
      throw td::ValueError(fmt::format("unknown argument \"{}\" (try --help)", k));
    }
  }
  if (a.epochs < 1 || a.batch_size < 1 || a.threads < 1) {
    throw td::ValueError(fmt::format("--epochs, --batch-size and --threads must be >= 1 (got {}, {}, {})", a.epochs,
                                     a.batch_size, a.threads));
  }
  return a;
}

// (N, 28, 28) u8 -> (N, 784) f32, normalised with the training set's mean and std.
td::Tensor normalise(const td::Tensor& images) {
  td::Tensor x = images.reshape({images.size(0), -1}).to(td::kFloat32);
  return (x * (1.0 / 255.0) - 0.2860) * (1.0 / 0.3530);
}

// A Fisher-Yates permutation of [0, n) drawn from a seeded Philox generator.
td::Tensor permutation(int64_t n, uint64_t seed) {
  td::Tensor idx = td::arange(static_cast<double>(n));
  auto* p = idx.data_ptr<int64_t>();
  td::Generator g(seed);
  const uint64_t base = g.reserve(static_cast<uint64_t>(n));
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[g.bits(base, static_cast<uint64_t>(i)) % static_cast<uint64_t>(i + 1)]);
  return idx;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  td::set_num_threads(args.threads);
  td::manual_seed(args.seed);

  const std::string root = args.data_dir.empty() ? td::data::fashion_mnist_dir() : args.data_dir;
  const auto train = td::data::fashion_mnist("train", root);
  const auto test = td::data::fashion_mnist("test", root);
  const td::Tensor x_train = normalise(train.images), y_train = train.labels;
  const td::Tensor x_test = normalise(test.images), y_test = test.labels;
  std::printf("fashion-mnist: %lld train, %lld test images from %s; %d thread(s); cpu: %s\n",
              static_cast<long long>(train.size()), static_cast<long long>(test.size()), root.c_str(), args.threads,
              td::cpu_features().summary().c_str());

  auto model = td::nn::models::mlp();
  td::optim::SGD opt(model->parameters(), {.lr = args.lr, .momentum = args.momentum});
  td::reset_peak_allocated_bytes();

  // ---- train ----
  const int64_t n = train.size();
  int64_t seen = 0, step = 0;
  double train_seconds = 0;
  for (int64_t epoch = 0; epoch < args.epochs; ++epoch) {
    const td::Tensor order = permutation(n, args.seed * 1000003ULL + static_cast<uint64_t>(epoch));
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t start = 0; start < n; start += args.batch_size) {
      const int64_t len = std::min(args.batch_size, n - start);
      const td::Tensor idx = order.narrow(0, start, len);
      const td::Tensor x = td::ops::index_select(x_train, 0, idx);
      const td::Tensor y = td::ops::index_select(y_train, 0, idx);
      opt.zero_grad();
      td::Tensor loss = td::ops::cross_entropy((*model)(x), y);
      loss.backward();
      opt.step();
      seen += len;
      if (++step % 100 == 0) std::printf("epoch %lld step %lld loss %.4f\n", static_cast<long long>(epoch),
                                         static_cast<long long>(step), loss.item());
    }
    train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // ---- evaluate ----
  model->eval();
  int64_t correct = 0;
  {
    td::NoGradGuard no_grad;
    for (int64_t start = 0; start < test.size(); start += 1000) {
      const int64_t len = std::min<int64_t>(1000, test.size() - start);
      const td::Tensor logits = (*model)(x_test.narrow(0, start, len));
      correct += td::ops::count_equal(td::ops::argmax(logits, 1), y_test.narrow(0, start, len));
    }
  }
  const double accuracy = static_cast<double>(correct) / static_cast<double>(test.size());
  const double samples_per_s = static_cast<double>(seen) / train_seconds;
  const int64_t peak = td::peak_allocated_bytes();
  std::printf("test_accuracy %.4f  samples_per_s %.1f  peak_bytes %lld  train_seconds %.2f\n", accuracy, samples_per_s,
              static_cast<long long>(peak), train_seconds);

  if (!args.summary_json.empty()) {
    nlohmann::json j = {{"test_accuracy", accuracy},   {"samples_per_s", samples_per_s}, {"peak_bytes", peak},
                        {"train_seconds", train_seconds}, {"epochs", args.epochs},      {"batch_size", args.batch_size},
                        {"threads", args.threads},     {"steps", step}};
    const std::string tmp = args.summary_json + ".tmp";
    {
      std::ofstream f(tmp);
      if (!f) throw td::IOError(fmt::format("cannot write {}", tmp));
      f << j.dump(2) << "\n";
    }
    std::rename(tmp.c_str(), args.summary_json.c_str());
  }
  return 0;
} catch (const std::exception& e) {
  return td::report(e);
}
