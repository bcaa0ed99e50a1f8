// W1: train the 784-1024-1024-10 MLP on Fashion-MNIST with SGD (momentum 0.9, lr 0.05,
// batch 128) for one epoch on one thread, then report test accuracy and throughput.
#include <cstdio>

#include "example_common.h"

namespace td = tandem;

int main(int argc, char** argv) try {
  const examples::Flags flags(argc, argv,
                              {{"epochs", "1"}, {"batch-size", "128"}, {"lr", "0.05"}, {"momentum", "0.9"},
                               {"threads", "1"}, {"seed", "0"}, {"data-dir", ""}, {"summary-json", ""}, {"precision", "fp32"}, {"opt-level", ""}},
                              "fashion_mnist_mlp [--epochs N] [--batch-size B] [--lr LR] [--momentum M] [--threads T] "
                              "[--seed S] [--data-dir DIR] [--summary-json PATH] " +
                                  std::string(examples::kPrecisionUsage));
  const int64_t epochs = flags.integer("epochs", 1), batch_size = flags.integer("batch-size", 1);
  const int threads = static_cast<int>(flags.integer("threads", 1, examples::kMaxThreads));
  const uint64_t seed = static_cast<uint64_t>(flags.integer("seed"));
  const double lr = flags.finite("lr", 0.0), momentum = flags.finite("momentum", 0.0);
  const std::string summary_path = flags.str("summary-json");
  examples::check_summary_path(summary_path);  // before the epoch, not after it
  td::set_num_threads(threads);
  td::manual_seed(seed);

  const std::string root = flags.str("data-dir").empty() ? td::data::fashion_mnist_dir() : flags.str("data-dir");
  const auto train = td::data::fashion_mnist("train", root);
  const auto test = td::data::fashion_mnist("test", root);
  const td::Tensor x_train = examples::normalise_fashion(train.images).reshape({train.size(), -1});
  const td::Tensor x_test = examples::normalise_fashion(test.images).reshape({test.size(), -1});
  std::printf("fashion-mnist: %lld train, %lld test images from %s; %d thread(s); cpu: %s\n",
              static_cast<long long>(train.size()), static_cast<long long>(test.size()), root.c_str(), threads,
              td::cpu_features().summary().c_str());

  auto model = td::nn::models::mlp();
  td::optim::SGD opt(model->parameters(), {.lr = lr, .momentum = momentum});
  examples::Precision precision(flags, *model, opt);
  td::reset_peak_allocated_bytes();

  const examples::ClassifierResult r =
      examples::train_classifier(*model, opt, precision, x_train, train.labels, x_test, test.labels, epochs, batch_size, seed);
  examples::report_classifier(r, summary_path, epochs, batch_size, threads, precision);
  return 0;
} catch (const std::exception& e) {
  return tandem::report(e);
}
