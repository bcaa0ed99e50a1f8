// W3: a byte-level GPT (pre-LayerNorm transformer). Names equal this PyTorch definition's:
//
//   tok_emb = nn.Embedding(vocab, d); pos_emb = nn.Embedding(ctx, d)
//   blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
//       Block: ln1 = nn.LayerNorm(d); attn.qkv = nn.Linear(d, 3d); attn.proj = nn.Linear(d, d)
//              ln2 = nn.LayerNorm(d); mlp.fc1 = nn.Linear(d, 4d); mlp.fc2 = nn.Linear(4d, d)
//       x = x + attn.proj(causal_sdpa(split_heads(attn.qkv(ln1(x)))))
//       x = x + mlp.fc2(gelu_tanh(mlp.fc1(ln2(x))))
//   ln_f = nn.LayerNorm(d); logits = F.linear(ln_f(x), tok_emb.weight)   # head tied to tok_emb
//
// Linear and embedding weights start normal(0, 0.02), biases zero.
#pragma once

#include <memory>

#include "tandem/nn/layers.h"
#include "tandem/nn/norm.h"

namespace tandem::nn::models {

struct GptOptions {
  int64_t vocab_size = 256;
  int64_t context = 128;
  int64_t n_layer = 4;
  int64_t d_model = 256;
  int64_t n_head = 4;
};

class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(int64_t d_model, int64_t n_head);
  Tensor forward(const Tensor& x) override;  // (B, T, d) -> (B, T, d)

  std::shared_ptr<Linear> qkv, proj;
  int64_t n_head;
};

class GptMlp : public Module {
 public:
  explicit GptMlp(int64_t d_model);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<Linear> fc1, fc2;
};

class GptBlock : public Module {
 public:
  GptBlock(int64_t d_model, int64_t n_head);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<LayerNorm> ln1, ln2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<GptMlp> mlp;
};

class Gpt : public Module {
 public:
  explicit Gpt(const GptOptions& options = {});
  // idx: (B, T) integer tokens, T <= context -> logits (B, T, vocab_size).
  Tensor forward(const Tensor& idx) override;
  // Appends `n` tokens sampled from softmax(logits / temperature) to idx (B, T), cropping the
  // context window; `gen` makes it reproducible.
  Tensor generate(const Tensor& idx, int64_t n, double temperature = 1.0, Generator* gen = nullptr);

  GptOptions options;
  std::shared_ptr<Embedding> tok_emb, pos_emb;
  std::shared_ptr<ModuleList> blocks;
  std::shared_ptr<LayerNorm> ln_f;
};

std::shared_ptr<Gpt> gpt(const GptOptions& options = {});

}  // namespace tandem::nn::models
