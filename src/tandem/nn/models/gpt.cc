#include "tandem/nn/models/gpt.h"

#include "tandem/autograd/grad_mode.h"
#include "tandem/nn/init.h"
#include "tandem/ops/attention.h"
#include "tandem/ops/elementwise.h"
#include "tandem/ops/linalg.h"
#include "tandem/ops/loss.h"
#include "tandem/ops/shape.h"

namespace tandem::nn::models {

CausalSelfAttention::CausalSelfAttention(int64_t d, int64_t h) : Module("CausalSelfAttention"), n_head(h) {
  TANDEM_CHECK(h >= 1 && d % h == 0, ValueError, "GPT: n_head={} must divide d_model={}", h, d);
  qkv = register_module("qkv", std::make_shared<Linear>(d, 3 * d));
  proj = register_module("proj", std::make_shared<Linear>(d, d));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), d = x.size(2), hd = d / n_head;
  const std::vector<Tensor> parts = ops::split((*qkv)(x), d, 2);  // q, k, v: (B, T, d)
  auto heads = [&](const Tensor& t) { return t.view({B, T, n_head, hd}).transpose(1, 2); };  // (B, H, T, hd)
  Tensor y = ops::scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), /*causal=*/true);
  return (*proj)(y.transpose(1, 2).contiguous().view({B, T, d}));
}

GptMlp::GptMlp(int64_t d) : Module("MLP") {
  fc1 = register_module("fc1", std::make_shared<Linear>(d, 4 * d));
  fc2 = register_module("fc2", std::make_shared<Linear>(4 * d, d));
}

Tensor GptMlp::forward(const Tensor& x) { return (*fc2)(ops::gelu((*fc1)(x), "tanh")); }

GptBlock::GptBlock(int64_t d, int64_t h) : Module("Block") {
  ln1 = register_module("ln1", std::make_shared<LayerNorm>(d));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(d, h));
  ln2 = register_module("ln2", std::make_shared<LayerNorm>(d));
  mlp = register_module("mlp", std::make_shared<GptMlp>(d));
}

Tensor GptBlock::forward(const Tensor& x) {
  Tensor h = ops::add(x, (*attn)((*ln1)(x)));
  return ops::add(h, (*mlp)((*ln2)(h)));
}

Gpt::Gpt(const GptOptions& o) : Module("GPT"), options(o) {
  TANDEM_CHECK(o.vocab_size > 0 && o.context > 0 && o.n_layer > 0 && o.d_model > 0, ValueError,
               "GPT: sizes must be positive (vocab {}, context {}, n_layer {}, d_model {})", o.vocab_size, o.context,
               o.n_layer, o.d_model);
  tok_emb = register_module("tok_emb", std::make_shared<Embedding>(o.vocab_size, o.d_model));
  pos_emb = register_module("pos_emb", std::make_shared<Embedding>(o.context, o.d_model));
  blocks = register_module("blocks", std::make_shared<ModuleList>());
  for (int64_t i = 0; i < o.n_layer; ++i) blocks->push_back(std::make_shared<GptBlock>(o.d_model, o.n_head));
  ln_f = register_module("ln_f", std::make_shared<LayerNorm>(o.d_model));
  // normal(0, 0.02) for every matrix and embedding, zero biases (LayerNorms keep 1 / 0).
  for (auto& [name, p] : named_parameters()) {
    const bool is_norm = name.find("ln") != std::string::npos;
    if (is_norm) continue;
    if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) init::zeros_(p);
    else init::normal_(p, 0.0, 0.02);
  }
}

Tensor Gpt::forward(const Tensor& idx) {
  TANDEM_CHECK(idx.dim() == 2, ShapeError, "GPT: expected token indices of shape (B, T), got {}", shape_str(idx.shape()));
  const int64_t T = idx.size(1);
  TANDEM_CHECK(T <= options.context, ShapeError, "GPT: sequence length {} exceeds the context {}", T, options.context);
  Tensor x = ops::add((*tok_emb)(idx), (*pos_emb)(arange(static_cast<double>(T))));
  for (size_t i = 0; i < blocks->size(); ++i) x = (*(*blocks)[i])(x);
  return ops::linear((*ln_f)(x), tok_emb->weight);  // head tied to the token embedding
}

Tensor Gpt::generate(const Tensor& idx_in, int64_t n, double temperature, Generator* gen) {
  TANDEM_CHECK(temperature > 0, ValueError, "GPT.generate: temperature must be positive, got {}", temperature);
  TANDEM_CHECK(!is_floating(idx_in.dtype()), DTypeError,
               "GPT.generate: token ids must be integers, got {} (a float id would be truncated)",
               dtype_name(idx_in.dtype()));
  TANDEM_CHECK(idx_in.dim() == 2 && idx_in.size(1) >= 1, ShapeError,
               "GPT.generate: expected a prompt of token ids of shape (batch, T) with T >= 1, got shape {}; give at "
               "least one token per sequence (a 1-d prompt: unsqueeze(0) it)",
               shape_str(idx_in.shape()));
  TANDEM_CHECK(n >= 0, ValueError, "GPT.generate: the number of new tokens must be >= 0, got {}", n);
  NoGradGuard no_grad;
  Generator& g = gen ? *gen : default_generator();
  Tensor idx = idx_in.to(kInt64).contiguous();
  const int64_t B = idx.size(0);
  for (int64_t step = 0; step < n; ++step) {
    const int64_t T = idx.size(1);
    const Tensor window = T > options.context ? idx.narrow(1, T - options.context, options.context) : idx;
    const Tensor logits = forward(window).select(1, window.size(1) - 1);  // (B, V)
    const Tensor probs = ops::softmax(ops::div(logits.to(kFloat64), temperature), -1).contiguous();
    Tensor next = empty({B, 1}, kInt64);
    const double* p = probs.data_ptr<double>();
    for (int64_t i = 0; i < probs.numel(); ++i) {
      // torch.multinomial: "probability tensor contains either inf, nan or element < 0" (weights
      // that diverged); the sampler would otherwise return the last token every time.
      TANDEM_CHECK(std::isfinite(p[i]) && p[i] >= 0, ValueError,
                   "GPT.generate: the next-token probabilities contain {} (the model's weights or logits are not "
                   "finite)",
                   p[i]);
    }
    const uint64_t base = g.reserve(2 * static_cast<uint64_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      const double u = g.uniform_double(base, static_cast<uint64_t>(b));
      double acc = 0;
      int64_t choice = options.vocab_size - 1;
      for (int64_t v = 0; v < options.vocab_size; ++v) {
        acc += p[b * options.vocab_size + v];
        if (u < acc) {
          choice = v;
          break;
        }
      }
      next.data_ptr<int64_t>()[b] = choice;
    }
    idx = ops::cat({idx, next}, 1);
  }
  return idx;
}

std::shared_ptr<Gpt> gpt(const GptOptions& o) { return std::make_shared<Gpt>(o); }

}  // namespace tandem::nn::models
