// W2: train the small CNN (3 x [conv 3x3, BatchNorm, ReLU], global mean, linear) on
// Fashion-MNIST with AdamW (lr 1e-3, batch 64) for one epoch on one thread, then report test
// accuracy and throughput.
#include <chrono>
#include <cstdio>

#include "example_common.h"

namespace td = tandem;

int main(int argc, char** argv) try {
  const examples::Flags flags(argc, argv,
                              {{"epochs", "1"}, {"batch-size", "64"}, {"lr", "1e-3"}, {"weight-decay", "0.01"},
                               {"threads", "1"}, {"seed", "0"}, {"data-dir", ""}, {"summary-json", ""}, {"normalize", "1"}},
                              "fashion_mnist_cnn [--epochs N] [--batch-size B] [--lr LR] [--weight-decay WD] "
                              "[--threads T] [--seed S] [--data-dir DIR] [--normalize 0|1] [--summary-json PATH]");
  const int64_t epochs = flags.integer("epochs", 1), batch_size = flags.integer("batch-size", 1);
  const int threads = static_cast<int>(flags.integer("threads", 1));
  const uint64_t seed = static_cast<uint64_t>(flags.integer("seed"));
  td::set_num_threads(threads);
  td::manual_seed(seed);

  const std::string root = flags.str("data-dir").empty() ? td::data::fashion_mnist_dir() : flags.str("data-dir");
  const auto train = td::data::fashion_mnist("train", root);
  const auto test = td::data::fashion_mnist("test", root);
  // (N, 1, 28, 28): standardised, or plain [0, 1] pixels (what torchvision's ToTensor gives).
  auto pixels = [&](const td::Tensor& u8) {
    return flags.integer("normalize") ? examples::normalise_fashion(u8) : td::ops::mul(u8.to(td::kFloat32), 1.0 / 255.0);
  };
  const td::Tensor x_train = pixels(train.images).unsqueeze(1);
  const td::Tensor x_test = pixels(test.images).unsqueeze(1);
  std::printf("fashion-mnist: %lld train, %lld test images; %d thread(s); cpu: %s\n",
              static_cast<long long>(train.size()), static_cast<long long>(test.size()), threads,
              td::cpu_features().summary().c_str());

  auto model = td::nn::models::cnn();
  td::optim::AdamW opt(model->parameters(), {.lr = flags.num("lr"), .weight_decay = flags.num("weight-decay")});
  td::reset_peak_allocated_bytes();

  // ---- train ----
  const int64_t n = train.size();
  int64_t seen = 0, step = 0;
  double train_seconds = 0;
  for (int64_t epoch = 0; epoch < epochs; ++epoch) {
    const td::Tensor order = examples::permutation(n, seed * 1000003ULL + static_cast<uint64_t>(epoch));
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t start = 0; start < n; start += batch_size) {
      const td::Tensor idx = order.narrow(0, start, std::min(batch_size, n - start));
      const td::Tensor x = td::ops::index_select(x_train, 0, idx);
      const td::Tensor y = td::ops::index_select(train.labels, 0, idx);
      opt.zero_grad();
      td::Tensor loss = td::ops::cross_entropy((*model)(x), y);
      loss.backward();
      opt.step();
      seen += idx.numel();
      if (++step % 100 == 0) std::printf("epoch %lld step %lld loss %.4f\n", static_cast<long long>(epoch),
                                         static_cast<long long>(step), loss.item());
    }
    train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // ---- evaluate (running BatchNorm statistics) ----
  model->eval();
  int64_t correct = 0;
  {
    td::NoGradGuard no_grad;
    for (int64_t start = 0; start < test.size(); start += 500) {
      const int64_t len = std::min<int64_t>(500, test.size() - start);
      const td::Tensor logits = (*model)(x_test.narrow(0, start, len));
      correct += td::ops::count_equal(td::ops::argmax(logits, 1), test.labels.narrow(0, start, len));
    }
  }
  const double accuracy = static_cast<double>(correct) / static_cast<double>(test.size());
  const double samples_per_s = static_cast<double>(seen) / train_seconds;
  const int64_t peak = td::peak_allocated_bytes();
  std::printf("test_accuracy %.4f  samples_per_s %.1f  peak_bytes %lld  train_seconds %.2f\n", accuracy, samples_per_s,
              static_cast<long long>(peak), train_seconds);
  examples::write_summary(flags.str("summary-json"),
                          {{"test_accuracy", accuracy}, {"samples_per_s", samples_per_s}, {"peak_bytes", peak},
                           {"train_seconds", train_seconds}, {"epochs", epochs}, {"batch_size", batch_size},
                           {"threads", threads}, {"steps", step}});
  return 0;
} catch (const std::exception& e) {
  return tandem::report(e);
}
