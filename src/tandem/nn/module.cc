#include "tandem/nn/module.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <optional>
#include <sstream>

#include "tandem/autograd/grad_mode.h"

namespace tandem::nn {

Tensor Module::forward(const Tensor&) {
  throw Error(fmt::format("{}: this module has no single-tensor forward()", type_name_));
}

void Module::check_name(const std::string& name, const char* what) const {
  TANDEM_CHECK(!name.empty() && name.find('.') == std::string::npos, ValueError,
               "{}: {} name \"{}\" must be non-empty and contain no '.'", type_name_, what, name);
  auto taken = [&](const auto& list) {
    return std::any_of(list.begin(), list.end(), [&](const auto& p) { return p.first == name; });
  };
  TANDEM_CHECK(!taken(params_) && !taken(buffers_) && !taken(children_), ValueError,
               "{}: attribute \"{}\" is already registered", type_name_, name);
}

Tensor Module::register_parameter(const std::string& name, Tensor t, bool requires_grad) {
  check_name(name, "parameter");
  TANDEM_CHECK(t.defined(), ValueError, "{}: parameter \"{}\" is undefined", type_name_, name);
  t = t.is_leaf() ? t : t.detach();
  if (requires_grad) t.requires_grad_(true);
  params_.emplace_back(name, t);
  return t;
}

Tensor Module::register_buffer(const std::string& name, Tensor t, bool persistent) {
  check_name(name, "buffer");
  buffers_.emplace_back(name, t);
  if (!persistent) non_persistent_.push_back(name);
  return t;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> m) {
  check_name(name, "submodule");
  TANDEM_CHECK(m != nullptr, ValueError, "{}: submodule \"{}\" is null", type_name_, name);
  children_.emplace_back(name, std::move(m));
}

void Module::collect(const std::string& prefix, bool params, bool recurse, bool persistent_only, bool dedup,
                     NamedTensors& out, std::vector<const TensorImpl*>& seen) const {
  for (const auto& [name, t] : params ? params_ : buffers_) {
    if (!t.defined()) continue;
    if (persistent_only && std::find(non_persistent_.begin(), non_persistent_.end(), name) != non_persistent_.end())
      continue;
    const TensorImpl* key = &t.impl();
    if (dedup && std::find(seen.begin(), seen.end(), key) != seen.end()) continue;
    seen.push_back(key);
    out.emplace_back(prefix + name, t);
  }
  if (!recurse) return;
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", params, true, persistent_only, dedup, out, seen);
}

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors out;
  std::vector<const TensorImpl*> seen;
  collect("", true, recurse, false, true, out, seen);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors out;
  std::vector<const TensorImpl*> seen;
  collect("", false, recurse, false, true, out, seen);
  return out;
}

std::vector<Tensor> Module::buffers(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_buffers(recurse)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_children() const {
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> out;
  for (const auto& [name, c] : children_) {
    if (std::none_of(out.begin(), out.end(), [&](const auto& p) { return p.second == c; })) out.emplace_back(name, c);
  }
  return out;
}

std::vector<std::shared_ptr<Module>> Module::children() const {
  std::vector<std::shared_ptr<Module>> out;
  for (auto& [name, c] : named_children()) out.push_back(c);
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_modules() {
  // PyTorch's memo: a module reached a second time (registered under two names, or shared by two
  // parents) is skipped with its whole subtree.
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> out;
  std::vector<const Module*> seen;
  std::function<void(const std::string&, std::shared_ptr<Module>)> walk = [&](const std::string& prefix,
                                                                             std::shared_ptr<Module> m) {
    if (std::find(seen.begin(), seen.end(), m.get()) != seen.end()) return;
    seen.push_back(m.get());
    out.emplace_back(prefix, m);
    for (auto& [name, c] : m->children_) walk(prefix.empty() ? name : prefix + "." + name, c);
  };
  // A module not owned by a shared_ptr (on the stack, or inside its own constructor) is listed
  // through a non-owning pointer, valid as long as the module itself.
  std::shared_ptr<Module> self = weak_from_this().lock();
  walk("", self ? self : std::shared_ptr<Module>(std::shared_ptr<Module>(), this));
  return out;
}

std::vector<std::shared_ptr<Module>> Module::modules() {
  std::vector<std::shared_ptr<Module>> out;
  for (auto& [name, m] : named_modules()) out.push_back(m);
  return out;
}

Module& Module::apply(const std::function<void(Module&)>& fn) {
  for (const auto& c : children()) c->apply(fn);
  fn(*this);
  return *this;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (const Tensor& p : parameters()) n += p.numel();
  return n;
}

Module& Module::train(bool on) {
  training_ = on;
  for (auto& [name, c] : children_) c->train(on);
  return *this;
}

Module& Module::requires_grad_(bool requires_grad) {
  for (Tensor& p : parameters()) p.requires_grad_(requires_grad);
  return *this;
}

namespace {

// Re-points t's TensorImpl at a converted copy of its data, so every holder sees the change.
void convert_in_place(const Tensor& t, DType dtype) {
  if (!t.defined() || !is_floating(t.dtype()) || t.dtype() == dtype) return;
  Tensor converted = t.detach().to(dtype).contiguous();
  TensorImpl& impl = t.impl();
  impl.storage = converted.storage();
  impl.strides = converted.strides();
  impl.offset = converted.offset();
  impl.dtype = dtype;
}

// The fix when the keys differ by one leading prefix, as between a DistributedDataParallel's
// state_dict ("module.fc.weight") and its model's ("fc.weight"): every unexpected key is a
// missing one with a prefix, or the other way round. Empty otherwise.
std::string prefix_hint(const std::vector<std::string>& missing, const std::vector<std::string>& unexpected) {
  if (missing.empty() || missing.size() != unexpected.size()) return "";
  // The prefix that turns `shorter` into `longer`, the same for every key, or none.
  const auto common_prefix = [](const std::vector<std::string>& shorter,
                                const std::vector<std::string>& longer) -> std::optional<std::string> {
    std::optional<std::string> prefix;
    std::vector<std::string> rest;
    for (const auto& key : longer) {
      const size_t dot = key.find('.');
      if (dot == std::string::npos) return std::nullopt;
      const std::string p = key.substr(0, dot + 1);
      if (prefix && *prefix != p) return std::nullopt;
      prefix = p;
      rest.push_back(key.substr(dot + 1));
    }
    std::vector<std::string> a = shorter;
    std::sort(a.begin(), a.end());
    std::sort(rest.begin(), rest.end());
    if (a != rest) return std::nullopt;
    return prefix;
  };
  if (auto p = common_prefix(missing, unexpected)) {
    return fmt::format(
        ". Every checkpoint key is a model key with the prefix \"{}\" (a DistributedDataParallel's state_dict names "
        "the model \"module.\"): load it into the wrapper, or strip the prefix first with "
        "nn::consume_prefix_in_state_dict_if_present(state, \"{}\")",
        *p, *p);
  }
  if (auto p = common_prefix(unexpected, missing)) {
    return fmt::format(
        ". Every model key is a checkpoint key with the prefix \"{}\": the checkpoint holds the bare model and this "
        "module wraps it (DistributedDataParallel names it \"module.\"); load it into the wrapped module "
        "(ddp.module()->load_state_dict)",
        *p);
  }
  return "";
}

}  // namespace

void consume_prefix_in_state_dict_if_present(StateDict& state, const std::string& prefix) {
  for (auto& [key, t] : state) {
    if (key.compare(0, prefix.size(), prefix) == 0) key.erase(0, prefix.size());
  }
}

Module& Module::to(DType dtype) {
  TANDEM_CHECK(is_floating(dtype), DTypeError, "{}.to: expected a floating dtype, got {}", type_name_, dtype_name(dtype));
  for (auto& [name, p] : named_parameters()) {
    convert_in_place(p, dtype);
    if (p.grad().defined()) convert_in_place(p.grad(), dtype);
  }
  for (auto& [name, b] : named_buffers()) convert_in_place(b, dtype);
  return *this;
}

void Module::zero_grad(bool set_to_none) {
  for (Tensor& p : parameters()) {
    if (!p.grad().defined()) continue;
    if (set_to_none) {
      p.set_grad(Tensor());
    } else {
      NoGradGuard no_grad;
      Tensor g = p.grad();
      if (g.grad_fn()) {  // a gradient from backward(create_graph=true): keep its storage, drop the graph
        g = g.detach();
        p.set_grad(g);
      }
      g.zero_();
    }
  }
}

StateDict Module::state_dict() const {
  // PyTorch's order: each module's own parameters, then its persistent buffers, then its
  // children's, depth first ("features.1.weight", "features.1.bias", "features.1.running_mean").
  StateDict out;
  std::function<void(const Module&, const std::string&)> walk = [&](const Module& m, const std::string& prefix) {
    std::vector<const TensorImpl*> seen;
    m.collect(prefix, true, false, false, false, out, seen);
    m.collect(prefix, false, false, true, false, out, seen);
    for (const auto& [name, child] : m.children_) walk(*child, prefix + name + ".");
  };
  walk(*this, "");
  return out;
}

IncompatibleKeys Module::load_state_dict(const StateDict& state, bool strict) {
  const StateDict mine = state_dict();
  std::map<std::string, const Tensor*> given;
  for (const auto& [name, t] : state) given[name] = &t;
  // ---- validate everything first, so a bad file changes nothing ----
  std::set<std::string> optional;
  for (const auto& [prefix, m] : named_modules()) {
    for (const std::string& k : m->optional_state_keys()) optional.insert(prefix.empty() ? k : prefix + "." + k);
  }
  std::vector<std::string> missing, unexpected;
  for (const auto& [name, t] : mine) {
    auto it = given.find(name);
    if (it == given.end()) {
      if (!optional.count(name)) missing.push_back(name);
      continue;
    }
    TANDEM_CHECK(it->second->defined(), ValueError, "load_state_dict: the checkpoint's \"{}\" is an undefined tensor",
                 name);
    TANDEM_CHECK(it->second->shape() == t.shape(), ValueError,
                 "load_state_dict: size mismatch for \"{}\": the checkpoint has shape {}, the model has {}", name,
                 shape_str(it->second->shape()), shape_str(t.shape()));
  }
  // Unexpected keys in PyTorch's order: module by module as state_dict walks them, each module
  // naming the checkpoint keys under its prefix whose next component is neither one of its
  // children nor one of its own parameters / persistent buffers. Stricter than PyTorch in two
  // corners it skips silently: a key continuing past a tensor's name ("emb.weight.x") and a key
  // that is a bare child name ("body").
  std::function<void(const Module&, const std::string&)> walk = [&](const Module& m, const std::string& prefix) {
    const auto is_child = [&](const std::string& n) {
      return std::any_of(m.children_.begin(), m.children_.end(), [&](const auto& c) { return c.first == n; });
    };
    const auto is_local = [&](const std::string& n) {
      const auto named = [&](const NamedTensors& list) {
        return std::any_of(list.begin(), list.end(), [&](const auto& p) { return p.first == n && p.second.defined(); });
      };
      return named(m.params_) ||
             (named(m.buffers_) && std::find(m.non_persistent_.begin(), m.non_persistent_.end(), n) == m.non_persistent_.end());
    };
    for (const auto& [key, t] : state) {
      if (key.compare(0, prefix.size(), prefix) != 0) continue;
      const std::string rest = key.substr(prefix.size());
      const size_t dot = rest.find('.');
      const std::string first = rest.substr(0, dot);
      const bool more = dot != std::string::npos;
      if ((more && is_child(first)) || (!more && is_local(first))) continue;
      if (std::find(unexpected.begin(), unexpected.end(), key) == unexpected.end()) unexpected.push_back(key);
    }
    for (const auto& [name, child] : m.children_) walk(*child, prefix + name + ".");
  };
  walk(*this, "");
  if (strict && (!missing.empty() || !unexpected.empty())) {
    auto join = [](const std::vector<std::string>& v) {
      std::string s;
      for (const auto& x : v) s += (s.empty() ? "\"" : ", \"") + x + "\"";
      return s.empty() ? std::string("none") : s;
    };
    throw ValueError(fmt::format("load_state_dict ({}): missing keys: {}; unexpected keys: {}{}", type_name_,
                                 join(missing), join(unexpected), prefix_hint(missing, unexpected)));
  }
  NoGradGuard no_grad;
  for (const auto& [name, t] : mine) {
    auto it = given.find(name);
    if (it == given.end()) continue;
    Tensor dst = t;
    dst.copy_(*it->second);
  }
  return {std::move(missing), std::move(unexpected)};
}

std::string Module::to_string() const {
  // PyTorch's Module.__repr__: a one-line extra_repr alone goes inside the parentheses; with
  // children (or a multi-line extra_repr), every line goes on its own, indented by two.
  const auto indent = [](const std::string& text) {
    std::string out;
    for (char ch : text) {
      out += ch;
      if (ch == '\n') out += "  ";
    }
    return out;
  };
  std::vector<std::string> lines;
  const std::string extra = extra_repr();
  if (!extra.empty()) lines.push_back(indent(extra));
  for (const auto& [name, c] : children_) lines.push_back("(" + name + "): " + indent(c->to_string()));
  std::string s = type_name_ + "(";
  if (children_.empty() && !extra.empty() && extra.find('\n') == std::string::npos) {
    s += extra;
  } else if (!lines.empty()) {
    for (const auto& line : lines) s += "\n  " + line;
    s += "\n";
  }
  return s + ")";
}

}  // namespace tandem::nn
