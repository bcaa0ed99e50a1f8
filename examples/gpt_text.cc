// W3: train the byte-level GPT (4 layers, d_model 256, 4 heads, context 128) on a text corpus
// (default: Debian's license texts) with AdamW (lr 3e-4, batch 8) and print the loss in
// nats/byte; optionally sample text from the trained model.
#include <chrono>
#include <cstdio>
#include <deque>
#include <numeric>
#include <string>

#include "example_common.h"
#include "tandem/data/dataloader.h"
#include "tandem/data/text.h"

namespace td = tandem;

int main(int argc, char** argv) try {
  const examples::Flags flags(argc, argv,
                              {{"steps", "300"}, {"batch-size", "8"}, {"context", "128"}, {"lr", "3e-4"},
                               {"threads", "1"}, {"seed", "0"}, {"corpus", td::data::TextBytes::kDefaultCorpus},
                               {"log-every", "25"}, {"sample", "0"}, {"summary-json", ""}, {"precision", "fp32"}, {"opt-level", ""}},
                              "gpt_text [--steps N] [--batch-size B] [--context T] [--lr LR] [--threads T] [--seed S] "
                              "[--corpus PATH] [--log-every K] [--sample N] [--summary-json PATH] " +
                                  std::string(examples::kPrecisionUsage));
  // Every flag is checked here, before anything runs: a bad --sample or --summary-json must not
  // cost a whole training run.
  const int64_t steps = flags.integer("steps", 1), batch_size = flags.integer("batch-size", 1);
  const int64_t context = flags.integer("context", 1), log_every = flags.integer("log-every", 1);
  const int threads = static_cast<int>(flags.integer("threads", 1, examples::kMaxThreads));
  const uint64_t seed = static_cast<uint64_t>(flags.integer("seed"));
  const int64_t sample = flags.integer("sample");
  const double lr = flags.finite("lr", 0.0);
  const std::string summary_path = flags.str("summary-json");
  // The loader keeps one index per window of the epoch (8 bytes each): 2^30 windows is 8 GiB and
  // years of training here; more used to overflow or fail in std::vector with no flag named.
  constexpr int64_t kMaxWindows = int64_t{1} << 30;
  if (steps > kMaxWindows / batch_size) {
    throw td::ValueError(fmt::format("--steps {} x --batch-size {}: more than 2^30 training windows in one run", steps,
                                     batch_size));
  }
  (void)td::amp::parse_precision(flags.str("precision"));  // throws naming a bad value
  examples::check_summary_path(summary_path);
  td::set_num_threads(threads);
  td::manual_seed(seed);

  // Random windows of context + 1 bytes; one epoch holds exactly the batches we train on.
  const td::data::TextBytes corpus({flags.str("corpus")}, context, seed, steps * batch_size);
  td::data::DataLoader loader(corpus, {.batch_size = batch_size, .drop_last = true});
  std::printf("corpus: %lld bytes from %zu files under %s; %d thread(s); cpu: %s\n",
              static_cast<long long>(corpus.corpus_size()), corpus.files().size(), flags.str("corpus").c_str(), threads,
              td::cpu_features().summary().c_str());

  auto model = td::nn::models::gpt({.context = context});
  td::optim::AdamW opt(model->parameters(), {.lr = lr});
  examples::Precision precision(flags, *model, opt);
  std::printf("gpt: %lld parameters; precision %s\n", static_cast<long long>(model->num_parameters()),
              precision.describe().c_str());
  td::reset_peak_allocated_bytes();

  // ---- train ----
  std::deque<double> last;  // the last 50 losses
  int64_t step = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& batch : loader) {
    const td::Tensor& x = batch[0];  // (B, T) int64 bytes
    const td::Tensor& y = batch[1];  // (B, T) the next bytes
    opt.zero_grad();
    td::Tensor loss;
    {
      auto autocast = precision.forward_guard();
      const td::Tensor logits = (*model)(x);  // (B, T, 256)
      loss = td::ops::cross_entropy(logits.view({-1, logits.size(-1)}), y.reshape({-1}));
    }
    precision.backward_step(loss, opt);
    last.push_back(loss.item());
    if (last.size() > 50) last.pop_front();
    if (++step % log_every == 0 || step == steps) {
      std::printf("step %lld loss %.4f (mean of last %zu: %.4f)\n", static_cast<long long>(step), loss.item(), last.size(),
                  std::accumulate(last.begin(), last.end(), 0.0) / static_cast<double>(last.size()));
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double final_loss = std::accumulate(last.begin(), last.end(), 0.0) / static_cast<double>(last.size());
  const double tokens_per_s = static_cast<double>(step * batch_size * context) / seconds;
  const int64_t peak = td::peak_allocated_bytes();
  std::printf("final_loss %.4f nats/byte  tokens_per_s %.1f  peak_bytes %lld  train_seconds %.2f\n", final_loss,
              tokens_per_s, static_cast<long long>(peak), seconds);

  // ---- sample ----
  if (const int64_t n = sample; n > 0) {
    model->eval();
    const std::string prompt = "The ";
    td::Tensor idx = td::empty({1, static_cast<int64_t>(prompt.size())}, td::kInt64);
    for (size_t i = 0; i < prompt.size(); ++i) idx.data_ptr<int64_t>()[i] = static_cast<unsigned char>(prompt[i]);
    td::Generator gen(seed + 1);
    auto autocast = precision.forward_guard();
    const td::Tensor out = model->generate(idx, n, 1.0, &gen);
    std::string text;
    for (int64_t i = 0; i < out.size(1); ++i) text += static_cast<char>(out.data_ptr<int64_t>()[i]);
    std::printf("---- sample ----\n%s\n----------------\n", text.c_str());
  }
  examples::write_summary(summary_path,
                          {{"final_loss", final_loss}, {"tokens_per_s", tokens_per_s}, {"peak_bytes", peak},
                           {"train_seconds", seconds}, {"steps", step}, {"batch_size", batch_size},
                           {"context", context}, {"threads", threads},
                           {"precision", precision.describe()}, {"loss_scale", precision.loss_scale()}});
  return 0;
} catch (const std::exception& e) {
  return tandem::report(e);
}
