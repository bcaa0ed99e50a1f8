// Grad mode: whether ops record autograd history. Thread-local, switched by RAII guards.
#pragma once

namespace tandem::autograd {

bool is_grad_enabled();
void set_grad_enabled(bool enabled);

// Sets grad mode for a scope and restores the previous mode on exit.
class AutoGradMode {
 public:
  explicit AutoGradMode(bool enabled) : prev_(is_grad_enabled()) { set_grad_enabled(enabled); }
  ~AutoGradMode() { set_grad_enabled(prev_); }
  AutoGradMode(const AutoGradMode&) = delete;
  AutoGradMode& operator=(const AutoGradMode&) = delete;

 private:
  bool prev_;
};

}  // namespace tandem::autograd

namespace tandem {
// Disables gradient recording in its scope (torch.no_grad()).
class NoGradGuard : public autograd::AutoGradMode {
 public:
  NoGradGuard() : AutoGradMode(false) {}
};
}  // namespace tandem
